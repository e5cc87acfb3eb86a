package idem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemstore/idem/internal/digest"
)

// Result is what [Store.Do] answers.
type Result struct {
	// Response is the callback's response, or the stored one on a replay.
	Response *Response
	// Replayed is true when Response was stored by an earlier request and
	// the callback did not run.
	Replayed bool
	// Status is the stored record's status: StatusSucceeded, or
	// StatusFailed for a failure stored as final (see [FinalFailure]).
	Status Status

	// replayed is the record a replay answered from, for the replay cache.
	replayed *Record
}

// FinalFailureError carries a response that [Store.Do] stores as a final
// failure; build it with [FinalFailure].
type FinalFailureError struct {
	Response *Response
}

// Error implements error.
func (e *FinalFailureError) Error() string {
	if e.Response == nil {
		return "idem: final failure without a response"
	}
	return fmt.Sprintf("idem: final failure with status %d", e.Response.StatusCode)
}

// FinalFailure returns an error that tells [Store.Do] to store resp as a
// final failure and commit the transaction, instead of rolling it back: for a
// failure whose effects must stand (a declined payment recorded in the same
// transaction), so that retries replay resp instead of running again. Do then
// returns a nil error and a Result with Status StatusFailed.
func FinalFailure(resp *Response) error { return &FinalFailureError{Response: resp} }

// Do runs fn exactly once per (scope, key, fp) across every process sharing
// the table: it begins a transaction, claims the key in it, runs fn with the
// transaction, stores fn's response and commits, so the business rows and the
// stored response commit together. A retry with the same fingerprint gets the
// stored response (Result.Replayed) without running fn: from one read on the
// pool when Config.ReplayRead has Do read first (see [ReplayRead]), otherwise
// from the claim in Do's transaction.
//
// fn must touch the database only through tx, and nothing outside it: Do
// runs it again when the transaction fails with [ErrRetryable] (a deadlock
// or serialization failure), up to Config.MaxTxRetries times. Work with
// outside side effects must use [Store.Claim] and [Store.Complete] instead.
//
// If fn returns an error or panics, the transaction rolls back, nothing is
// stored, the key is free again, and the error (or panic) reaches the caller,
// except for an error made by [FinalFailure], whose response is stored as a
// final failure and committed.
// A response (or FinalFailure response) that cannot be stored rolls the
// transaction back with [ErrInvalidResponse]; it is not retried.
// An error from fn that matches [ErrRetryable] is retried like idem's own;
// so is a driver error of fn's own statements that the dialect's
// [ErrorClassifier] classifies as retryable (package mysql: a deadlock, or a
// certification failure on Galera), and fn's errors reach the caller so
// classified (see [Store.Classify]).
// Other errors are those of [Store.Claim].
//
// On a dialect that implements [TxPipeliner] (postgres), BEGIN is sent with
// the claim and the completion with COMMIT, saving two round trips. On a
// [DeferredClaimer] (postgres, sqlite) the claim writes nothing: Do holds a
// lock on the key (an advisory lock; SQLite's write lock) and the
// completion inserts the finished record, one row version instead of an
// insert and an update (see docs/design.md). fn therefore does not find the
// key's record through [Store.GetTx] while it runs. On an
// [OptimisticClaimer] (package mysql with WithOptimisticDo) nothing holds
// the key while fn runs: overlapping calls of one key may each run fn,
// and all but one are rolled back and replay the one that committed.
func (s *Store[TTx]) Do(ctx context.Context, scope, key string, fp Fingerprint, fn func(ctx context.Context, tx TTx) (*Response, error)) (*Result, error) {
	if err := validate(scope, key); err != nil {
		return nil, err
	}
	if fn == nil {
		return nil, errors.New("idem: Do needs a callback")
	}
	// Taken before anything is read, so that a fill from what this call
	// reads or completes loses to a Delete that ran meanwhile, and its
	// entry's deadline is counted from before the record was completed.
	// Without the cache, Do's path pays for neither.
	var (
		gen   uint64
		began time.Time
	)
	if s.cache != nil {
		gen, began = s.cache.gen(), s.cacheNow()
		if res := s.replayCached(ctx, scope, key, fp, began); res != nil {
			return res, nil
		}
	}
	if res := s.replayFirst(ctx, scope, key, fp); res != nil {
		s.cacheAnswer(scope, key, fp, res, gen, began)
		return res, nil
	}
	for try := 0; ; try++ {
		res, err := s.doOnce(ctx, scope, key, fp, fn)
		if err == nil || !errors.Is(err, ErrRetryable) || try >= s.cfg.MaxTxRetries || ctx.Err() != nil {
			s.noteDo(res, err)
			if err == nil {
				s.cacheAnswer(scope, key, fp, res, gen, began)
			}
			return res, err
		}
		s.cfg.Logger.LogAttrs(ctx, slog.LevelDebug, "idem: retrying transaction",
			slog.String("key", digest.Key(scope, key)), slog.Int("try", try+1))
		if err := sleepCtx(ctx, backoff(try)); err != nil {
			return nil, err
		}
	}
}

