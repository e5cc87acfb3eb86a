package idemhttp

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/idemstore/idem"
)

// cleanupTimeout bounds a rollback or a release that runs after the
// request's own context may have ended (Timeout ran out, or the handler
// panicked).
const cleanupTimeout = 5 * time.Second

// leasedRun is the middleware's state for one leased request whose lease
// was acquired. It lives on the request's goroutine, except begin, which the
// handler may call from goroutines of its own.
type leasedRun[TTx any] struct {
	m     *middleware[TTx]
	lease *idem.Lease[TTx]
	// ctx is the request's context detached from the client and bounded by
	// Timeout: the business transaction runs in it, and the completion.
	ctx context.Context

	stopOnce      sync.Once
	stopKeepAlive func() error
	renewErr      error // why the renewals ended early; set by stopRenewals

	mu       sync.Mutex
	closed   bool // the handler returned: no transaction begins any more
	tx       TTx
	begun    bool
	beginErr error // the store could not begin the transaction
}

// serveLeased commits the claim with a lease, runs the handler while
// KeepAlive renews it, and completes the lease in the business transaction
// (or releases it), answering once all of that is done.
func (m *middleware[TTx]) serveLeased(w http.ResponseWriter, rq *request) {
	r := rq.r
	// As in the transactional mode, a client that goes away does not
	// cancel anything once the key is claimed; Timeout bounds it all.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), m.cfg.Timeout)
	defer cancel()

	lease, err := m.store.Acquire(ctx, rq.scope, rq.key, rq.fp)
	switch {
	case err != nil:
		m.failClaim(w, rq, err)
		return
	case !lease.Acquired():
		m.replay(w, rq, lease.Replay.Response)
		return
	}
	rq.attempt = lease.Attempt()
	run := &leasedRun[TTx]{m: m, lease: lease, ctx: ctx}

	// The handler's context is cancelled, with the renewal's error as its
	// cause (idem.ErrFenced for a lost lease), when KeepAlive reports a
	// failure. It is not KeepAlive's work context itself, which also ends
	// when the renewals stop at the handler's first Tx call.
	handlerCtx, cancelHandler := context.WithCancelCause(ctx)
	defer cancelHandler(nil)
	keepAliveCtx, stop := lease.KeepAlive(ctx)
	run.stopKeepAlive = stop
	defer func() { _ = run.stopRenewals() }() // finish reads the renewal error; here it only ensures the renewals stop
	defer context.AfterFunc(keepAliveCtx, func() {
		// Canceled: stopped by the middleware, or ctx ended (which the
		// handler's context sees by itself); DeadlineExceeded: Timeout.
		//nolint:errorlint // identity on purpose: only the bare sentinels mean "stopped" or "Timeout"; a renewal error that wraps one must still cancel the handler
		if cause := context.Cause(keepAliveCtx); cause != context.Canceled && cause != context.DeadlineExceeded {
			cancelHandler(cause)
		}
	})()

	a := &attempt{lease: lease, begin: run.begin, key: rq.key, scope: rq.scope, requestID: rq.requestID}
	cw := m.newCapture(w, rq, a)
	m.spillTo(cw, m.putFunc(ctx, lease.Claim(), nil))
	defer cw.abortSpill() // a panic of the handler
	returned := false
	defer func() {
		if returned {
			return
		}
		// The handler panicked. As in the transactional mode the panic
		// propagates unchanged, with nothing sent; the transaction is
		// rolled back and the lease released first, so the key is free.
		tx, begun := run.close()
		run.rollback(tx, begun)
		_ = run.stopRenewals()
		_ = run.release()
		m.log(rq, "panic", 0)
	}()
	m.runHandler(cw, rq, context.WithValue(handlerCtx, attemptKey{}, a), a)
	returned = true
	run.finish(w, rq, cw, a.final.Load())
}

// finish decides what becomes of the lease once the handler returned, and
// answers.
func (l *leasedRun[TTx]) finish(w http.ResponseWriter, rq *request, cw *capture, final bool) {
	m := l.m
	tx, begun := l.close()
	renewErr := l.stopRenewals()
	storable := cw.status < 400 || final
	if begun {
		// A spooled body goes into the handler's transaction, with the record.
		cw.putLater(m.putFunc(l.ctx, l.lease.Claim(), &tx))
	}
	spillErr := cw.endSpill(storable && !cw.streamed && renewErr == nil && l.beginErr == nil)
	switch {
	case cw.streamed:
		// A failure too large to buffer, already on its way to the client:
		// it is never stored, whatever else happened, so only undo.
		l.rollback(tx, begun)
		outcome := "rolled_back"
		if err := l.release(); err != nil {
			outcome = "rolled_back_not_released"
		}
		m.log(rq, outcome, cw.status)
	case errors.Is(renewErr, idem.ErrFenced):
		// Another holder has the key (a status check or a takeover after
		// the lease ran out): whatever the handler did must not be stored.
		l.rollback(tx, begun)
		m.failLeaseLost(w, rq)
	case l.beginErr != nil:
		// The handler asked for its transaction and the store could not
		// begin one. In this mode the transaction comes after the outside
		// call, so that call may have happened whatever the handler then
		// answered (typically the 503 of a handler whose Tx failed): the
		// key is not given up, or a retry would call the outside system
		// again. The record stays processing and, once the lease ran out,
		// the status check decides.
		m.failUnavailable(w, rq)
	case cw.unwritten:
		// Nothing says the handler ran, nor that it did not: it may have
		// made its outside call and returned without a word. Nothing is
		// stored, and the key is not given up either; once the lease ran
		// out, the status check decides.
		l.rollback(tx, begun)
		m.failNoResponse(w, rq)
	case !storable:
		l.rollback(tx, begun)
		outcome := "rolled_back"
		if err := l.release(); err != nil {
			// The record stays processing until its lease runs out.
			outcome = "rolled_back_not_released"
		}
		m.send(w, rq, cw)
		m.log(rq, outcome, cw.status)
	case spillErr != nil:
		// The body store failed while the handler wrote: nothing stored.
		l.rollback(tx, begun)
		_ = l.release()
		m.failClaim(w, rq, spillErr)
	case cw.tooLarge():
		l.rollback(tx, begun)
		_ = l.release()
		m.failTooLarge(w, rq)
	default:
		l.complete(w, rq, cw, tx, begun)
	}
}

