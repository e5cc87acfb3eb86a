package idem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/idemstore/idem/internal/digest"
)

// StatusCheck reports whether the business effect of a stale processing
// record committed: the holder's lease ran out without a completion, most
// likely because its process died. rec is the record as it was found.
//
// Answer from the business data, never from timing: look up the payment,
// the order or the message by something the holder wrote or sent (often
// the idempotency key itself, passed on to the provider). A check that
// cannot tell must answer unknown; an error or a panic counts as unknown.
// The check runs with Config.StatusCheckTimeout and must be safe for
// concurrent use. idem reserves the record for twice that timeout before
// calling it, so no second check of the record starts while a check that
// honours its context runs; an answer that comes after the context's
// deadline is discarded (counted as unknown).
//
// Inside a caller's transaction ([Store.ClaimTx]) the check does not run:
// the claimer gets [ErrInProgress], and a pool-level claim, [Store.Acquire],
// [Store.Do] or the [Reaper] settles the record.
type StatusCheck func(ctx context.Context, rec Record) (Verdict, error)

// VerdictKind is what a [StatusCheck] found. The zero value is
// VerdictUnknown, so a forgotten field never finalises anything.
type VerdictKind int

// Verdicts of a [StatusCheck].
const (
	// VerdictUnknown keeps the record processing and pushes its lease out;
	// claimers get ErrInProgress and the check runs again later.
	VerdictUnknown VerdictKind = iota
	// VerdictCommitted finalises the record with Verdict.Response, which
	// every retry then replays.
	VerdictCommitted
	// VerdictNotCommitted hands the key over: the next claimer acquires it
	// with a new fencing token and the next attempt number.
	VerdictNotCommitted
)

// String returns "unknown", "committed" or "not committed".
func (k VerdictKind) String() string {
	switch k {
	case VerdictCommitted:
		return "committed"
	case VerdictNotCommitted:
		return "not committed"
	default:
		return "unknown"
	}
}

// Verdict is the answer of a [StatusCheck].
type Verdict struct {
	Kind VerdictKind
	// Response is stored and replayed when Kind is VerdictCommitted, and
	// required then. Rebuild it from the business row (201 with the
	// order), or point at the resource (303 or 409 with Location) when no
	// body can be rebuilt. A response that fails [Response.Validate] or the
	// Config's size limits (a forgotten StatusCode) is not stored: the
	// verdict counts as unknown and is logged.
	Response *Response
	// Failed stores Response as a final failure instead of a success.
	Failed bool
}

// Committed is the verdict for an effect that committed; resp is stored and replayed.
func Committed(resp *Response) Verdict { return Verdict{Kind: VerdictCommitted, Response: resp} }

// NotCommitted is the verdict for an effect that never happened.
func NotCommitted() Verdict { return Verdict{Kind: VerdictNotCommitted} }

// Unknown is the verdict of a check that cannot tell yet.
func Unknown() Verdict { return Verdict{} }

// errStaleLease is the answer of a claim inside [Store.Do]'s own
// transaction that met a record whose lease ran out and that only a status
// check on the pool can settle. It never leaves the package: Do settles the
// record on the pool (doStale).
var errStaleLease = errors.New("idem: the key's lease ran out; its status check runs outside the caller's transaction")

// Resolution outcomes of a stale record, for logs and the reaper's report.
const (
	resolvedCommitted    = "finalised"
	resolvedNotCommitted = "handed_over"
	resolvedUnknown      = "unknown"
	resolvedSkipped      = "unresolved"
)

// reserveStale takes a stale record over with a new token, so that only one
// caller runs the check for it and the old holder is fenced out. The lease
// covers the check with room to act on its verdict.
func (s *Store[TTx]) reserveStale(ctx context.Context, exec Executor, rec *Record) (int64, error) {
	tok := max(newToken(), rec.Token+1)
	_, err := exec.RenewLease(ctx, &RenewLeaseParams{
		Scope:         rec.Scope,
		Key:           rec.Key,
		Token:         rec.Token,
		NewToken:      tok,
		Duration:      2 * s.cfg.StatusCheckTimeout,
		OnlyIfExpired: true, // a holder that renewed meanwhile keeps its key
		WaitTimeout:   s.cfg.WaitTimeout,
		Now:           s.now(),
	})
	return tok, err
}

