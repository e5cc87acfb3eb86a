// Package idemgin puts idemhttp's Idempotency-Key middleware on gin routes,
// safely.
//
//	mw, err := idemgin.New(store, &idemhttp.Config{Tenant: tenantOf}) // store: *idem.Store[pgx.Tx]
//	orders := engine.Group("/v1", mw.Handler())
//	orders.POST("/orders", func(c *gin.Context) {
//		tx, _ := mw.Tx(c) // pgx.Tx, the transaction the key is claimed in
//		// INSERT the order on tx, then c.JSON(201, order)
//	})
//
// The obvious adapter, an http.HandlerFunc calling c.Next() inside
// idemhttp's middleware, stores an empty 200 for a request whose handlers
// never ran: when the transaction is retried (a deadlock,
// idemhttp.RetryTransaction, a commit that conflicted), the closure runs
// again, c.Next() does nothing the second time, and the nothing it wrote
// used to be committed as the key's answer. gin cannot run a chain twice
// (its position in the chain is private), so this adapter runs the handlers
// after it at most once per request, and answers a transaction retry with
// 503 idempotency_store_unavailable and Retry-After instead, after the
// attempt was rolled back: nothing of the request is stored, and the
// client's retry with the same key runs the handlers once, in a new
// transaction. (idemhttp itself also refuses to store the answer of an
// attempt whose handler wrote nothing.)
//
// Everything else is idemhttp's: the configuration, the answers (bad keys,
// oversized bodies, mismatches, in progress, outages are answered before any
// handler after this one runs, and stop the chain), the leased mode, and
// the accessors (idemhttp.Key, idemhttp.MarkFinal and the others read
// c.Request.Context()). By default the operation is the method and gin's
// route pattern, c.FullPath(), or the request path for a catch-all route
// (see idemhttp.RouteOperation); Config.Operation replaces it, and
// [GinContext] gives the hooks the gin.Context.
//
// While the protected handlers run, c.Writer buffers the response until the
// transaction commits, as idemhttp's ResponseWriter does: it neither
// flushes nor hijacks.
package idemgin

import (
	"bufio"
	"context"
	"errors"
	"net"
	"net/http"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
)

// Middleware is idemhttp's middleware for gin, for a store whose
// transactions are TTx, made by [New].
type Middleware[TTx any] struct {
	mw         *idemhttp.Middleware[TTx]
	retryAfter time.Duration
}

// New returns the gin middleware over store, configured as
// [idemhttp.New] is; cfg.Operation defaults to the method and the route's
// c.FullPath(). It returns idemhttp.New's error for a bad configuration.
func New[TTx any](store *idem.Store[TTx], cfg *idemhttp.Config) (*Middleware[TTx], error) {
	var c idemhttp.Config
	if cfg != nil {
		c = *cfg
	}
	if c.Operation == nil {
		c.Operation = operation
	}
	mw, err := idemhttp.New(store, &c)
	if err != nil {
		return nil, err
	}
	retryAfter := c.UnavailableRetryAfter
	if retryAfter == 0 {
		retryAfter = 2 * time.Second // idemhttp's default
	}
	return &Middleware[TTx]{mw: mw, retryAfter: retryAfter}, nil
}

// Tx returns the business transaction of the request c serves, typed as the
// store's transaction; see [idemhttp.Middleware.Tx]. ok is false outside
// the handlers the middleware runs.
func (m *Middleware[TTx]) Tx(c *gin.Context) (tx TTx, ok bool) {
	return m.mw.Tx(c.Request.Context())
}

// Lease returns the lease of the request c serves, in the leased mode; see
// [idemhttp.Middleware.Lease].
func (m *Middleware[TTx]) Lease(c *gin.Context) (lease *idem.Lease[TTx], ok bool) {
	return m.mw.Lease(c.Request.Context())
}

type ginKey struct{}

// GinContext returns the gin.Context of a request the middleware serves,
// for Config hooks (Tenant, Operation, RequestID, KeyOptional, Fingerprint)
// that need what earlier gin handlers set with c.Set.
func GinContext(r *http.Request) (*gin.Context, bool) {
	c, ok := r.Context().Value(ginKey{}).(*gin.Context)
	return c, ok
}