// doFunc is the callback of [Store.Do].
type doFunc[TTx any] = func(ctx context.Context, tx TTx) (*Response, error)

// doTx is the transaction of one try of Do.
type doTx[TTx any] struct {
	tx TTx
	// open is true from the begin until the commit is sent: until then an
	// early return, an error or a panic rolls tx back.
	open bool
}

// rollbackDo rolls t back if it is open, even when ctx is cancelled. After
// a failed BeginClaim this is harmless (its contract).
func (s *Store[TTx]) rollbackDo(ctx context.Context, t *doTx[TTx]) {
	if t.open {
		t.open = false
		_ = s.dialect.Rollback(context.WithoutCancel(ctx), t.tx)
	}
}

// doOnce is one try of Do: its own transaction, the claim in it, fn, the
// completion and the commit.
func (s *Store[TTx]) doOnce(ctx context.Context, scope, key string, fp Fingerprint, fn doFunc[TTx]) (*Result, error) {
	var t doTx[TTx]
	defer s.rollbackDo(ctx, &t) // runs during panics too
	start := s.observeStart()
	c, err := s.beginClaim(ctx, &t, scope, key, fp)
	if s.cfg.Observer != nil && !errors.Is(err, errStaleLease) {
		// A failed BEGIN counts as the claim's outcome; a stale lease is
		// reported by doStale's pool-level claim.
		s.observeClaim(ctx, start, scope, key, c, err)
	}
	if errors.Is(err, errStaleLease) {
		// A crashed leased holder's record: the status check must not run
		// inside this transaction (its verdict would roll back with it, and
		// it would hold locks for the whole check). Resolve on the pool.
		s.rollbackDo(ctx, &t)
		return s.doStale(ctx, scope, key, fp, fn)
	}
	if err != nil || !c.Acquired() {
		return doAnswer(c, err)
	}
	status, resp, err := s.runFn(ctx, t.tx, c, fn)
	if err != nil {
		return nil, err
	}
	send := s.completeCommitSend(t.tx, c)
	if send == nil {
		return s.completeAndCommit(ctx, &t, c, status, resp)
	}
	// The completion and COMMIT in one round trip. On an error nothing was
	// committed (unless COMMIT's outcome is unknown, as with Commit) and the
	// deferred Rollback is harmless.
	if err := s.completeVia(ctx, &t.tx, c, status, resp, "complete and commit", send); err != nil {
		return nil, err
	}
	t.open = false
	return &Result{Response: resp, Status: status}, nil
}

// beginClaim begins t and claims the key in it: with BEGIN in the claim's
// round trip on a [TxPipeliner], and deferred on a [DeferredClaimer].
func (s *Store[TTx]) beginClaim(ctx context.Context, t *doTx[TTx], scope, key string, fp Fingerprint) (*Claim, error) {
	p := s.claimParams(scope, key, fp)
	if oc, ok := s.dialect.(OptimisticClaimer[TTx]); ok {
		tx, res, err := oc.BeginClaimOptimistic(ctx, p)
		if !errors.Is(err, ErrSkipDefer) {
			t.tx, t.open = tx, true
			// Any further claim statement (after a takeover's race, say)
			// writes the record, as after BeginClaim.
			cl := &claimer{exec: s.dialect.Tx(tx), site: inDoTx}
			c, err := s.settleClaim(ctx, cl, p, claimStep{res: res, err: err, deferred: err == nil && res.Created})
			if c != nil && c.deferred {
				c.optimistic = true
			}
			return c, err
		}
	}
	switch d := s.dialect.(type) {
	case DeferredTxPipeliner[TTx]:
		tx, res, err := d.BeginClaimDeferred(ctx, p)
		t.tx, t.open = tx, true
		cl := s.txClaimer(tx, inDoTx)
		return s.settleClaim(ctx, cl, p, cl.deferredStep(ctx, p, res, err))
	case TxPipeliner[TTx]:
		tx, res, err := d.BeginClaim(ctx, p)
		t.tx, t.open = tx, true
		cl := &claimer{exec: s.dialect.Tx(tx), site: inDoTx} // the first claim wrote: so do the others
		return s.settleClaim(ctx, cl, p, claimStep{res: res, err: err})
	}
	tx, err := s.dialect.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("idem: begin: %w", err)
	}
	t.tx, t.open = tx, true
	cl := s.txClaimer(tx, inDoTx)
	return s.settleClaim(ctx, cl, p, cl.run(ctx, p))
}