// runCheck calls the status check with its timeout, turning errors, panics
// and malformed verdicts into unknown.
func (s *Store[TTx]) runCheck(ctx context.Context, rec *Record) (v Verdict, err error) {
	cctx, cancel := context.WithTimeout(ctx, s.cfg.StatusCheckTimeout)
	defer cancel()
	defer func() {
		if r := recover(); r != nil {
			// The panic value may carry business data: log its type only.
			v, err = Verdict{}, fmt.Errorf("idem: status check panicked (%T)", r)
		}
	}()
	v, err = s.cfg.StatusCheck(cctx, *rec)
	switch {
	case cctx.Err() != nil && ctx.Err() == nil:
		// An answer after the deadline is discarded: the reservation may
		// have run out meanwhile and another caller may be checking now.
		return Verdict{}, fmt.Errorf("idem: status check overran its %s timeout", s.cfg.StatusCheckTimeout)
	case err != nil:
		return Verdict{}, &checkError{msg: "idem: status check failed", cause: err, user: true}
	case v.Kind == VerdictCommitted && v.Response == nil:
		return Verdict{}, errors.New("idem: status check answered committed without a response")
	case v.Kind == VerdictCommitted:
		if err := s.validateResponse(v.Response); err != nil {
			// Stored, it would poison the key: every replay would fail.
			return Verdict{}, &checkError{msg: "idem: status check answered committed with an invalid response", cause: err}
		}
	case v.Kind != VerdictCommitted && v.Kind != VerdictNotCommitted && v.Kind != VerdictUnknown:
		return Verdict{}, fmt.Errorf("idem: status check answered an invalid verdict %d", v.Kind)
	}
	return v, nil
}

// unknownDelay is how far an unresolved record's lease is pushed out: it
// grows with the record's age, from one lease duration up to 15 minutes, so
// a check that keeps failing is asked less and less often.
func (s *Store[TTx]) unknownDelay(rec *Record, now time.Time) time.Duration {
	return min(max(s.cfg.LeaseDuration, now.Sub(rec.CreatedAt)/8), 15*time.Minute)
}

// resolveStale runs the status check for a stale record reserved with
// token tok and applies the verdict through exec. handOver gives the key to
// the next holder: the claim path takes it over itself, the reaper deletes
// the record. It returns the resolution and, for unknown, the delay.
func (s *Store[TTx]) resolveStale(ctx context.Context, exec Executor, rec *Record, now time.Time, tok int64, handOver func() error) (string, time.Duration, error) {
	kd := digest.Key(rec.Scope, rec.Key)
	start := time.Now()
	v, checkErr := s.runCheck(ctx, rec)
	s.observeCheck(ctx, start, rec, v, checkErr)
	if checkErr != nil {
		s.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: status check failed; record stays processing",
			append([]slog.Attr{slog.String("key", kd)}, s.checkErrorAttrs(checkErr)...)...)
	}
	switch v.Kind {
	case VerdictCommitted:
		status := StatusSucceeded
		if v.Failed {
			status = StatusFailed
		}
		resp, err := s.storeBody(ctx, nil, rec.Scope, rec.Key, tok, v.Response)
		if err != nil {
			return "", 0, err
		}
		err = exec.Complete(ctx, &CompleteParams{
			Scope: rec.Scope, Key: rec.Key, Token: tok, Status: status,
			Response: resp, Retention: s.cfg.Retention, Now: s.now(),
		})
		if err != nil {
			return "", 0, err
		}
		s.logResolution(ctx, kd, resolvedCommitted, rec.Attempt)
		return resolvedCommitted, 0, nil
	case VerdictNotCommitted:
		if err := handOver(); err != nil {
			return "", 0, err
		}
		s.logResolution(ctx, kd, resolvedNotCommitted, rec.Attempt)
		return resolvedNotCommitted, 0, nil
	default:
		delay := s.unknownDelay(rec, now)
		_, err := exec.RenewLease(ctx, &RenewLeaseParams{
			Scope: rec.Scope, Key: rec.Key, Token: tok, NewToken: tok, Duration: delay,
			WaitTimeout: s.cfg.WaitTimeout, Now: s.now(),
		})
		if err != nil {
			return "", 0, err
		}
		s.logResolution(ctx, kd, resolvedUnknown, rec.Attempt)
		return resolvedUnknown, delay, nil
	}
}

