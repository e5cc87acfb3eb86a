package idemhttp

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/digest"
)

const (
	requestIDHeader = "X-Request-Id"
	replayedHeader  = "Idempotency-Replayed"
)

// New returns a middleware that makes the requests it protects (POST and
// PATCH by default) safe to retry with an Idempotency-Key, using store.
//
// For each protected request it parses the key, derives the scope (tenant
// and operation) and the fingerprint (method, route, target, tenant,
// canonical body), then, in one transaction begun by [idem.Store.Do]: claims
// the key, runs the handler with the transaction in its context ([Tx]),
// stores the handler's response and commits, and only then sends the
// response. A retry gets the stored response again, replayed; see the
// package documentation for every outcome.
//
// With Config.Mode set to [Leased], it instead commits the claim with a
// lease before the handler runs, renews the lease while the handler works,
// and completes it in the business transaction the handler takes through
// [Tx] (the package documentation's "Leased mode").
//
// Apply it to the handlers of the routes it protects, as in
// mux.Handle("POST /orders", mw(createOrder)), so that r.Pattern names the
// operation; applied around a whole mux it sees no pattern and uses the
// request path instead.
//
// New panics if store is nil or cfg is invalid (a negative limit, a
// MismatchStatus that is not 4xx, an unknown Mode): a programming error
// found at start-up. The middleware is safe for concurrent use and keeps no
// state between requests.
func New[TTx any](store *idem.Store[TTx], cfg *Config) func(http.Handler) http.Handler {
	if store == nil {
		panic("idemhttp: New needs a store")
	}
	s, err := cfg.settings()
	if err != nil {
		panic("idemhttp: invalid config: " + err.Error())
	}
	return func(next http.Handler) http.Handler {
		return &middleware[TTx]{store: store, cfg: s, next: next}
	}
}

type middleware[TTx any] struct {
	store *idem.Store[TTx]
	cfg   *settings
	next  http.Handler
}

// request is the middleware's state for one request; it lives on the
// request's goroutine and nowhere else.
type request struct {
	r         *http.Request
	start     time.Time
	requestID string
	key       string
	scope     string
	fp        idem.Fingerprint
	hasFP     bool
	body      *requestBody
	// attempt is the lease's holder number, in the leased mode.
	attempt int
}

func (m *middleware[TTx]) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !m.cfg.methods[r.Method] {
		if m.cfg.methods[strings.ToUpper(r.Method)] {
			rq := &request{r: r, start: time.Now(), requestID: requestID(r)}
			m.fail(w, rq, "method_invalid", &Error{Status: http.StatusBadRequest, Code: CodeMethodInvalid,
				Message: "Request methods are case-sensitive; send this one in upper case."})
			return
		}
		m.next.ServeHTTP(w, r)
		return
	}
	rq := &request{r: r, start: time.Now(), requestID: requestID(r)}

	key, code := parseKey(r.Header.Values(m.cfg.Header), m.cfg.KeyFormat)
	switch {
	case code == CodeKeyMissing && m.cfg.KeyOptional != nil && m.cfg.KeyOptional(r):
		m.log(rq, "unprotected", 0)
		m.next.ServeHTTP(w, r)
		return
	case code == CodeKeyMissing:
		m.fail(w, rq, "key_missing", &Error{Status: http.StatusBadRequest, Code: code,
			Message: "This request needs an " + m.cfg.Header + " header."})
		return
	case code != "":
		m.fail(w, rq, "key_invalid", &Error{Status: http.StatusBadRequest, Code: code,
			Message: "The " + m.cfg.Header + " header is not a valid key."})
		return
	}
	rq.key = key

	var tenant string
	if m.cfg.Tenant != nil {
		t, err := m.cfg.Tenant(r)
		if err != nil {
			m.fail(w, rq, "tenant_invalid", asError(err, CodeTenantInvalid, "The request's tenant could not be determined."))
			return
		}
		tenant = t
	}
	route := routeOf(r)
	rq.scope = scopeOf(tenant, r.Method, route)

	body, e := readBody(w, r, m.cfg.MaxBodyBytes, m.cfg.MaxJSONDepth)
	if e != nil {
		m.fail(w, rq, "body_rejected", e)
		return
	}
	rq.body = body
	hashed := body.canonical
	if m.cfg.Fingerprint != nil {
		h, err := m.cfg.Fingerprint(r, body.canonical)
		if err != nil {
			m.fail(w, rq, "fingerprint_failed", asError(err, CodeFingerprintFailed, "The request could not be fingerprinted."))
			return
		}
		hashed = h
	}
	rq.fp, rq.hasFP = fingerprint(r.Method, route, tenant, r.URL, body.mediaType, hashed), true

	if m.cfg.Mode == Leased {
		m.serveLeased(w, rq) //nolint:contextcheck // derives its ctx from rq.r.Context() via context.WithoutCancel on purpose: a client that goes away must not cancel a claimed key's work
		return
	}
	m.serveTransactional(w, rq) //nolint:contextcheck // derives its ctx from rq.r.Context() via context.WithoutCancel on purpose: a client that goes away must not cancel a claimed key's work
}