// operation is the default Config.Operation: the method and gin's route
// pattern.
func operation(r *http.Request) (string, error) {
	pattern := ""
	if c, ok := GinContext(r); ok {
		pattern = c.FullPath()
	}
	return idemhttp.RouteOperation(r, pattern), nil
}

// Handler returns the gin.HandlerFunc to put before the handlers it
// protects: engine.Use, a group's Use, or a route's handler list.
func (m *Middleware[TTx]) Handler() gin.HandlerFunc {
	return func(c *gin.Context) {
		orig, origReq := c.Writer, c.Request
		ran, runs := false, 0
		inner := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs++
			if runs > 1 {
				// A transaction retry: the chain already ran once and
				// gin cannot run it again. Refuse, with an answer that
				// is not stored (the attempt rolls back).
				m.refuseRetry(w, r)
				return
			}
			ran = true
			c.Request = r
			if w == http.ResponseWriter(orig) {
				// Passed through unprotected (another method, or no key
				// where Config.KeyOptional allows it): gin's own writer.
				c.Next()
				return
			}
			bw := &writer{w: w, status: http.StatusOK, size: -1}
			c.Writer = bw
			defer func() { c.Writer = orig }()
			c.Next()
			bw.WriteHeaderNow() // as gin does once the handlers returned
		})
		r := origReq.WithContext(context.WithValue(origReq.Context(), ginKey{}, c))
		m.mw.Wrap(inner).ServeHTTP(orig, r)
		c.Writer, c.Request = orig, origReq
		if !ran {
			// idemhttp answered by itself (a replay, a bad key, a
			// conflict, an outage): no handler after this one may run.
			c.Abort()
		}
	}
}

func (m *Middleware[TTx]) refuseRetry(w http.ResponseWriter, r *http.Request) {
	idemhttp.WriteError(w, &idemhttp.Error{
		Status: http.StatusServiceUnavailable, Code: idemhttp.CodeStoreUnavailable,
		Message:    "The request's transaction had to be retried, which gin's handler chain cannot do; nothing was done. Retry later with the same key.",
		RequestID:  idemhttp.RequestID(r.Context()),
		RetryAfter: m.retryAfter,
	})
}

// writer is the gin.ResponseWriter the protected handlers write to: gin's
// semantics (a status recorded until the first write or the end of the
// chain, then sent) over idemhttp's buffering ResponseWriter.
type writer struct {
	w      http.ResponseWriter
	status int
	size   int // -1 until the header is written
}

var _ gin.ResponseWriter = (*writer)(nil)

func (b *writer) Header() http.Header { return b.w.Header() }

func (b *writer) WriteHeader(code int) {
	if code > 0 && !b.Written() {
		b.status = code
	}
}

func (b *writer) WriteHeaderNow() {
	if !b.Written() {
		b.size = 0
		b.w.WriteHeader(b.status)
	}
}

func (b *writer) Write(p []byte) (int, error) {
	b.WriteHeaderNow()
	n, err := b.w.Write(p)
	b.size += n
	return n, err
}

func (b *writer) WriteString(s string) (int, error) { return b.Write([]byte(s)) }

func (b *writer) Status() int { return b.status }

func (b *writer) Size() int { return b.size }

func (b *writer) Written() bool { return b.size != -1 }

// Flush does nothing: nothing reaches the client before the commit.
func (b *writer) Flush() {}

// errHijack is Hijack's error: the response is buffered until the commit.
var errHijack = errors.New("idemgin: a protected request's connection cannot be hijacked")

func (b *writer) Hijack() (net.Conn, *bufio.ReadWriter, error) { return nil, nil, errHijack }

// CloseNotify returns a channel that never fires: once the key is claimed
// the request's work does not depend on the client.
func (b *writer) CloseNotify() <-chan bool { return make(chan bool) }

func (b *writer) Pusher() http.Pusher { return nil }