func (s *Store[TTx]) logResolution(ctx context.Context, keyDigest, outcome string, attempt int) {
	level := slog.LevelInfo
	if outcome == resolvedUnknown {
		level = slog.LevelWarn
	}
	s.cfg.Logger.LogAttrs(ctx, level, "idem: stale lease "+outcome,
		slog.String("dialect", s.dialect.Name()), slog.String("key", keyDigest), slog.Int("attempt", attempt))
}

// claimStale handles a claim that met a processing record whose lease ran
// out, with the claimer's fingerprint already matched.
//
// Inside a transaction (site inCallerTx or inDoTx) the status check does
// not run: its verdict would live and die with that transaction, and the
// transaction would hold its locks (on SQLite, the whole database) for the
// whole check. A caller's transaction gets an *InProgressError; [Store.Do]
// gets errStaleLease and resolves the record on the pool. A pool-level
// claim, [Store.Acquire] or the [Reaper] settles the record.
func (s *Store[TTx]) claimStale(ctx context.Context, exec Executor, site claimSite, rec *Record, now time.Time, kd string) (*Claim, error) {
	takeOver := func(fromToken int64, cond TakeoverCondition) (*Claim, error) {
		newTok := max(newToken(), fromToken+1)
		err := exec.Takeover(ctx, &TakeoverParams{
			Scope: rec.Scope, Key: rec.Key, Token: fromToken, NewToken: newTok,
			Fingerprint: rec.Fingerprint, Attempt: rec.Attempt + 1,
			LeaseDuration: s.cfg.LeaseDuration, Retention: s.cfg.Retention,
			Condition: cond, WaitTimeout: s.cfg.WaitTimeout, Now: s.now(),
		})
		if err != nil {
			return nil, err
		}
		s.observeLease(ctx, rec.Scope, rec.Key, LeaseTakenOver, rec.Attempt+1)
		return &Claim{Scope: rec.Scope, Key: rec.Key, Token: newTok, Attempt: rec.Attempt + 1,
			LeaseExpiresAt: now.Add(s.cfg.LeaseDuration)}, nil
	}
	switch {
	case s.cfg.StatusCheck != nil && site == inDoTx:
		return nil, errStaleLease
	case s.cfg.StatusCheck != nil && site == inCallerTx:
		// InProgressError.Cause is only ever a driver's error: none here.
		return nil, &InProgressError{KeyDigest: kd, RetryAfter: time.Second}
	case s.cfg.StatusCheck != nil:
		return s.checkStale(ctx, exec, rec, now, kd, takeOver)
	case s.cfg.BlindTakeover:
		c, err := takeOver(rec.Token, TakeoverLeaseExpired)
		if err == nil {
			s.logResolution(ctx, kd, "taken_over_blind", rec.Attempt)
		}
		return c, err
	default:
		s.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: lease ran out and no StatusCheck is configured; key stays in progress",
			slog.String("key", kd))
		// Nothing will change by itself soon: suggest a lease's worth of
		// patience rather than an immediate retry loop.
		return nil, &InProgressError{KeyDigest: kd, RetryAfter: s.cfg.LeaseDuration}
	}
}

