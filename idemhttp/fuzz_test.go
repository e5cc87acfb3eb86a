package idemhttp_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// fuzzLimit and fuzzDepth are the middleware's MaxBodyBytes and
// MaxJSONDepth in FuzzMiddleware: a limit small enough for the fuzzer to
// cross it with the repeat input, large enough for 100 000 levels of
// nesting to be refused for their depth, not their size.
const (
	fuzzLimit = 256 << 10
	fuzzDepth = 64
	// fuzzMaxBody caps the generated body, so an input cannot make one
	// iteration slow.
	fuzzMaxBody = 1 << 20
)

// Flags of FuzzMiddleware's flags input.
const (
	fuzzLeased    = 1 << iota // serve through the leased mode
	fuzzGzip                  // gzip the generated body (Content-Encoding: gzip is set)
	fuzzTruncated             // declare 100 bytes more than sent; the body ends with io.ErrUnexpectedEOF
)

// fuzzEnv is one fuzz worker's SQLite store and middlewares: fuzzing
// workers are processes, each runs FuzzMiddleware's setup once.
type fuzzEnv struct {
	db            *sql.DB
	store         *idem.Store[*sql.Tx]
	transactional http.Handler
	leased        http.Handler
	calls         atomic.Int64
	namespace     atomic.Int64
	// logs holds the current input's log records (inputs run one at a
	// time in a worker).
	logs logBuffer
}

func newFuzzEnv(f *testing.F) *fuzzEnv {
	f.Helper()
	db, err := idemsqlite.Open(filepath.Join(f.TempDir(), "fuzz.db"))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = db.Close() })
	if err := idemsqlite.Migrate(context.Background(), db); err != nil {
		f.Fatal(err)
	}
	if _, err := db.ExecContext(context.Background(), `CREATE TABLE orders (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, idem_key TEXT NOT NULL, body_sha TEXT NOT NULL)`); err != nil {
		f.Fatal(err)
	}
	store, err := idem.New(idemsqlite.New(db), nil)
	if err != nil {
		f.Fatal(err)
	}
	e := &fuzzEnv{db: db, store: store}
	cfg := idemhttp.Config{
		Logger:       slog.New(slog.NewJSONHandler(&e.logs, nil)),
		MaxBodyBytes: fuzzLimit,
		MaxJSONDepth: fuzzDepth,
		Tenant:       func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant"), nil },
	}
	e.transactional = mustNew(f, store, &cfg).Wrap(http.HandlerFunc(e.handle))
	// The leased middleware answers a mismatch with the IETF draft's 422,
	// so both documented statuses are fuzzed.
	cfg.Mode, cfg.MismatchStatus = idemhttp.Leased, idemhttp.MismatchStatusIETF
	e.leased = mustNew(f, store, &cfg).Wrap(http.HandlerFunc(e.handle))
	return e
}

