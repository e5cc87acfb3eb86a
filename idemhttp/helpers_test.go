package idemhttp_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
	"github.com/idemstore/idem/internal/logscan"
)

// bundle is one test's middleware over a real store, served by an
// httptest.Server.
type bundle[TTx any] struct {
	ns    *namespace[TTx] // nil when the store is unreachable
	store *idem.Store[TTx]
	feat  features
	// mux routes /orders, /orders/{id}/items and /refunds through the
	// middleware to the handler.
	mux   http.Handler
	srv   *httptest.Server
	calls atomic.Int64
	logs  *logBuffer
}

// handlerFunc is a test handler; tx is the middleware's transaction, ok
// false when the request passed through unprotected, or always in the
// leased mode, whose handlers take their transaction when they need it.
type handlerFunc[TTx any] func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool)

type options[TTx any] struct {
	cfg     *idemhttp.Config // Tenant defaults to testTenant
	idemCfg *idem.Config
	handler handlerFunc[TTx] // defaults to createOrder
	// outer wraps the whole mux, outside the middleware.
	outer func(http.Handler) http.Handler
	// unreachable serves a store whose database cannot be reached.
	unreachable bool
	// wrapDialect, when set, wraps the namespace's dialect (to inject
	// failures into one of its methods).
	wrapDialect func(idem.Dialect[TTx]) idem.Dialect[TTx]
}

// setup opens a fresh namespace (unless unreachable) and serves it.
func setup[TTx any](t *testing.T, h harness[TTx], o options[TTx]) *bundle[TTx] {
	t.Helper()
	b := &bundle[TTx]{feat: h.features(), logs: &logBuffer{}}
	logger := slog.New(slog.NewJSONHandler(b.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	var d idem.Dialect[TTx]
	if o.unreachable {
		d = h.unreachable(t)
	} else {
		b.ns = h.open(t)
		d = b.ns.dialect
	}
	if o.wrapDialect != nil {
		d = o.wrapDialect(d)
	}
	icfg := idem.Config{}
	if o.idemCfg != nil {
		icfg = *o.idemCfg
	}
	icfg.Logger = logger
	store, err := idem.New(d, &icfg)
	require.NoError(t, err)
	b.store = store

	cfg := idemhttp.Config{}
	if o.cfg != nil {
		cfg = *o.cfg
	}
	if cfg.Tenant == nil {
		cfg.Tenant = testTenant
	}
	cfg.Logger = logger
	if o.handler == nil {
		o.handler = createOrder[TTx]
	}
	b.mux = b.routes(mustNew(t, store, &cfg).Wrap, cfg.Mode, o.handler)
	served := b.mux
	if o.outer != nil {
		served = o.outer(served)
	}
	// Registered before the server's Close, so it runs after it: every
	// handler has returned and logged by then.
	scanLogs(t, b.logs)
	b.srv = httptest.NewServer(served)
	t.Cleanup(b.srv.Close)
	return b
}

// logSecrets recognise what the tests send that no log line may carry:
// keys from newKey ("k" and 24 hex digits; digests are 16 hex digits),
// the tenants and the JSON bodies the cases use.
var logSecrets = logscan.NewScanner()

func init() {
	logSecrets.Pattern("key", regexp.MustCompile(`k[0-9a-f]{24}`))
	logSecrets.Pattern("secret", regexp.MustCompile(`SECRET`))
	logSecrets.Pattern("tenant", regexp.MustCompile(`\b(acme|globex|t1)\b`))
	logSecrets.Pattern("body", regexp.MustCompile(`\\?"(amount|note|charge|card)\\?"`))
}

// scanLogs fails t, once it ended, for any line of logs holding a secret
// of logSecrets.
func scanLogs(t *testing.T, logs *logBuffer) {
	t.Cleanup(func() {
		text := strings.TrimSpace(logs.String())
		if text == "" {
			return
		}
		logSecrets.CheckLines(t, strings.Split(text, "\n"))
	})
}

// routes serves handler behind mw on three routes.
func (b *bundle[TTx]) routes(mw func(http.Handler) http.Handler, mode idemhttp.Mode, handler handlerFunc[TTx]) *http.ServeMux {
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.calls.Add(1)
		var (
			tx TTx
			ok bool
		)
		if mode != idemhttp.Leased { // Tx would begin the leased transaction
			tx, ok = idemhttp.Tx[TTx](r.Context())
		}
		handler(b, w, r, tx, ok)
	}))
	mux := http.NewServeMux()
	mux.Handle("/orders", h)
	mux.Handle("/orders/{id}/items", h)
	mux.Handle("/refunds", h)
	return mux
}