// errPassThrough makes idem.Store.Do roll back a 4xx or 5xx response that
// is not final; the captured response is then sent as it is.
var errPassThrough = errors.New("idemhttp: failure response, rolled back")

// errTooLargeToStore makes idem.Store.Do roll back a response that is too
// large to store.
var errTooLargeToStore = errors.New("idemhttp: response too large to store, rolled back")

// errRetryRequested makes idem.Store.Do run the transaction again after the
// handler called RetryTransaction.
var errRetryRequested = fmt.Errorf("idemhttp: the handler asked for a new transaction: %w", idem.ErrRetryable)

// serveTransactional claims the key inside the business transaction, runs
// the handler in it, and answers once the transaction has ended.
func (m *middleware[TTx]) serveTransactional(w http.ResponseWriter, rq *request) {
	r := rq.r
	// A client that goes away must not cancel the transaction once the key
	// is claimed: it runs to completion, bounded by Timeout, and commits,
	// so that the client's retry finds the stored response.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), m.cfg.Timeout)
	defer cancel()

	// A panic in the handler propagates (after idem.Store.Do rolled the
	// transaction back, and with nothing sent to the client); it is only
	// logged here, without recovering, so the panic keeps its stack.
	answered := false
	defer func() {
		if !answered {
			m.log(rq, "panic", 0)
		}
	}()

	var last *capture // the last attempt's response
	res, err := m.store.Do(ctx, rq.scope, rq.key, rq.fp, func(ctx context.Context, tx TTx) (*idem.Response, error) {
		a := &attempt{tx: tx, key: rq.key, scope: rq.scope, requestID: rq.requestID}
		cw := m.newCapture(w, rq, a)
		last = cw
		m.runHandler(cw, rq, context.WithValue(ctx, attemptKey{}, a), a)
		switch {
		case a.retry.Load():
			return nil, errRetryRequested
		case cw.status >= 400 && !a.final.Load():
			return nil, errPassThrough
		case cw.tooLarge():
			return nil, errTooLargeToStore
		}
		resp := &idem.Response{StatusCode: cw.status, Header: m.replayable(cw.sent), Body: cw.body.Bytes()}
		if cw.status >= 400 {
			return nil, idem.FinalFailure(resp)
		}
		return resp, nil
	})
	answered = true

	switch {
	case last != nil && last.streamed:
		// A failure too large to buffer is already on its way to the
		// client; it was never going to be stored, and Do rolled back.
		m.log(rq, "rolled_back", last.status)
	case err == nil && res.Replayed:
		m.replay(w, rq, res.Response)
	case err == nil:
		m.send(w, rq, last)
		outcome := "completed"
		if res.Status == idem.StatusFailed {
			outcome = "completed_final_failure"
		}
		m.log(rq, outcome, last.status)
	case errors.Is(err, errPassThrough):
		m.send(w, rq, last)
		m.log(rq, "rolled_back", last.status)
	case errors.Is(err, errTooLargeToStore):
		m.failTooLarge(w, rq)
	default:
		// The store is unreachable or failing, the commit failed, the
		// transaction kept conflicting, or Timeout ran out: whatever the
		// handler did was rolled back (a commit that failed on a lost
		// connection may have committed; the retry then replays it).
		m.failClaim(w, rq, err)
	}
}

