package idemhttp

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/idemstore/idem"
)

// attemptKey is the context key of the *attempt a handler runs in.
type attemptKey struct{}

// attempt is what one run of the handler can see and tell through its
// request's context. Each run (the first, and each one after a retryable
// transaction failure) gets its own.
type attempt struct {
	tx any // the store's TTx, in the transactional mode
	// In the leased mode: lease is the *idem.Lease[TTx], and begin returns
	// the business transaction, beginning it on the first call.
	lease     any
	begin     func() (tx any, ok bool)
	key       string
	scope     string
	requestID string
	// final and retry are set by the handler, possibly from goroutines it
	// started; ended is set when the handler returned.
	final, retry, ended atomic.Bool
	// decide orders MarkFinal and RetryTransaction against streamed, which
	// is set once a failure response too large to buffer started reaching
	// the client: from then on it can be neither stored nor retried.
	decide   sync.Mutex
	streamed bool
}

// stream reports whether the attempt's failure response may be streamed,
// and if so makes MarkFinal and RetryTransaction refuse from now on.
func (a *attempt) stream() bool {
	a.decide.Lock()
	defer a.decide.Unlock()
	if a.final.Load() || a.retry.Load() {
		return false
	}
	a.streamed = true
	return true
}

func attemptFrom(ctx context.Context) *attempt {
	a, _ := ctx.Value(attemptKey{}).(*attempt)
	return a
}

// Tx returns the business transaction of the request whose context is ctx,
// typed as the store's transaction type (pgx.Tx for package postgres,
// *sql.Tx for packages mysql and sqlite). Run the handler's writes on it:
// they commit together with the stored response, or not at all. Never
// commit or roll it back.
//
// In the transactional mode the key is already claimed in it. In the
// leased mode the first call begins it (later calls return the same one),
// and the lease stops being renewed from then on: make the outside call
// first, then take the transaction for the writes that record its result,
// and keep that part short. A handler that never calls Tx has its response
// stored in a statement of its own.
//
// Prefer [Middleware.Tx], whose type comes from the store: a TTx here that
// is not the store's type compiles and reports false at run time.
//
// ok is false outside a handler called by the middleware, after the handler
// returned (the transaction is finished then), when TTx is not the store's
// transaction type, and, in the leased mode, when the transaction could not
// be begun or the lease was lost (answer with any 5xx then; the middleware
// replaces it with its own 503).
func Tx[TTx any](ctx context.Context) (tx TTx, ok bool) {
	a := attemptFrom(ctx)
	if a == nil || a.ended.Load() {
		return tx, false
	}
	if a.begin != nil {
		if _, typed := a.lease.(*idem.Lease[TTx]); !typed {
			return tx, false // check the type before beginning anything
		}
		v, began := a.begin()
		if !began {
			return tx, false
		}
		tx, ok = v.(TTx)
		return tx, ok
	}
	tx, ok = a.tx.(TTx)
	return tx, ok
}

// Lease returns the lease of the request whose context is ctx, in the
// leased mode: its fencing token ([idem.Lease.Token]) and attempt number
// ([idem.Lease.Attempt], 2 or more after a crashed holder's key was handed
// over), to pass on to the outside system, and [idem.Lease.Extend] to make
// room for a long transaction. The middleware renews it while the handler
// runs, and completes or releases it afterwards: never call its Complete,
// Fail or Release methods.
//
// ok is false outside a handler called by a leased middleware, after the
// handler returned, and when TTx is not the store's transaction type
// ([Middleware.Lease] cannot get that wrong).
func Lease[TTx any](ctx context.Context) (lease *idem.Lease[TTx], ok bool) {
	a := attemptFrom(ctx)
	if a == nil || a.ended.Load() {
		return nil, false
	}
	lease, ok = a.lease.(*idem.Lease[TTx])
	return lease, ok
}

// Key returns the idempotency key of the request whose context is ctx, as
// the middleware parsed it (unquoted), so the handler never re-parses the
// header. Use it for a business unique constraint, such as a unique
// (tenant, idempotency_key) on the orders table. ok is false outside the
// middleware.
func Key(ctx context.Context) (key string, ok bool) {
	if a := attemptFrom(ctx); a != nil {
		return a.key, true
	}
	return "", false
}

// Scope returns the scope the key is claimed in: the tenant and the
// operation (see Config.Tenant). ok is false outside the middleware.
func Scope(ctx context.Context) (scope string, ok bool) {
	if a := attemptFrom(ctx); a != nil {
		return a.scope, true
	}
	return "", false
}

// RequestID returns the request ID the middleware answers with (from the
// X-Request-Id request header, or generated), or "" outside the middleware.
func RequestID(ctx context.Context) string {
	if a := attemptFrom(ctx); a != nil {
		return a.requestID
	}
	return ""
}

// MarkFinal marks the handler's failure response (4xx or 5xx) as final: its
// side effects happened and must stand, so the middleware stores the
// response, commits the transaction with the handler's writes, and replays
// the response to every retry instead of running the handler again (for
// example a declined payment that was recorded). Without it, a 4xx or 5xx
// rolls the transaction back and leaves the key free for a corrected retry
// (in the leased mode, the lease is released).
// It has no effect on a 2xx or 3xx, which is stored anyway.
//
// Call it while the handler runs, before or after writing the response. It
// reports false, and does nothing, outside a handler called by the
// middleware, and once the body of a failure response outgrew
// Config.MaxResponseBytes while not marked final: that response has started
// streaming to the client and cannot be stored any more. A handler that
// writes a large final failure calls MarkFinal before writing it (and gets
// ErrResponseTooLarge beyond the limit, as for a success).
func MarkFinal(ctx context.Context) bool {
	a := attemptFrom(ctx)
	if a == nil || a.ended.Load() {
		return false
	}
	a.decide.Lock()
	defer a.decide.Unlock()
	if a.streamed {
		return false
	}
	a.final.Store(true)
	return true
}

// RetryTransaction asks the middleware to roll this attempt back and run the
// request again in a new transaction: the handler is called again with a
// fresh copy of the body and a fresh response, and whatever this attempt
// wrote is discarded. Use it when the handler's own statement failed because
// of a concurrent transaction (a deadlock or a serialization failure, as the
// driver reports it). The store's Config.MaxTxRetries bounds the attempts;
// past it the client gets 503 with CodeStoreUnavailable.
//
// It reports false, and does nothing, outside a handler called by the
// middleware, once a failure response larger than Config.MaxResponseBytes
// has started streaming to the client, and in the leased mode, where the
// handler's outside call must not be repeated behind the client's back:
// answer with a 5xx instead (the lease is released and the client's retry
// runs the handler again).
func RetryTransaction(ctx context.Context) bool {
	a := attemptFrom(ctx)
	if a == nil || a.ended.Load() || a.begin != nil {
		return false
	}
	a.decide.Lock()
	defer a.decide.Unlock()
	if a.streamed {
		return false
	}
	a.retry.Store(true)
	return true
}