// with returns the routes behind another middleware on the same store, to
// try other configurations; call them with b.direct.
func (b *bundle[TTx]) with(cfg idemhttp.Config, handler handlerFunc[TTx]) http.Handler {
	if cfg.Tenant == nil {
		cfg.Tenant = testTenant
	}
	if handler == nil {
		handler = createOrder[TTx]
	}
	mw, err := idemhttp.New(b.store, &cfg)
	if err != nil {
		panic(err) // the tests' configurations are valid
	}
	return b.routes(mw.Wrap, cfg.Mode, handler)
}

// mustNew returns the middleware for cfg, failing the test if New refuses it.
func mustNew[TTx any](tb testing.TB, store *idem.Store[TTx], cfg *idemhttp.Config) *idemhttp.Middleware[TTx] {
	tb.Helper()
	mw, err := idemhttp.New(store, cfg)
	require.NoError(tb, err)
	return mw
}

// testTenant reads the tenant from X-Tenant: missing is a 400 chosen by
// the hook, "?" an error the middleware renders itself, "!" an *Error
// without a status.
func testTenant(r *http.Request) (string, error) {
	switch t := r.Header.Get("X-Tenant"); t {
	case "":
		return "", &idemhttp.Error{Status: http.StatusBadRequest, Code: "tenant_missing", Message: "X-Tenant is required."}
	case "?":
		return "", errors.New("unknown tenant")
	case "!":
		return "", &idemhttp.Error{Code: "tenant_blocked"} // no status: 400

	default:
		return t, nil
	}
}

// orderInput is the JSON body createOrder reads.
type orderInput struct {
	Amount int64 `json:"amount"`
}