// completeCommitSend returns the function that completes c in tx and
// commits tx in one round trip, or nil when the dialect has none for c's
// kind of claim.
func (s *Store[TTx]) completeCommitSend(tx TTx, c *Claim) func(ctx context.Context, p *CompleteParams) error {
	if oc, ok := s.dialect.(OptimisticClaimer[TTx]); ok && c.optimistic {
		return func(ctx context.Context, p *CompleteParams) error {
			return optimisticConflict(oc.CompleteOptimisticCommit(ctx, tx, s.deferredParams(c, p)))
		}
	}
	if dp, ok := s.dialect.(DeferredTxPipeliner[TTx]); ok && c.deferred {
		return func(ctx context.Context, p *CompleteParams) error {
			return deferredConflict(dp.CompleteDeferredCommit(ctx, tx, s.deferredParams(c, p)))
		}
	}
	if pipe, ok := s.dialect.(TxPipeliner[TTx]); ok && !c.deferred {
		return func(ctx context.Context, p *CompleteParams) error { return pipe.CompleteCommit(ctx, tx, p) }
	}
	return nil
}

// doAnswer is Do's answer when fn is not to run: the claim's error, or the
// replay of the stored record.
func doAnswer(c *Claim, err error) (*Result, error) {
	if inProgress, ok := errors.AsType[*InProgressError](err); ok && inProgress.TxAborted {
		// Do rolls its own transaction back: nothing is left for the caller to do.
		out := *inProgress
		out.TxAborted = false
		return nil, &out
	}
	if err != nil {
		return nil, err
	}
	return &Result{Response: c.Replay.Response, Replayed: true, Status: c.Replay.Status, replayed: c.Replay}, nil
}

// runFn runs fn in tx and says what to store: fn's response as a success,
// or the response of a [FinalFailure] error as a failure.
func (s *Store[TTx]) runFn(ctx context.Context, tx TTx, c *Claim, fn doFunc[TTx]) (Status, *Response, error) {
	resp, err := fn(withDoClaim(ctx, c), tx)
	status := StatusSucceeded
	if final, ok := errors.AsType[*FinalFailureError](err); ok {
		resp, err, status = final.Response, nil, StatusFailed
	}
	if err != nil {
		// fn's own statements can meet a conflict (on Galera, a
		// certification failure at any statement): Do retries it only
		// if it matches ErrRetryable.
		return status, nil, s.Classify(err)
	}
	if resp == nil {
		return status, nil, errors.New("idem: Do callback returned a nil response and no error")
	}
	return status, resp, nil
}

// completeAndCommit completes c in t with resp and commits t. Once the
// commit is sent t is no longer open: its outcome may be unknown, so it is
// neither rolled back nor, in doStale, is the claim released; a committed
// claim left processing is settled after its lease by the status check.
func (s *Store[TTx]) completeAndCommit(ctx context.Context, t *doTx[TTx], c *Claim, status Status, resp *Response) (*Result, error) {
	if err := s.completeTx(ctx, t.tx, c, status, resp); err != nil {
		return nil, err
	}
	t.open = false
	if err := s.dialect.Commit(ctx, t.tx); err != nil {
		return nil, fmt.Errorf("idem: commit key %s: %w", digest.Key(c.Scope, c.Key), err)
	}
	return &Result{Response: resp, Status: status}, nil
}

// doStale finishes a Do whose key holds a stale lease: a pool-level claim
// resolves it through the status check, committing the verdict; if the key
// is handed over to this call, fn runs in a transaction of its own and the
// committed claim is completed there, fenced by its token, or released when
// fn fails (its writes rolled back, so the key is free again).
func (s *Store[TTx]) doStale(ctx context.Context, scope, key string, fp Fingerprint, fn doFunc[TTx]) (*Result, error) {
	c, err := s.Claim(ctx, scope, key, fp)
	if err != nil || !c.Acquired() {
		return doAnswer(c, err)
	}
	tx, err := s.dialect.Begin(ctx)
	if err != nil {
		_ = s.Release(context.WithoutCancel(ctx), c)
		return nil, fmt.Errorf("idem: begin: %w", err)
	}
	t := &doTx[TTx]{tx: tx, open: true}
	defer func() {
		if t.open {
			// Runs during panics too: the writes roll back, the key is freed.
			s.rollbackDo(ctx, t)
			_ = s.Release(context.WithoutCancel(ctx), c)
		}
	}()
	status, resp, err := s.runFn(ctx, tx, c, fn)
	if err != nil {
		return nil, err
	}
	return s.completeAndCommit(ctx, t, c, status, resp)
}