// handle writes one order for the body it got and answers 201 with a body
// that depends on it, so that a replay of another request would show.
func (e *fuzzEnv) handle(w http.ResponseWriter, r *http.Request) {
	e.calls.Add(1)
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "unreadable body", http.StatusTeapot)
		return
	}
	tx, ok := idemhttp.Tx[*sql.Tx](r.Context())
	if !ok {
		http.Error(w, "no transaction", http.StatusTeapot)
		return
	}
	key, _ := idemhttp.Key(r.Context())
	sum := sha256.Sum256(body)
	res, err := tx.ExecContext(r.Context(), `INSERT INTO orders (tenant, idem_key, body_sha) VALUES (?, ?, ?)`,
		r.Header.Get("X-Tenant"), key, hex.EncodeToString(sum[:]))
	if err != nil {
		http.Error(w, "insert failed", http.StatusTeapot)
		return
	}
	id, _ := res.LastInsertId()
	w.Header().Set("Location", "/orders/"+strconv.FormatInt(id, 10))
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%d,"len":%d,"sha":%q}`, id, len(body), hex.EncodeToString(sum[:8])) //nolint:gosec // test handler writing JSON of two integers and a hex digest: nothing to escape
}

func (e *fuzzEnv) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	if err := e.db.QueryRowContext(t.Context(), query, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// fuzzInput is one FuzzMiddleware input, turned into requests.
type fuzzInput struct {
	key                 string // header lines, split on "\n"; "" is no header
	contentType, coding string
	body                []byte // after repeat, and gzip if asked
	declared            int64
	truncated, leased   bool
}

func newFuzzInput(key, contentType, coding string, body []byte, repeat, flags int) fuzzInput {
	in := fuzzInput{key: key, contentType: contentType, coding: coding, leased: flags&fuzzLeased != 0, truncated: flags&fuzzTruncated != 0}
	if n := max(repeat, 0) % (1 << 17); n > 0 && len(body) > 0 {
		body = bytes.Repeat(body, min(n+1, fuzzMaxBody/len(body)+1))
	}
	if len(body) > fuzzMaxBody {
		body = body[:fuzzMaxBody]
	}
	if flags&fuzzGzip != 0 {
		body = gzipBytes(body)
		in.coding = "gzip"
	}
	in.body = body
	in.declared = int64(len(body))
	if in.truncated {
		in.declared += 100
	}
	return in
}

// request builds in's request for tenant, with a fresh body.
func (in fuzzInput) request(tenant string) *http.Request {
	r := httptest.NewRequestWithContext(context.Background(), http.MethodPost, "/orders", nil)
	var body io.Reader = bytes.NewReader(in.body)
	if in.truncated {
		body = io.MultiReader(body, errReader{io.ErrUnexpectedEOF})
	}
	r.Body = io.NopCloser(body)
	r.ContentLength = in.declared
	r.Header = http.Header{}
	r.Header.Set("X-Tenant", tenant)
	if in.key != "" {
		r.Header["Idempotency-Key"] = strings.Split(in.key, "\n")
	}
	if in.contentType != "" {
		r.Header["Content-Type"] = []string{in.contentType}
	}
	if in.coding != "" {
		r.Header["Content-Encoding"] = []string{in.coding}
	}
	return r
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// expected is what the middleware must answer in, from the documented
// rules, before any handler runs: ok when it must call the handler.
func (in fuzzInput) expected() (status int, code string, ok bool) {
	r := in.request("t")
	if _, c := idemhttp.ParseKey(r.Header.Values("Idempotency-Key"), idemhttp.DefaultKeyFormat); c != "" {
		return http.StatusBadRequest, c, false
	}
	tooLarge := func() (int, string, bool) { return http.StatusRequestEntityTooLarge, idemhttp.CodeBodyTooLarge, false }
	invalid := func() (int, string, bool) { return http.StatusBadRequest, idemhttp.CodeBodyInvalid, false }
	if in.declared > fuzzLimit || int64(len(in.body)) > fuzzLimit {
		return tooLarge()
	}
	if in.truncated {
		return invalid()
	}
	data := in.body
	switch fuzzCoding(r.Header.Values("Content-Encoding")) {
	case "other":
		return 0, "", true // passed on as sent, whatever the media type says
	case "gzip":
		if len(data) > 0 {
			zr, err := gzip.NewReader(bytes.NewReader(data))
			if err != nil {
				return invalid()
			}
			dec, err := io.ReadAll(io.LimitReader(zr, fuzzLimit+1))
			switch {
			case err != nil:
				return invalid()
			case len(dec) > fuzzLimit:
				return tooLarge()
			}
			data = dec
		}
	}
	mt, _, err := mime.ParseMediaType(in.contentType)
	if err != nil {
		mt = in.contentType
	}
	isJSON := mt == "application/json" || strings.HasSuffix(mt, "+json")
	if isJSON && len(bytes.Trim(data, " \t\r\n")) > 0 && (!json.Valid(data) || jsonDepth(data) > fuzzDepth) {
		return invalid()
	}
	return 0, "", true
}

// fuzzCoding classifies Content-Encoding lines as docs/http.md does: none
// (or identity), one gzip layer, or anything else.
func fuzzCoding(values []string) string {
	var codings []string
	for _, v := range values {
		for _, c := range strings.Split(v, ",") {
			if c = strings.ToLower(strings.TrimSpace(c)); c != "" && c != "identity" {
				codings = append(codings, c)
			}
		}
	}
	switch {
	case len(codings) == 0:
		return ""
	case len(codings) == 1 && (codings[0] == "gzip" || codings[0] == "x-gzip"):
		return "gzip"
	default:
		return "other"
	}
}

// jsonDepth returns how deeply valid JSON text nests arrays and objects.
func jsonDepth(data []byte) int {
	depth, deepest, inString, escaped := 0, 0, false, false
	for _, c := range data {
		switch {
		case escaped:
			escaped = false
		case inString && c == '\\':
			escaped = true
		case c == '"':
			inString = !inString
		case inString:
		case c == '[' || c == '{':
			depth++
			deepest = max(deepest, depth)
		case c == ']' || c == '}':
			depth--
		}
	}
	return deepest
}

// FuzzMiddleware sends fuzzed requests (key header lines, Content-Type,
// Content-Encoding, body, a repeat count to make it large, and flags: the
// leased mode, gzip, a body cut short) through the middleware to a handler
// on a real SQLite store, and checks the protocol's promises: no panic, no
// 5xx (the store is healthy and the handler small, so none of the
// documented ones can happen), the JSON error contract with the documented
// status and code on every refusal, the handler called exactly when the
// request is valid, a byte-identical replay marked Idempotency-Replayed,
// idempotency_key_reused for another request under the same key (409, or
// 422 with MismatchStatusIETF in the leased mode), another tenant never
// replayed, and no raw key or tenant in the logs. The requests are served
// in process, so
// that header bytes a proxy might forward reach the middleware;
// TestHostileInput sends the hostile cases over a real connection.
func FuzzMiddleware(f *testing.F) {
	for _, s := range []struct {
		key, ct, ce   string
		body          string
		repeat, flags int
	}{
		{"abcdefghijkl", "application/json", "", `{"amount":1}`, 0, 0},
		{"abcdefghijkl", "application/json", "", `{"amount":1}`, 0, fuzzLeased},
		{"abcdefghijkl", "application/json", "", `{"amount":1}`, 0, fuzzGzip},
		{"abcdefghijkl", "text/plain", "br", "raw", 0, 0},
	} {
		f.Add(s.key, s.ct, s.ce, []byte(s.body), s.repeat, s.flags)
	}
	e := newFuzzEnv(f)
	f.Fuzz(func(t *testing.T, key, contentType, coding string, body []byte, repeat, flags int) {
		in := newFuzzInput(key, contentType, coding, body, repeat, flags)
		h := e.transactional
		if in.leased {
			h = e.leased
		}
		// A tenant per iteration: the store is shared by every iteration
		// of the worker, and this keeps them from meeting.
		tenant := "fuzz-tenant-" + strconv.FormatInt(e.namespace.Add(1), 10)
		wantStatus, wantCode, valid := in.expected()
		e.logs.reset()
		defer func() {
			// Keys and tenants never reach the logs raw (key lines of 12 bytes or more).
			logs := e.logs.String()
			for _, secret := range append(strings.Split(in.key, "\n"), tenant) {
				if len(secret) >= 12 && strings.Contains(logs, secret) {
					t.Fatalf("the logs hold a raw key or tenant %q", secret)
				}
			}
		}()
		callsBefore := e.calls.Load()
		recordsBefore := e.count(t, `SELECT count(*) FROM idempotency_keys`)
		first := serveFuzz(h, in.request(tenant))
		checkNo5xx(t, first)
		if !valid {
			if e.calls.Load() != callsBefore {
				t.Fatalf("the handler ran for an invalid request (want %d %s)", wantStatus, wantCode)
			}
			if first.status != wantStatus || fuzzErrorCode(t, first) != wantCode {
				t.Fatalf("got %d %s, want %d %s", first.status, first.body, wantStatus, wantCode)
			}
			if n := e.count(t, `SELECT count(*) FROM idempotency_keys`); n != recordsBefore {
				t.Fatalf("an invalid request stored a record")
			}
			return
		}
		if e.calls.Load() != callsBefore+1 {
			t.Fatalf("the handler did not run for a valid request: %d %s", first.status, first.body)
		}
		if first.status != http.StatusCreated {
			t.Fatalf("valid request: got %d %s", first.status, first.body)
		}
		if first.replayed() {
			t.Fatalf("a first request was marked replayed")
		}

		again := serveFuzz(h, in.request(tenant))
		switch {
		case e.calls.Load() != callsBefore+1:
			t.Fatalf("the handler ran again for a replay")
		case again.status != first.status || !bytes.Equal(again.body, first.body) || !again.replayed():
			t.Fatalf("replay: got %d %q replayed=%v, want %d %q", again.status, again.body, again.replayed(), first.status, first.body)
		case again.header.Get("Location") != first.header.Get("Location"):
			t.Fatalf("replay: Location %q, want %q", again.header.Get("Location"), first.header.Get("Location"))
		}

		if !strings.Contains(strings.ToLower(in.contentType), "x-idem-fuzz-other") {
			other := fuzzInput{key: in.key, contentType: "application/x-idem-fuzz-other", body: []byte("other"), declared: 5, leased: in.leased}
			r := serveFuzz(h, other.request(tenant))
			if e.calls.Load() != callsBefore+1 {
				t.Fatalf("the handler ran for another request under a used key")
			}
			wantMismatch := http.StatusConflict
			if in.leased {
				wantMismatch = idemhttp.MismatchStatusIETF
			}
			if r.status != wantMismatch || fuzzErrorCode(t, r) != idemhttp.CodeKeyReused {
				t.Fatalf("another request under the same key: got %d %s", r.status, r.body)
			}
		}

		stranger := serveFuzz(h, in.request(tenant+"-other"))
		if stranger.replayed() || stranger.status != http.StatusCreated || e.calls.Load() != callsBefore+2 {
			t.Fatalf("another tenant with the same key and body: got %d replayed=%v, handler runs %d", stranger.status, stranger.replayed(), e.calls.Load()-callsBefore)
		}
		if n := e.count(t, `SELECT count(*) FROM orders WHERE tenant IN (?, ?)`, tenant, tenant+"-other"); n != 2 {
			t.Fatalf("%d orders for two tenants, want 2", n)
		}
	})
}

func serveFuzz(h http.Handler, r *http.Request) *reply {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	res := rec.Result()
	return &reply{status: res.StatusCode, header: res.Header, body: rec.Body.Bytes()}
}

func checkNo5xx(t *testing.T, r *reply) {
	t.Helper()
	if r.status >= 500 {
		t.Fatalf("5xx from a healthy store: %d %s", r.status, r.body)
	}
}

// fuzzErrorCode returns the code of a response in the JSON error contract,
// failing t if it is not exactly that.
func fuzzErrorCode(t *testing.T, r *reply) string {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("error response with Content-Type %q: %d %q", ct, r.status, r.body)
	}
	var body map[string]string
	dec := json.NewDecoder(bytes.NewReader(r.body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&body); err != nil || len(body) != 3 || body["code"] == "" || body["request_id"] == "" {
		t.Fatalf("not the JSON error contract: %q (%v)", r.body, err)
	}
	if _, ok := body["message"]; !ok {
		t.Fatalf("no message: %q", r.body)
	}
	if r.header.Get("X-Request-Id") != body["request_id"] {
		t.Fatalf("request_id %q differs from X-Request-Id %q", body["request_id"], r.header.Get("X-Request-Id"))
	}
	return body["code"]
}