// failClaim answers a claim that did not acquire the key, or a request that
// failed in the store: the key reused, in progress, or the store failing.
func (m *middleware[TTx]) failClaim(w http.ResponseWriter, rq *request, err error) {
	var inProgress *idem.InProgressError
	switch {
	case errors.Is(err, idem.ErrFingerprint):
		m.fail(w, rq, "key_reused", &Error{Status: m.cfg.MismatchStatus, Code: CodeKeyReused,
			Message: "This " + m.cfg.Header + " was used with a different request. Use a new key for a new request."})
	case errors.As(err, &inProgress):
		m.fail(w, rq, "in_progress", &Error{Status: http.StatusConflict, Code: CodeInProgress,
			Message:    "A request with this " + m.cfg.Header + " is being processed. Retry later with the same key.",
			RetryAfter: max(min(inProgress.RetryAfter, m.cfg.InProgressRetryAfter), time.Second)}) // capped; the protocol promises >= 1
	case errors.Is(err, idem.ErrCorruptRecord):
		m.failRecordInvalid(w, rq)
	case errors.Is(err, idem.ErrInvalidResponse):
		m.failResponseInvalid(w, rq, err)
	case errors.Is(err, idem.ErrInvalidKey):
		m.fail(w, rq, "key_invalid", &Error{Status: http.StatusBadRequest, Code: CodeKeyInvalid,
			Message: "The " + m.cfg.Header + " header is not a valid key."})
	default:
		m.failUnavailable(w, rq)
	}
}

// failUnavailable answers 503 with CodeStoreUnavailable.
func (m *middleware[TTx]) failUnavailable(w http.ResponseWriter, rq *request) {
	m.fail(w, rq, "store_unavailable", &Error{Status: http.StatusServiceUnavailable, Code: CodeStoreUnavailable,
		Message:    "The request could not be processed safely right now. Retry later with the same key.",
		RetryAfter: m.cfg.UnavailableRetryAfter})
}

// failTooLarge answers 500 with CodeResponseTooLarge.
func (m *middleware[TTx]) failTooLarge(w http.ResponseWriter, rq *request) {
	m.fail(w, rq, "response_too_large", &Error{Status: http.StatusInternalServerError, Code: CodeResponseTooLarge,
		Message: "The response is too large to be stored for retries; nothing was done."})
}

// failRecordInvalid answers 500 with CodeRecordInvalid.
func (m *middleware[TTx]) failRecordInvalid(w http.ResponseWriter, rq *request) {
	m.fail(w, rq, "record_invalid", &Error{Status: http.StatusInternalServerError, Code: CodeRecordInvalid,
		Message: "The stored response for this " + m.cfg.Header + " cannot be replayed; nothing was done. Report it."})
}

// failResponseInvalid answers a response the store refused: 500 with
// CodeResponseTooLarge when its body is over the store's own limit, else
// with CodeResponseInvalid.
func (m *middleware[TTx]) failResponseInvalid(w http.ResponseWriter, rq *request, err error) {
	if invalid, ok := errors.AsType[*idem.InvalidResponseError](err); ok && invalid.Field == "Body" {
		m.failTooLarge(w, rq)
		return
	}
	m.fail(w, rq, "response_invalid", &Error{Status: http.StatusInternalServerError, Code: CodeResponseInvalid,
		Message: "The response could not be stored for retries."})
}

