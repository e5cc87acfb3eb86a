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
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/digest"
)

const (
	requestIDHeader = "X-Request-Id"
)

// New returns the middleware that makes the requests it protects (POST and
// PATCH by default) safe to retry with an Idempotency-Key, using store; its
// [Middleware.Wrap] method wraps a handler.
//
// For each protected request it parses the key, derives the scope (tenant
// and operation) and the fingerprint (method, route, target, tenant,
// canonical body), then, in one transaction begun by [idem.Store.Do]: claims
// the key, runs the handler with the transaction in its context
// ([Middleware.Tx]), stores the handler's response and commits, and only
// then sends the response. A retry gets the stored response again,
// replayed; see the package documentation for every outcome.
//
// With Config.Mode set to [Leased], it instead commits the claim with a
// lease before the handler runs, renews the lease while the handler works,
// and completes it in the business transaction the handler takes through
// [Middleware.Tx] (the package documentation's "Leased mode").
//
// Wrap the handlers of the routes it protects, as in
// mux.Handle("POST /orders", mw.Wrap(h)), so that r.Pattern names
// the operation; wrapped around a whole mux it sees no pattern and uses the
// request path instead (see [RouteOperation] and Config.Operation).
//
// New returns an error if store is nil or cfg is invalid (a negative
// limit, a MismatchStatus that is not 4xx, an unknown Mode, a header name
// that is not a token). The middleware is safe for concurrent use and
// keeps no state between requests.
func New[TTx any](store *idem.Store[TTx], cfg *Config) (*Middleware[TTx], error) {
	if store == nil {
		return nil, errors.New("idemhttp: New needs a store")
	}
	s, err := cfg.settings()
	if err != nil {
		return nil, fmt.Errorf("idemhttp: invalid config: %w", err)
	}
	return &Middleware[TTx]{store: store, cfg: s}, nil
}

// Middleware is the idempotency middleware for a store whose transactions
// are TTx, made by [New]. Its Tx and Lease methods are typed by the store,
// so that a handler cannot ask for the wrong transaction type.
type Middleware[TTx any] struct {
	store *idem.Store[TTx]
	cfg   *settings
}

// Wrap returns next protected by the middleware. Its signature is the
// func(http.Handler) http.Handler of net/http middleware: pass mw.Wrap to
// chi's r.Use or r.With, to echo.WrapMiddleware, or to any middleware
// chain.
func (m *Middleware[TTx]) Wrap(next http.Handler) http.Handler {
	return &middleware[TTx]{store: m.store, cfg: m.cfg, next: next}
}

// Tx returns the business transaction of the request whose context is ctx,
// as [Tx] does, typed by the middleware's store: a handler that holds the
// middleware cannot ask for another type.
func (m *Middleware[TTx]) Tx(ctx context.Context) (tx TTx, ok bool) {
	return Tx[TTx](ctx)
}

// Lease returns the lease of the request whose context is ctx, in the
// leased mode, as [Lease] does, typed by the middleware's store.
func (m *Middleware[TTx]) Lease(ctx context.Context) (lease *idem.Lease[TTx], ok bool) {
	return Lease[TTx](ctx)
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
			rq := &request{r: r, start: time.Now(), requestID: m.requestID(r)}
			m.fail(w, rq, "method_invalid", &Error{Status: http.StatusBadRequest, Code: CodeMethodInvalid,
				Message: "Request methods are case-sensitive; send this one in upper case."})
			return
		}
		m.next.ServeHTTP(w, r)
		return
	}
	rq := &request{r: r, start: time.Now(), requestID: m.requestID(r)}

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
		m.fail(w, rq, "key_invalid", m.keyInvalid())
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
	op, route, e := m.operation(r)
	if e != nil {
		m.fail(w, rq, "operation_failed", e)
		return
	}
	rq.scope = scopeOf(tenant, op)

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

// errNoResponse makes idem.Store.Do roll back an attempt whose handler wrote
// nothing: nothing says it ran, so nothing may be stored for it.
var errNoResponse = errors.New("idemhttp: the handler wrote no response, rolled back")

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
		m.spillTo(cw, m.putFunc(ctx, idem.DoClaim(ctx), &tx))
		defer cw.abortSpill() // a panic of the handler
		last = cw
		m.runHandler(cw, rq, context.WithValue(ctx, attemptKey{}, a), a)
		keep := !a.retry.Load() && (cw.status < 400 || a.final.Load())
		if err := cw.endSpill(keep); err != nil {
			return nil, err
		}
		switch {
		case a.retry.Load():
			return nil, errRetryRequested
		case cw.unwritten:
			return nil, errNoResponse
		case cw.status >= 400 && !a.final.Load():
			return nil, errPassThrough
		case cw.tooLarge():
			return nil, errTooLargeToStore
		}
		resp := &idem.Response{StatusCode: cw.status, Header: m.replayable(cw.sent), Body: cw.body.Bytes(), BodyRef: cw.ref}
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
	case errors.Is(err, errNoResponse):
		m.failNoResponse(w, rq)
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
		m.fail(w, rq, "key_invalid", m.keyInvalid())
	case errors.Is(err, idem.ErrMisconfigured):
		m.failMisconfigured(w, rq, err)
	default:
		m.failUnavailable(w, rq)
	}
}