// checkStale reserves a stale record, runs the status check and answers
// the claimer from the verdict: the key handed over through takeOver, the
// finalised record's replay, or in progress while the verdict is unknown.
func (s *Store[TTx]) checkStale(ctx context.Context, exec Executor, rec *Record, now time.Time, kd string,
	takeOver func(fromToken int64, cond TakeoverCondition) (*Claim, error),
) (*Claim, error) {
	tok, err := s.reserveStale(ctx, exec, rec)
	if err != nil {
		return nil, err
	}
	var acquired *Claim
	outcome, delay, err := s.resolveStale(ctx, exec, rec, now, tok, func() error {
		c, err := takeOver(tok, TakeoverReserved)
		acquired = c
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("idem: resolve stale key %s: %w", kd, err)
	}
	switch outcome {
	case resolvedNotCommitted:
		return acquired, nil
	case resolvedCommitted:
		done, err := exec.Get(ctx, &GetParams{Scope: rec.Scope, Key: rec.Key, Now: s.now()})
		if err == nil || !errors.Is(err, ErrNotFound) {
			err = s.checkRead(ctx, done, err, kd)
		}
		if err != nil {
			return nil, fmt.Errorf("idem: read recovered key %s: %w", kd, err)
		}
		return &Claim{Scope: rec.Scope, Key: rec.Key, Token: done.Token, Attempt: done.Attempt, Replay: done}, nil
	default:
		return nil, &InProgressError{KeyDigest: kd, RetryAfter: delay}
	}
}

// Lease is a committed claim on a key, for work with outside side effects:
// the processing record is visible to every other claimer while the work
// runs, and completion is fenced by the lease's token, so a holder that lost
// its lease to a newer one can never overwrite that holder's result.
//
// Methods are safe for concurrent use, so [Lease.KeepAlive] may renew while
// the work runs.
type Lease[TTx any] struct {
	store *Store[TTx]
	claim Claim

	mu        sync.Mutex
	expiresAt time.Time

	// Replay is the completed record when the key was already done: send
	// its response and do not run the work. The lease is then not held.
	Replay *Record
}

// Acquire claims key in scope for the request identified by fp and commits
// the processing record with a lease of Config.LeaseDuration at once, before
// any work runs. Outcomes and errors are those of [Store.Claim]: a lease
// (Acquired), a replay, [ErrFingerprint] or [ErrInProgress] with the time
// left on the current holder's lease. A record whose lease ran out is
// resolved through Config.StatusCheck first.
//
// Complete the lease inside the business transaction with
// [Lease.CompleteTx], or give the key up with [Lease.Release] after a
// failure that is safe to retry.
func (s *Store[TTx]) Acquire(ctx context.Context, scope, key string, fp Fingerprint) (*Lease[TTx], error) {
	c, err := s.Claim(ctx, scope, key, fp)
	if err != nil {
		return nil, err
	}
	l := &Lease[TTx]{store: s, claim: *c, expiresAt: c.LeaseExpiresAt, Replay: c.Replay}
	return l, nil
}

// Acquired reports whether the caller holds the lease and must do the work.
func (l *Lease[TTx]) Acquired() bool { return l != nil && l.Replay == nil }

// Scope returns the lease's scope.
func (l *Lease[TTx]) Scope() string { return l.claim.Scope }

// KeyDigest returns a short digest of the scope and key, safe to log.
func (l *Lease[TTx]) KeyDigest() string { return digest.Key(l.claim.Scope, l.claim.Key) }

// Token returns the fencing token. Pass it to downstream systems that can
// reject writes from older tokens.
func (l *Lease[TTx]) Token() int64 { return l.claim.Token }

// Attempt returns the holder number: 2 or more after a crashed holder's key
// was handed over.
func (l *Lease[TTx]) Attempt() int { return l.claim.Attempt }

// ExpiresAt returns when the lease runs out unless renewed.
func (l *Lease[TTx]) ExpiresAt() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.expiresAt
}

// Claim returns the lease as a [Claim], for the Store methods that take one.
func (l *Lease[TTx]) Claim() *Claim {
	c := l.claim
	c.Replay = l.Replay
	return &c
}

// CompleteTx stores resp inside the caller's business transaction tx,
// fenced by the lease's token: it returns [ErrFenced] when the lease was
// lost to a newer holder, and then tx must roll back so the newer holder's
// result stands. idem never commits or rolls back tx.
func (l *Lease[TTx]) CompleteTx(ctx context.Context, tx TTx, resp *Response) error {
	return l.store.CompleteTx(ctx, tx, l.Claim(), resp)
}

// Complete stores resp in an autocommitted statement, fenced like CompleteTx.
func (l *Lease[TTx]) Complete(ctx context.Context, resp *Response) error {
	return l.store.Complete(ctx, l.Claim(), resp)
}

// FailTx stores resp as a final failure inside tx, for a failure that
// already had side effects; fenced like CompleteTx.
func (l *Lease[TTx]) FailTx(ctx context.Context, tx TTx, resp *Response) error {
	return l.store.FailTx(ctx, tx, l.Claim(), resp)
}