// createOrder writes one order on the middleware's transaction and answers
// 201 with its Location; a body it cannot read gets 400.
func createOrder[TTx any](b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
	if !ok {
		http.Error(w, "no transaction", http.StatusTeapot)
		return
	}
	var in orderInput
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
		http.Error(w, "bad body", http.StatusBadRequest)
		return
	}
	id, err := b.insert(r, tx, in.Amount)
	if err != nil {
		http.Error(w, "insert failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%d,"amount":%d}`, id, in.Amount) //nolint:gosec // test handler writing JSON of two integers: nothing to escape
}

// insert writes an order for r's tenant and key on tx.
func (b *bundle[TTx]) insert(r *http.Request, tx TTx, amount int64) (int64, error) {
	key, _ := idemhttp.Key(r.Context())
	return b.ns.insertOrder(r.Context(), tx, r.Header.Get("X-Tenant"), key, amount)
}

// ---- requests ----

// reply is a response as the client saw it.
type reply struct {
	status int
	header http.Header
	body   []byte
}

func (r *reply) replayed() bool { return r.header.Get("Idempotency-Replayed") == "true" }

// errorBody decodes the JSON error contract, failing t if the body is not
// exactly that.
func (r *reply) errorBody(t *testing.T) (code, message, requestID string) {
	t.Helper()
	require.Equal(t, "application/json", r.header.Get("Content-Type"), "error responses are JSON")
	var body map[string]string
	dec := json.NewDecoder(bytes.NewReader(r.body))
	require.NoError(t, dec.Decode(&body), "body %q", r.body)
	require.Len(t, body, 3, "exactly code, message and request_id: %q", r.body)
	return body["code"], body["message"], body["request_id"]
}

// code returns the error code of an error response.
func (r *reply) code(t *testing.T) string {
	t.Helper()
	c, _, _ := r.errorBody(t)
	return c
}

// opt changes a request before it is sent.
type opt func(*http.Request)

func tenant(t string) opt { return func(r *http.Request) { r.Header.Set("X-Tenant", t) } }

func header(k, v string) opt { return func(r *http.Request) { r.Header.Add(k, v) } }

func path(p string) opt {
	return func(r *http.Request) {
		u, err := r.URL.Parse(p)
		if err != nil {
			panic(err)
		}
		r.URL = u
	}
}

func method(m string) opt { return func(r *http.Request) { r.Method = m } }

func contentType(ct string) opt { return func(r *http.Request) { r.Header.Set("Content-Type", ct) } }

// gzipped compresses the request body.
func gzipped() opt {
	return func(r *http.Request) {
		raw, err := io.ReadAll(r.Body)
		if err != nil {
			panic(err)
		}
		z := gzipBytes(raw)
		r.Body = io.NopCloser(bytes.NewReader(z))
		r.ContentLength = int64(len(z))
		r.Header.Set("Content-Encoding", "gzip")
	}
}

func gzipBytes(data []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	if _, err := zw.Write(data); err != nil {
		panic(err)
	}
	if err := zw.Close(); err != nil {
		panic(err)
	}
	return buf.Bytes()
}

// newRequest builds a POST /orders for tenant t1 with a JSON body and, if
// key is not empty, the key header.
func (b *bundle[TTx]) newRequest(t *testing.T, key, body string, opts ...opt) *http.Request {
	t.Helper()
	r, err := http.NewRequestWithContext(t.Context(), http.MethodPost, b.srv.URL+"/orders", strings.NewReader(body))
	require.NoError(t, err)
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("X-Tenant", "t1")
	if key != "" {
		r.Header.Set("Idempotency-Key", key)
	}
	for _, o := range opts {
		o(r)
	}
	return r
}

// post sends a request to the test server.
func (b *bundle[TTx]) post(t *testing.T, key, body string, opts ...opt) *reply {
	t.Helper()
	return b.send(t, b.newRequest(t, key, body, opts...))
}

func (b *bundle[TTx]) send(t *testing.T, r *http.Request) *reply {
	t.Helper()
	rep, err := b.roundTrip(r)
	require.NoError(t, err)
	return rep
}

// tryPost is post for goroutines other than the test's, where require
// cannot stop the test.
func (b *bundle[TTx]) tryPost(t *testing.T, key, body string, opts ...opt) (*reply, error) {
	t.Helper()
	return b.roundTrip(b.newRequest(t, key, body, opts...))
}

// postAsync sends a request from another goroutine; the returned function
// waits for its reply.
func (b *bundle[TTx]) postAsync(t *testing.T, key, body string, opts ...opt) func() *reply {
	t.Helper()
	r := b.newRequest(t, key, body, opts...)
	type result struct {
		rep *reply
		err error
	}
	ch := make(chan result, 1)
	go func() {
		rep, err := b.roundTrip(r)
		ch <- result{rep, err}
	}()
	return func() *reply {
		t.Helper()
		res := <-ch
		require.NoError(t, res.err)
		return res.rep
	}
}

func (b *bundle[TTx]) roundTrip(r *http.Request) (*reply, error) {
	resp, err := b.srv.Client().Do(r)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	return &reply{status: resp.StatusCode, header: resp.Header, body: body}, nil
}

// direct serves a request on h in this goroutine, for configurations other
// than the server's and for header values a client refuses to send.
func (b *bundle[TTx]) direct(t *testing.T, h http.Handler, key, body string, opts ...opt) *reply {
	t.Helper()
	r := b.newRequest(t, key, body, opts...)
	r.RequestURI = r.URL.RequestURI()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	res := rec.Result()
	return &reply{status: res.StatusCode, header: res.Header, body: rec.Body.Bytes()}
}

// ---- database state ----

func (b *bundle[TTx]) orders(t *testing.T) int {
	t.Helper()
	n, err := b.ns.countOrders(context.WithoutCancel(t.Context()))
	require.NoError(t, err)
	return n
}

func (b *bundle[TTx]) records(t *testing.T) int {
	t.Helper()
	n, err := b.ns.countRecords(context.WithoutCancel(t.Context()))
	require.NoError(t, err)
	return n
}

// newKey returns a fresh valid key.
func newKey() string {
	var buf [12]byte
	_, _ = rand.Read(buf[:])
	return "k" + hex.EncodeToString(buf[:])
}

// logBuffer collects log output from several goroutines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf.Reset()
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// records decodes the JSON log lines with the given message.
func (l *logBuffer) records(t *testing.T, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for line := range strings.SplitSeq(strings.TrimSpace(l.String()), "\n") {
		if line == "" {
			continue
		}
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), line)
		if rec["msg"] == msg {
			out = append(out, rec)
		}
	}
	return out
}
