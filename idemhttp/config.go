package idemhttp

import (
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Config configures the middleware made by [New]. A nil *Config, and every
// zero field, means the default.
type Config struct {
	// Mode chooses how the handler's work is protected: [Transactional]
	// (the default), where the key is claimed inside the handler's business
	// transaction, or [Leased], for handlers with effects outside the
	// database, where the claim is committed with a lease before the handler
	// runs. One middleware has one mode; make one per mode and wrap each
	// route with the one it needs.
	Mode Mode

	// Methods are the request methods the middleware protects; requests
	// with other methods pass through untouched. Defaults to POST and PATCH.
	Methods []string

	// Header is the request header that carries the key. Defaults to
	// "Idempotency-Key".
	Header string

	// ReplayedHeader is the response header, set to "true", that marks a
	// replayed answer. Defaults to "Idempotency-Replayed"; Stripe's clients
	// read "Idempotent-Replayed". It is never stored with a response.
	ReplayedHeader string

	// KeyFormat is what a key must match, after the structured-field
	// quotes are removed ("abc" and abc are the same key). Anchor it. Keys
	// are also refused when longer than idem.MaxKeyLength, with control
	// characters, or sent on more than one header line. Defaults to
	// ^[A-Za-z0-9_-]{12,64}$.
	KeyFormat *regexp.Regexp

	// KeyOptional, if set, reports whether a request without a key may pass
	// through to the handler unprotected (no claim, no transaction, no
	// replay). Defaults to nil: a request without a key gets 400 with
	// CodeKeyMissing.
	KeyOptional func(r *http.Request) bool

	// Tenant returns the tenant a request acts for: the authenticated
	// principal's (a value an authentication middleware put in the
	// request's context), never a header or parameter the client chooses,
	// since whoever presents a tenant and a key gets its stored response
	// (docs/security.md). The same key in
	// two tenants names two records, and the tenant is part of the
	// fingerprint. An error refuses the request: an *Error is answered as
	// it is, any other error with 400 and CodeTenantInvalid. Defaults to
	// nil: one tenant, "".
	Tenant func(r *http.Request) (string, error)

	// Operation, if set, names the operation a request belongs to: with
	// the tenant it forms the scope the key is claimed in (the same key on
	// two operations names two records), and it replaces the method and
	// route in the fingerprint. An error refuses the request without
	// running the handler: an *Error is answered as it is, any other error,
	// and an empty name, with 500 and CodeOperationFailed (a server bug,
	// not the client's). Defaults to nil: the method and the route, see
	// [RouteOperation], which adapters for routers that keep their route
	// pattern elsewhere (chi's RouteContext, gin's FullPath) call
	// themselves.
	Operation func(r *http.Request) (string, error)

	// Fingerprint, if set, chooses what of the request the fingerprint
	// covers besides the method, the route, the request target and the
	// tenant, which it always covers. It gets the body in canonical form
	// (see the package documentation) and returns the bytes to hash in its
	// place: some of the JSON fields, or the body followed by header values
	// that matter. r's body has been read already; use body. An *Error
	// refuses the request as it is, any other error with 400 and
	// CodeFingerprintFailed. Defaults to nil: the whole canonical body.
	Fingerprint func(r *http.Request, body []byte) ([]byte, error)

	// MaxBodyBytes bounds the request body, both as sent and after gzip
	// decoding; a larger one gets 413 with CodeBodyTooLarge. The body is
	// read whole, before the handler runs, to fingerprint it. Defaults to
	// 1 MiB.
	MaxBodyBytes int64

	// MaxJSONDepth bounds how deeply a JSON body's arrays and objects may
	// nest; a deeper one gets 400 with CodeBodyInvalid. Defaults to 64.
	MaxJSONDepth int

	// MaxResponseBytes bounds the body of a response that is stored (keep
	// it at most the store's idem.Config.MaxResponseBytes, 8 MiB by
	// default, which refuses larger bodies itself): a 2xx
	// or 3xx, or a failure marked final. A larger one cannot be stored, so
	// its transaction is rolled back (nothing happened) and the client gets
	// 500 with CodeResponseTooLarge; the key stays free (in the leased mode
	// the lease is released). It also bounds the memory a failure response
	// that is not stored takes: such a response is buffered up to this size
	// and, past it, streamed to the client while the handler writes it, its
	// transaction rolled back (or its lease released) when the handler
	// returns; MarkFinal and RetryTransaction then report false. Defaults
	// to 1 MiB.
	MaxResponseBytes int

	// ReplayHeaders are response headers stored and replayed besides
	// Content-Type, Content-Encoding, Location, ETag and Cache-Control.
	// Set-Cookie, Authorization, Proxy-Authenticate, Proxy-Authorization,
	// hop-by-hop headers and the headers the middleware sets itself are
	// never stored, even if listed. Defaults to none.
	ReplayHeaders []string

	// MismatchStatus is the status of a key reused with a different
	// request (CodeKeyReused). Defaults to 409 Conflict;
	// [MismatchStatusIETF] (422) follows the IETF draft.
	MismatchStatus int

	// Timeout bounds the transaction of a request, from the claim to the
	// commit, handler included. The transaction does not end when the
	// client goes away or times out: it runs to completion within Timeout
	// and commits, so that the client's retry is answered with the stored
	// response. In the leased mode it bounds the same span: the claim, the
	// handler's work outside and inside its transaction, and the commit.
	// Defaults to 30s.
	Timeout time.Duration

	// UnavailableRetryAfter is the Retry-After of a 503 with
	// CodeStoreUnavailable. Defaults to 2s.
	UnavailableRetryAfter time.Duration

	// InProgressRetryAfter caps the Retry-After of a 409 with
	// CodeInProgress. The header is the holder's time left (its lease, or
	// the store's WaitTimeout for an uncommitted claim) when that is
	// shorter, and never under 1s. Without the cap a leased holder's
	// duplicates would be told to wait the whole lease (30s by default,
	// renewed while the handler runs) even when the original finishes in
	// a second; a retry of a request still in progress costs one claim
	// attempt, which answers at once. Defaults to 1s.
	InProgressRetryAfter time.Duration

	// RequestID returns the request's ID, sent back in the X-Request-Id
	// response header, in error bodies and in the log record, and given to
	// the handler through [RequestID]; for example the ID a request-ID
	// middleware put in the context. An empty result, or one that is not 1
	// to 128 characters of letters, digits and ._:/+=-, is replaced by a
	// generated ID ("req_" and 26 random characters), so that neither logs
	// nor headers carry whatever a client sent. Defaults to the
	// X-Request-Id request header.
	RequestID func(r *http.Request) string

	// Logger receives one record per protected request: its outcome, the
	// status, the request ID, short digests of the key and the scope, a
	// fingerprint prefix and the latency. It never receives a raw key,
	// tenant or body. Defaults to discarding everything.
	Logger *slog.Logger

	// RenderError writes the middleware's error responses. The X-Request-Id
	// header, and Retry-After where it applies, are set before it is
	// called. Defaults to [WriteError], the JSON error contract; replace it
	// to answer with RFC 9457 problem details, for example.
	RenderError func(w http.ResponseWriter, r *http.Request, e *Error)
}

// Mode is how the middleware protects a handler; see Config.Mode.
type Mode int

const (
	// Transactional claims the key inside the business transaction, which
	// the handler gets through [Tx]: the handler's writes, the claim and
	// the stored response commit together or not at all. For handlers
	// whose whole effect lives in the store's database.
	Transactional Mode = iota
	// Leased commits the claim, with a lease, before the handler runs
	// ([idem.Store.Acquire]), so that duplicates see it at once and get
	// 409 while the handler works; keeps the lease alive while the handler
	// runs; and completes it, fenced by the lease's token, in the business
	// transaction the handler gets through [Tx]. For handlers with effects
	// outside the database (a payment provider). The handler reaches the
	// lease through [Lease]. See the package documentation.
	Leased
)

// String returns "transactional" or "leased".
func (m Mode) String() string {
	switch m {
	case Transactional:
		return "transactional"
	case Leased:
		return "leased"
	default:
		return "Mode(" + strconv.Itoa(int(m)) + ")"
	}
}

const (
	defaultHeader                = "Idempotency-Key"
	defaultReplayedHeader        = "Idempotency-Replayed"
	defaultMaxBodyBytes          = 1 << 20
	defaultMaxJSONDepth          = 64
	defaultMaxResponseBytes      = 1 << 20
	defaultTimeout               = 30 * time.Second
	defaultUnavailableRetryAfter = 2 * time.Second
	defaultInProgressRetryAfter  = time.Second
)

// defaultReplayHeaders are always stored and replayed when the handler sets
// them. Content-Encoding is among them because the body is stored as sent:
// replayed without it, an encoded body would be unreadable.
var defaultReplayHeaders = []string{"Content-Type", "Content-Encoding", "Location", "Etag", "Cache-Control"}

// neverReplayed are response headers that are never stored: credentials,
// hop-by-hop headers (RFC 9110 section 7.6.1), and the headers the
// middleware or the server set per response.
var neverReplayed = map[string]bool{
	"Set-Cookie":          true,
	"Authorization":       true,
	"Proxy-Authenticate":  true,
	"Proxy-Authorization": true,
	"Connection":          true,
	"Keep-Alive":          true,
	"Proxy-Connection":    true,
	"Te":                  true,
	"Trailer":             true,
	"Transfer-Encoding":   true,
	"Upgrade":             true,
	"Content-Length":      true,
	"Date":                true,
	requestIDHeader:       true,
	defaultReplayedHeader: true,
}

// settings is a Config with the defaults applied, plus lookup tables.
type settings struct {
	Config
	methods map[string]bool
	replay  map[string]bool
}

func (c *Config) settings() (*settings, error) {
	var s settings
	if c != nil {
		s.Config = *c
	}
	if s.Methods == nil {
		s.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	if s.Header == "" {
		s.Header = defaultHeader
	}
	if s.ReplayedHeader == "" {
		s.ReplayedHeader = defaultReplayedHeader
	}
	if s.KeyFormat == nil {
		s.KeyFormat = defaultKeyFormat
	}
	if s.MaxBodyBytes == 0 {
		s.MaxBodyBytes = defaultMaxBodyBytes
	}
	if s.MaxJSONDepth == 0 {
		s.MaxJSONDepth = defaultMaxJSONDepth
	}
	if s.MaxResponseBytes == 0 {
		s.MaxResponseBytes = defaultMaxResponseBytes
	}
	if s.MismatchStatus == 0 {
		s.MismatchStatus = http.StatusConflict
	}
	if s.Timeout == 0 {
		s.Timeout = defaultTimeout
	}
	if s.UnavailableRetryAfter == 0 {
		s.UnavailableRetryAfter = defaultUnavailableRetryAfter
	}
	if s.InProgressRetryAfter == 0 {
		s.InProgressRetryAfter = defaultInProgressRetryAfter
	}
	if s.Logger == nil {
		s.Logger = slog.New(slog.DiscardHandler)
	}
	if s.RenderError == nil {
		s.RenderError = func(w http.ResponseWriter, _ *http.Request, e *Error) { WriteError(w, e) }
	}
	switch {
	case !isToken(s.Header):
		return nil, fmt.Errorf("Header %q is not a valid header name", s.Header)
	case !isToken(s.ReplayedHeader):
		return nil, fmt.Errorf("ReplayedHeader %q is not a valid header name", s.ReplayedHeader)
	case s.Mode != Transactional && s.Mode != Leased:
		return nil, fmt.Errorf("Mode %d is unknown", s.Mode)
	case s.MaxBodyBytes < 0:
		return nil, fmt.Errorf("MaxBodyBytes %d is negative", s.MaxBodyBytes)
	case s.MaxJSONDepth < 0:
		return nil, fmt.Errorf("MaxJSONDepth %d is negative", s.MaxJSONDepth)
	case s.MaxResponseBytes < 0:
		return nil, fmt.Errorf("MaxResponseBytes %d is negative", s.MaxResponseBytes)
	case s.MismatchStatus < 400 || s.MismatchStatus > 499:
		return nil, fmt.Errorf("MismatchStatus %d is not a 4xx status", s.MismatchStatus)
	case s.Timeout < 0:
		return nil, fmt.Errorf("Timeout %s is negative", s.Timeout) //nolint:staticcheck // ST1005: starts with the field name Timeout, like the messages around it
	case s.UnavailableRetryAfter < 0:
		return nil, fmt.Errorf("UnavailableRetryAfter %s is negative", s.UnavailableRetryAfter)
	case s.InProgressRetryAfter < 0:
		return nil, fmt.Errorf("InProgressRetryAfter %s is negative", s.InProgressRetryAfter)
	}
	s.methods = map[string]bool{}
	for _, m := range s.Methods {
		s.methods[strings.ToUpper(m)] = true
	}
	s.replay = map[string]bool{}
	for _, h := range append(append([]string(nil), defaultReplayHeaders...), s.ReplayHeaders...) {
		if h = http.CanonicalHeaderKey(h); !neverReplayed[h] && h != http.CanonicalHeaderKey(s.ReplayedHeader) {
			s.replay[h] = true
		}
	}
	return &s, nil
}

// isToken reports whether s is a valid header name (an RFC 9110 token).
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0 {
			continue
		}
		return false
	}
	return true
}