// runHandler calls the handler on a fresh copy of the request, with ctx and
// a fresh body, and marks the attempt ended when it returns (or panics).
func (m *middleware[TTx]) runHandler(cw *capture, rq *request, ctx context.Context, a *attempt) {
	defer a.ended.Store(true)
	r := rq.r.Clone(ctx)
	data := rq.body.data
	r.Body = io.NopCloser(bytes.NewReader(data))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }
	r.ContentLength = int64(len(data))
	if rq.body.decoded {
		// The handler gets the decoded body, described as such.
		r.Header.Del("Content-Encoding")
		r.Header.Del("Content-Length")
	}
	m.next.ServeHTTP(cw, r)
	cw.finish()
}

// replayable returns the headers of h that are stored for replays.
func (m *middleware[TTx]) replayable(h http.Header) http.Header {
	out := http.Header{}
	for k, v := range h {
		if m.cfg.replay[k] {
			out[k] = v
		}
	}
	return out
}

// newCapture returns the ResponseWriter for one run of the handler, which
// streams a failure response to w once it outgrows Config.MaxResponseBytes
// (see capture.Write), unless a has marked it final or asked for a retry.
func (m *middleware[TTx]) newCapture(w http.ResponseWriter, rq *request, a *attempt) *capture {
	cw := newCapture(m.cfg.MaxResponseBytes)
	cw.spill = func(c *capture) bool {
		if !a.stream() {
			return false
		}
		c.out = w
		c.sniff()
		m.writeHead(w, rq, c)
		return true
	}
	return cw
}

// send writes the handler's own response, with every header it set, unless
// it was streamed already.
func (m *middleware[TTx]) send(w http.ResponseWriter, rq *request, c *capture) {
	if c.streamed {
		return
	}
	m.writeHead(w, rq, c)
	_, _ = w.Write(c.body.Bytes())
}

// writeHead writes the status and headers of the handler's own response.
func (m *middleware[TTx]) writeHead(w http.ResponseWriter, rq *request, c *capture) {
	h := w.Header()
	for k, v := range c.sent {
		h[k] = v
	}
	h.Set(requestIDHeader, rq.requestID)
	w.WriteHeader(c.status)
}

// replay writes a stored response, with the allowlisted headers only, and
// logs it. The store checks every record it reads; this check is the last
// line before WriteHeader, which panics on a status outside 100–999.
func (m *middleware[TTx]) replay(w http.ResponseWriter, rq *request, resp *idem.Response) {
	if err := resp.Validate(); err != nil {
		m.failRecordInvalid(w, rq)
		return
	}
	defer m.log(rq, "replayed", resp.StatusCode)
	h := w.Header()
	for k, v := range m.replayable(resp.Header) {
		h[k] = v
	}
	h.Set(replayedHeader, "true")
	h.Set(requestIDHeader, rq.requestID)
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(resp.Body)
}

// fail answers with an error of the middleware.
func (m *middleware[TTx]) fail(w http.ResponseWriter, rq *request, outcome string, e *Error) {
	e.RequestID = rq.requestID
	h := w.Header()
	h.Set(requestIDHeader, rq.requestID)
	if e.RetryAfter > 0 {
		h.Set("Retry-After", retryAfterSeconds(e.RetryAfter))
	}
	m.cfg.RenderError(w, rq.r, e)
	m.log(rq, outcome, e.Status)
}

// asError turns an error of a hook into the error to answer: an *Error as it
// is (a copy, with 400 if its status is not a 4xx or 5xx), anything else as
// 400 with code.
func asError(err error, code, message string) *Error {
	if e, ok := errors.AsType[*Error](err); ok {
		c := *e
		if c.Status < 400 || c.Status > 599 {
			c.Status = http.StatusBadRequest
		}
		return &c
	}
	return &Error{Status: http.StatusBadRequest, Code: code, Message: message}
}