// complete stores the handler's response, fenced by the lease's token: in
// the handler's transaction, then committed, or in a statement of its own
// when the handler never took the transaction.
func (l *leasedRun[TTx]) complete(w http.ResponseWriter, rq *request, cw *capture, tx TTx, begun bool) {
	m := l.m
	failed := cw.status >= 400 // and marked final: stored as a final failure
	resp := &idem.Response{StatusCode: cw.status, Header: m.replayable(cw.sent), Body: cw.body.Bytes(), BodyRef: cw.ref}
	var err error
	switch {
	case !begun && failed:
		err = l.lease.Fail(l.ctx, resp)
	case !begun:
		err = l.lease.Complete(l.ctx, resp)
	default:
		if failed {
			err = l.lease.FailTx(l.ctx, tx, resp)
		} else {
			err = l.lease.CompleteTx(l.ctx, tx, resp)
		}
		if err != nil {
			l.rollback(tx, true)
		} else {
			err = m.store.Dialect().Commit(l.ctx, tx)
		}
	}
	switch {
	case err == nil:
		m.send(w, rq, cw)
		outcome := "completed"
		if failed {
			outcome = "completed_final_failure"
		}
		m.log(rq, outcome, cw.status)
	case errors.Is(err, idem.ErrFenced):
		m.failLeaseLost(w, rq)
	case errors.Is(err, idem.ErrInvalidResponse):
		// Refused before anything was written: the record stays
		// processing, as below, since the outside effect may have happened.
		m.failResponseInvalid(w, rq, err)
	default:
		// The response could not be stored, though the handler's outside
		// effect may have happened: the record stays processing, and once
		// its lease ran out the status check decides (a commit that failed
		// on a lost connection may also have committed; then the retry
		// replays it).
		m.failUnavailable(w, rq)
	}
}

// begin returns the business transaction, beginning it on the first call
// and stopping the lease's renewals then: on SQLite a renewal would wait
// for the write lock the transaction holds, and the transaction's part is
// meant to be short.
func (l *leasedRun[TTx]) begin() (any, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.begun:
		return l.tx, true
	case l.closed || l.beginErr != nil:
		return nil, false
	}
	if err := l.stopRenewals(); errors.Is(err, idem.ErrFenced) {
		return nil, false // the lease is lost: nothing may be written for it
	}
	tx, err := l.m.store.Dialect().Begin(l.ctx)
	if err != nil {
		l.beginErr = err
		return nil, false
	}
	l.tx, l.begun = tx, true
	return tx, true
}

// close forbids new transactions and returns the one begun, if any.
func (l *leasedRun[TTx]) close() (tx TTx, begun bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	return l.tx, l.begun
}

// stopRenewals ends KeepAlive, once, and returns the renewal error that
// ended it early, if any.
func (l *leasedRun[TTx]) stopRenewals() error {
	l.stopOnce.Do(func() { l.renewErr = l.stopKeepAlive() })
	return l.renewErr
}

// rollback rolls tx back if it was begun, even after ctx ended.
func (l *leasedRun[TTx]) rollback(tx TTx, begun bool) {
	if !begun {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(l.ctx), cleanupTimeout)
	defer cancel()
	_ = l.m.store.Dialect().Rollback(ctx, tx)
}

// release gives the key up, even after ctx ended.
func (l *leasedRun[TTx]) release() error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(l.ctx), cleanupTimeout)
	defer cancel()
	return l.lease.Release(ctx)
}

// failLeaseLost answers 503 with CodeLeaseLost.
func (m *middleware[TTx]) failLeaseLost(w http.ResponseWriter, rq *request) {
	m.fail(w, rq, "lease_lost", &Error{Status: http.StatusServiceUnavailable, Code: CodeLeaseLost,
		Message:    "This request lost its hold on the key to another attempt before it finished, and nothing of it was stored. Retry later with the same key.",
		RetryAfter: m.cfg.UnavailableRetryAfter})
}