// Fail stores resp as a final failure in an autocommitted statement.
func (l *Lease[TTx]) Fail(ctx context.Context, resp *Response) error {
	return l.store.Fail(ctx, l.Claim(), resp)
}

// Release gives the key up after a failure that is safe to retry: the
// record is deleted and the next claimer acquires at once. It returns
// [ErrFenced] when the lease was already lost.
func (l *Lease[TTx]) Release(ctx context.Context) error {
	return l.store.Release(ctx, l.Claim())
}

// Renew extends the lease to Config.LeaseDuration from now (the database's
// clock). It returns [ErrFenced] when the lease was lost: stop the work.
func (l *Lease[TTx]) Renew(ctx context.Context) error {
	return l.Extend(ctx, l.store.cfg.LeaseDuration)
}

// Extend sets the lease to run out d from now (the database's clock),
// fenced like Renew.
func (l *Lease[TTx]) Extend(ctx context.Context, d time.Duration) error {
	if !l.Acquired() {
		return fmt.Errorf("idem: key %s was replayed, no lease held: %w", l.KeyDigest(), ErrFenced)
	}
	if d <= 0 {
		return errors.New("idem: lease extension must be positive")
	}
	until, err := l.store.dialect.DB().RenewLease(ctx, &RenewLeaseParams{
		Scope: l.claim.Scope, Key: l.claim.Key, Token: l.claim.Token, NewToken: l.claim.Token,
		Duration: d, WaitTimeout: l.store.cfg.WaitTimeout, Now: l.store.now(),
	})
	l.store.observeRenewal(ctx, &l.claim, err)
	if err != nil {
		return fmt.Errorf("idem: renew lease on key %s: %w", l.KeyDigest(), err)
	}
	l.mu.Lock()
	l.expiresAt = until
	l.mu.Unlock()
	return nil
}

// KeepAlive renews the lease in the background every third of
// Config.LeaseDuration, so work longer than one lease keeps it. Run the
// outside work with the returned context: it is cancelled when the lease is
// lost ([ErrFenced] as its [context.Cause]) or when renewals keep failing
// until the lease would run out (the last error as cause), so the work stops
// instead of racing a new holder. A failed renewal with time left on the
// lease is retried at the next tick.
//
// stop ends the renewals (cancelling one in flight), waits for the
// background goroutine to exit and returns nil, or the error that ended the
// renewals early. Renewals also end when ctx ends. Call stop when the
// outside work is done and before beginning the business transaction that
// completes the lease; begin that transaction with ctx, not with workCtx,
// which stop cancels. (On SQLite a renewal would wait for the write lock the
// business transaction holds.)
func (l *Lease[TTx]) KeepAlive(ctx context.Context) (workCtx context.Context, stop func() error) {
	workCtx, cancel := context.WithCancelCause(ctx)
	interval := max(l.store.cfg.LeaseDuration/3, time.Millisecond)
	quit := make(chan struct{})
	done := make(chan struct{})
	var failure error
	go func() {
		defer close(done)
		t := time.NewTicker(interval)
		defer t.Stop()
		// The local estimate of when the lease runs out unless renewed.
		deadline := time.Now().Add(l.store.cfg.LeaseDuration)
		for {
			select {
			case <-quit:
				return
			case <-workCtx.Done():
				return
			case <-t.C:
				tried := time.Now()
				err := l.Renew(workCtx)
				if workCtx.Err() != nil {
					return // ended by ctx or stop, not a renewal failure
				}
				if err == nil {
					deadline = tried.Add(l.store.cfg.LeaseDuration)
					continue
				}
				if !errors.Is(err, ErrFenced) && time.Now().Add(interval).Before(deadline) {
					continue // a blip (lock wait, connection): the lease still holds
				}
				if !errors.Is(err, ErrFenced) {
					// A fenced renewal reported itself as lost.
					l.store.observeLease(ctx, l.claim.Scope, l.claim.Key, LeaseLost, l.claim.Attempt)
				}
				failure = err
				cancel(err)
				return
			}
		}
	}()
	var once sync.Once
	return workCtx, func() error {
		once.Do(func() {
			close(quit)
			cancel(context.Canceled) // first, so a renewal in flight cannot hold stop up
			<-done
		})
		return failure
	}
}