// failMisconfigured answers 500 with CodeStoreMisconfigured: retrying does
// not help until the configuration changes. The error's message is idem's
// own, names the fix and carries no key, tenant or body, so it is logged.
func (m *middleware[TTx]) failMisconfigured(w http.ResponseWriter, rq *request, err error) {
	m.fail(w, rq, "store_misconfigured", &Error{Status: http.StatusInternalServerError, Code: CodeStoreMisconfigured,
		Message: "The idempotency store is misconfigured; nothing was done. Report it."}, slog.String("error", err.Error()))
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

// failNoResponse answers 500 with CodeNoResponse.
func (m *middleware[TTx]) failNoResponse(w http.ResponseWriter, rq *request) {
	m.fail(w, rq, "no_response", &Error{Status: http.StatusInternalServerError, Code: CodeNoResponse,
		Message: "The handler wrote no response, so none was stored."})
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
	if c.ref != nil {
		m.sendBody(rq.r.Context(), w, rq, &idem.Response{StatusCode: c.status, BodyRef: c.ref}, func() { m.writeHead(w, rq, c) })
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
	head := func() {
		h := w.Header()
		// replayable's filter, without its map: a replay is meant to
		// cost what a plain read does.
		for k, v := range resp.Header {
			if m.cfg.replay[k] {
				h[k] = v
			}
		}
		h.Set(m.cfg.ReplayedHeader, "true")
		h.Set(requestIDHeader, rq.requestID)
		w.WriteHeader(resp.StatusCode)
	}
	if resp.BodyRef != nil {
		// Logged as replayed only once the object was found intact.
		m.sendBody(rq.r.Context(), w, rq, resp, func() { head(); m.log(rq, "replayed", resp.StatusCode) })
		return
	}
	defer m.log(rq, "replayed", resp.StatusCode)
	head()
	_, _ = w.Write(resp.Body)
}

// fail answers with an error of the middleware.
func (m *middleware[TTx]) fail(w http.ResponseWriter, rq *request, outcome string, e *Error, extra ...slog.Attr) {
	e.RequestID = rq.requestID
	h := w.Header()
	h.Set(requestIDHeader, rq.requestID)
	if e.RetryAfter > 0 {
		h.Set("Retry-After", retryAfterSeconds(e.RetryAfter))
	}
	m.cfg.RenderError(w, rq.r, e)
	m.log(rq, outcome, e.Status, extra...)
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
func (m *middleware[TTx]) log(rq *request, outcome string, status int, extra ...slog.Attr) {
	level := slog.LevelInfo
	switch outcome {
	case "store_unavailable", "store_misconfigured", "response_too_large", "response_invalid", "record_invalid", "panic", "lease_lost", "no_response", "operation_failed":
		level = slog.LevelError
	case "rolled_back_not_released":
		level = slog.LevelWarn
	}
	latency := time.Since(rq.start)
	if m.cfg.Logger.Enabled(rq.r.Context(), level) {
		// The digests cost a hash each: not built for a logger that drops them.
		m.cfg.Logger.LogAttrs(rq.r.Context(), level, "idemhttp: request", m.logAttrs(rq, outcome, status, latency, extra)...)
	}
	if m.cfg.Observe != nil {
		m.observe(rq.r.Context(), rq, outcome, status, latency)
	}
}

// logAttrs are the attributes of a request's record.
func (m *middleware[TTx]) logAttrs(rq *request, outcome string, status int, latency time.Duration, extra []slog.Attr) []slog.Attr {
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
	attrs = append(attrs, extra...)
	return append(attrs, slog.Duration("latency", latency))
}

// scopeDigest is a short, non-reversible label for a scope, which holds the
// tenant.
func scopeDigest(scope string) string {
	sum := sha256.Sum256([]byte(scope))
	return hex.EncodeToString(sum[:8])
}

// operation returns the request's operation name and the route the
// fingerprint covers: Config.Operation's name (which is also the route), or
// by default the method and route of [RouteOperation].
func (m *middleware[TTx]) operation(r *http.Request) (op, route string, e *Error) {
	if m.cfg.Operation == nil {
		route = routeOf(r, patternPath(r.Pattern))
		return r.Method + " " + route, route, nil
	}
	op, err := m.cfg.Operation(r)
	if err == nil && op == "" {
		err = errors.New("empty operation name")
	}
	if err != nil {
		e := asError(err, CodeOperationFailed, "The request's operation could not be determined.")
		if !errors.As(err, new(*Error)) {
			e.Status = http.StatusInternalServerError
		}
		return "", "", e
	}
	return op, op, nil
}

// RouteOperation returns the operation name the middleware gives r by
// default when pattern is the route pattern that matched it (without a
// method): the method and the pattern, as in "POST /orders/{id}/items".
//
// A pattern that matches more than one route is not an operation name, so
// it is replaced by r's escaped path, as is an empty one (no pattern is
// known, as for a middleware wrapped around a whole router): a pattern
// ending in "/" (a ServeMux subtree, or the root "/") or in a "{name...}"
// wildcard, or holding a "*" (chi's "/v1/*" seen by the middleware of a
// subrouter mounted there, gin's "/files/*path"). Two routes then never
// share a scope; the price is that the same key sent to /v1/orders/1 and
// /v1/orders/2 under such a pattern names two records instead of a
// mismatch, and the method and path are in the fingerprint either way.
//
// Use it in a Config.Operation for a router that keeps its pattern
// elsewhere than r.Pattern.
func RouteOperation(r *http.Request, pattern string) string {
	return r.Method + " " + routeOf(r, pattern)
}

// routeOf returns pattern, or r's escaped path when pattern is empty or
// matches more than one route.
func routeOf(r *http.Request, pattern string) string {
	if pattern == "" || strings.HasSuffix(pattern, "/") || strings.HasSuffix(pattern, "...}") || strings.Contains(pattern, "*") {
		return r.URL.EscapedPath()
	}
	return pattern
}

// patternPath returns a ServeMux pattern without its method.
func patternPath(p string) string {
	if i := strings.IndexAny(p, " \t"); i >= 0 {
		p = strings.TrimLeft(p[i:], " \t")
	}
	return p
}

// ScopeFor returns the scope the middleware claims a request's key in: the
// tenant (Config.Tenant's answer, "" without one), the request's method and
// its route (the pattern without its method, such as "/orders/{id}", or the
// escaped path where [RouteOperation] uses it: no pattern, or one that
// matches many routes), as in "acme POST /orders". With Config.Operation
// the scope is the tenant and the operation's name, which ScopeFor returns
// when method and route are the name's parts before and after its first
// space. Operators and tests use it to find a request's record with
// idem.Store.Lookup (or `idem inspect --tenant --method --route --key`).
func ScopeFor(tenant, method, route string) string { return scopeOf(tenant, method+" "+route) }

// scopeOf names the operation a key belongs to: the tenant (path-escaped,
// so it holds no space) and the operation name (by default the method and
// the route), as in "acme POST /orders". A scope that idem would refuse
// (longer than idem.MaxScopeLength, or with control characters from a
// route pattern) is replaced by "sha256:" and its hex digest, which still
// tells scopes apart.
func scopeOf(tenant, op string) string {
	s := url.PathEscape(tenant) + " " + op
	if len(s) <= idem.MaxScopeLength && utf8.ValidString(s) && strings.IndexFunc(s, unicode.IsControl) < 0 {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// requestID returns Config.RequestID's ID for r, or by default its
// X-Request-Id, when it is a reasonable ID (1 to 128 characters of letters,
// digits and ._:/+=-), else a new one, so that neither logs nor headers
// carry whatever a client sent.
func (m *middleware[TTx]) requestID(r *http.Request) string {
	var id string
	if m.cfg.RequestID != nil {
		id = m.cfg.RequestID(r)
	} else {
		id = r.Header.Get(requestIDHeader)
	}
	if id != "" && len(id) <= 128 && strings.Trim(id, idChars) == "" {
		return id
	}
	return "req_" + strings.ToLower(rand.Text())
}

// keyInvalid is the 400 of a key that cannot be used. It states the
// accepted format and never echoes the key.
func (m *middleware[TTx]) keyInvalid() *Error {
	format := "matching " + m.cfg.KeyFormat.String()
	if m.cfg.KeyFormat == defaultKeyFormat {
		format = "of 12 to 64 letters, digits, '-' or '_'"
	}
	return &Error{Status: http.StatusBadRequest, Code: CodeKeyInvalid,
		Message: "The " + m.cfg.Header + " header must be one header line holding one key " + format +
			" (raw or as a quoted string), at most " + strconv.Itoa(idem.MaxKeyLength) + " bytes, without control characters."}
}

const idChars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/+=-"