// log writes the one record of a protected request. It carries digests,
// never the raw key, tenant or body.
func (m *middleware[TTx]) log(rq *request, outcome string, status int) {
	level := slog.LevelInfo
	switch outcome {
	case "store_unavailable", "response_too_large", "response_invalid", "record_invalid", "panic", "lease_lost":
		level = slog.LevelError
	case "rolled_back_not_released":
		level = slog.LevelWarn
	}
	attrs := make([]slog.Attr, 0, 9)
	attrs = append(attrs,
		slog.String("outcome", outcome),
		slog.String("method", rq.r.Method),
		slog.String("request_id", rq.requestID),
	)
	if status != 0 {
		attrs = append(attrs, slog.Int("status", status))
	}
	if rq.key != "" && rq.scope != "" {
		attrs = append(attrs, slog.String("key", digest.Key(rq.scope, rq.key)))
	}
	if rq.scope != "" {
		attrs = append(attrs, slog.String("scope", scopeDigest(rq.scope)))
	}
	if rq.hasFP {
		attrs = append(attrs, slog.String("fingerprint", hex.EncodeToString(rq.fp[:6])))
	}
	if rq.attempt != 0 {
		attrs = append(attrs, slog.Int("attempt", rq.attempt))
	}
	latency := time.Since(rq.start)
	attrs = append(attrs, slog.Duration("latency", latency))
	m.cfg.Logger.LogAttrs(rq.r.Context(), level, "idemhttp: request", attrs...)
	if m.cfg.Observe != nil {
		m.observe(rq.r.Context(), rq, outcome, status, latency)
	}
}

// scopeDigest is a short, non-reversible label for a scope, which holds the
// tenant.
func scopeDigest(scope string) string {
	sum := sha256.Sum256([]byte(scope))
	return hex.EncodeToString(sum[:8])
}

// routeOf returns the operation's route: the ServeMux pattern that matched r
// without its method (the method is kept apart), or else r's escaped path.
func routeOf(r *http.Request) string {
	if p := r.Pattern; p != "" {
		if i := strings.IndexAny(p, " \t"); i >= 0 {
			p = strings.TrimLeft(p[i:], " \t")
		}
		return p
	}
	return r.URL.EscapedPath()
}

// ScopeFor returns the scope the middleware claims a request's key in: the
// tenant (Config.Tenant's answer, "" without one), the request's method and
// its route (the ServeMux pattern without its method, such as
// "/orders/{id}", or else the escaped path), as in "acme POST /orders".
// Operators and tests use it to find a request's record with
// idem.Store.Lookup (or `idem inspect --tenant --method --route --key`).
func ScopeFor(tenant, method, route string) string { return scopeOf(tenant, method, route) }

// scopeOf names the operation a key belongs to: the tenant (path-escaped,
// so it holds no space), the method and the route, as in
// "acme POST /orders". A scope that idem would refuse (longer than
// idem.MaxScopeLength, or with control characters from a route pattern) is
// replaced by "sha256:" and its hex digest, which still tells scopes apart.
func scopeOf(tenant, method, route string) string {
	s := url.PathEscape(tenant) + " " + method + " " + route
	if len(s) <= idem.MaxScopeLength && utf8.ValidString(s) && strings.IndexFunc(s, unicode.IsControl) < 0 {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// requestID returns the request's X-Request-Id when it is a reasonable ID
// (1 to 128 characters of letters, digits and ._:/+=-), else a new one, so
// that neither logs nor headers carry whatever a client sent.
func requestID(r *http.Request) string {
	if id := r.Header.Get(requestIDHeader); id != "" && len(id) <= 128 && strings.Trim(id, idChars) == "" {
		return id
	}
	return "req_" + strings.ToLower(rand.Text())
}

const idChars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/+=-"
