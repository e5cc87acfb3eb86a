package idemgrpc

import (
	"context"
	"sync/atomic"
)

// attemptKey is the context key of the *attempt a handler runs in.
type attemptKey struct{}

// attempt is what one run of the handler sees through its context. Each
// run (the first, and each one after a retryable transaction failure) gets
// its own.
type attempt struct {
	tx    any // the store's TTx
	key   string
	scope string
	// final is set by the handler, possibly from goroutines it started;
	// ended when the handler returned.
	final, ended atomic.Bool
}

func attemptFrom(ctx context.Context) *attempt {
	a, _ := ctx.Value(attemptKey{}).(*attempt)
	return a
}

// Tx returns the business transaction of the call whose context is ctx,
// typed as the store's transaction type (pgx.Tx for package postgres,
// *sql.Tx for packages mysql and sqlite). The key is already claimed in it.
// Run the handler's writes on it: they commit together with the stored
// response, or not at all. Never commit or roll it back.
//
// ok is false outside a handler called by the interceptor (an unprotected
// method, or a call without a key that Config.KeyOptional let through),
// after the handler returned, and when TTx is not the store's type.
func Tx[TTx any](ctx context.Context) (tx TTx, ok bool) {
	a := attemptFrom(ctx)
	if a == nil || a.ended.Load() {
		return tx, false
	}
	tx, ok = a.tx.(TTx)
	return tx, ok
}

// Key returns the idempotency key of the call whose context is ctx, for a
// business unique constraint. ok is false outside the interceptor.
func Key(ctx context.Context) (key string, ok bool) {
	if a := attemptFrom(ctx); a != nil {
		return a.key, true
	}
	return "", false
}

// Scope returns the scope the key is claimed in: the tenant and the full
// method. ok is false outside the interceptor.
func Scope(ctx context.Context) (scope string, ok bool) {
	if a := attemptFrom(ctx); a != nil {
		return a.scope, true
	}
	return "", false
}

// MarkFinal marks the error the handler returns as final: its side effects
// happened and must stand (a declined payment that was recorded), so the
// interceptor stores the error's status (code, message and details),
// commits the transaction with the handler's writes, and answers every
// retry with the same status instead of running the handler again. Without
// it, an error rolls the transaction back and leaves the key free for a
// corrected retry. It has no effect on a successful call, which is stored
// anyway.
//
// It reports false, and does nothing, outside a handler called by the
// interceptor and after the handler returned.
func MarkFinal(ctx context.Context) bool {
	a := attemptFrom(ctx)
	if a == nil || a.ended.Load() {
		return false
	}
	a.final.Store(true)
	return true
}
