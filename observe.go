package idem

import (
	"context"
	"errors"
	"time"

	"github.com/idemstore/idem/internal/digest"
)

// Observer receives what a [Store] and its [Reaper] do, for metrics and
// traces (contrib/idemotel turns it into OpenTelemetry instruments and
// spans). Every field is optional; a nil *Observer, the default, costs
// nothing on the request path.
//
// Each hook is called synchronously, after the operation it reports, with
// the context the operation ran with, so a span it starts nests under the
// caller's span; the event's Latency tells when the operation began. Hooks
// must be safe for concurrent use, must not block, and must not call the
// Store. An event names its record only by the key digest (what idem's
// logs and errors print), never by the key, the scope or a body.
type Observer struct {
	// Operation maps a scope to a bounded operation name (such as
	// "POST /orders") that events carry in their Operation field. It must
	// return few distinct values: monitoring systems keep a series per
	// value. Defaults to nil: Operation is always "".
	Operation func(scope string) string

	// Claim is called once per claim: by [Store.Claim], [Store.ClaimTx],
	// [Store.Acquire], and by [Store.Do] once per transaction it runs (a
	// transaction run again after a conflict claims again), or once for a
	// replay Do answered from its first read (see [ReplayRead]).
	Claim func(ctx context.Context, e ClaimEvent)

	// Complete is called once per completion statement: [Store.Complete],
	// [Store.Fail] and their Tx and [Lease] forms, and the completion of
	// [Store.Do]. Inside a caller's transaction it reports the statement;
	// the response becomes durable only when the caller commits.
	Complete func(ctx context.Context, e CompleteEvent)

	// Lease is called when a lease is renewed, fails to renew, is lost
	// ([ErrFenced]) or, for a stale record, taken over by a new holder.
	Lease func(ctx context.Context, e LeaseEvent)

	// StatusCheck is called after each call of Config.StatusCheck.
	StatusCheck func(ctx context.Context, e StatusCheckEvent)

	// Reap is called at the end of each pass of a [Reaper].
	Reap func(ctx context.Context, e ReapEvent)
}

// ClaimOutcome is how a claim ended.
type ClaimOutcome string

// Claim outcomes.
const (
	// ClaimAcquired: the caller owns the key and runs the business effect.
	ClaimAcquired ClaimOutcome = "acquired"
	// ClaimReplayed: the key was completed before; its response is replayed.
	ClaimReplayed ClaimOutcome = "replayed"
	// ClaimMismatch: the key was used with another request ([ErrFingerprint]).
	ClaimMismatch ClaimOutcome = "mismatch"
	// ClaimInProgress: another holder owns the key ([ErrInProgress]).
	ClaimInProgress ClaimOutcome = "in_progress"
	// ClaimStoreUnavailable: the database could not be reached
	// ([ErrStoreUnavailable]); the request must be refused.
	ClaimStoreUnavailable ClaimOutcome = "store_unavailable"
	// ClaimError: any other error (invalid input, a conflict retried too
	// often, a misconfiguration).
	ClaimError ClaimOutcome = "error"
)

// ClaimEvent reports one claim.
type ClaimEvent struct {
	// Dialect is the dialect's name ("postgres", "mysql", "sqlite").
	Dialect string
	// Operation is Observer.Operation's name for the scope, or "".
	Operation string
	// KeyDigest is the key's digest, as idem's logs print it.
	KeyDigest string
	Outcome   ClaimOutcome
	// Attempt is the holder number of an acquired claim (2 or more after a
	// stale holder's key was handed over), 0 otherwise.
	Attempt int
	// Latency is the time the claim took, from the call (for [Store.Do],
	// from the transaction's BEGIN) to its outcome.
	Latency time.Duration
}

// CompleteOutcome is how a completion statement ended.
type CompleteOutcome string

// Completion outcomes.
const (
	// CompleteStored: the response is stored (in a caller's transaction:
	// written, durable when it commits).
	CompleteStored CompleteOutcome = "stored"
	// CompleteFenced: the claim no longer owned the key ([ErrFenced]).
	CompleteFenced CompleteOutcome = "fenced"
	// CompleteStoreUnavailable: the database could not be reached.
	CompleteStoreUnavailable CompleteOutcome = "store_unavailable"
	// CompleteError: any other error.
	CompleteError CompleteOutcome = "error"
)

// CompleteEvent reports one completion.
type CompleteEvent struct {
	Dialect   string
	Operation string
	KeyDigest string
	Outcome   CompleteOutcome
	// Status is the status stored: StatusSucceeded or StatusFailed.
	Status Status
	// ResponseBytes is the size of the response's body.
	ResponseBytes int
	// Latency is the time the statement took; for [Store.Do] on a dialect
	// that sends the completion with COMMIT (postgres), the commit's too.
	Latency time.Duration
}

// LeaseEventKind is what happened to a lease.
type LeaseEventKind string

// Lease events.
const (
	// LeaseRenewed: [Lease.Renew] or [Lease.Extend] pushed the lease out.
	LeaseRenewed LeaseEventKind = "renewed"
	// LeaseRenewFailed: a renewal failed without losing the lease (the
	// database did not answer); [Lease.KeepAlive] tries again.
	LeaseRenewFailed LeaseEventKind = "renew_failed"
	// LeaseLost: a renewal found the lease taken by a newer holder
	// ([ErrFenced]), or [Lease.KeepAlive] gave up after renewals kept
	// failing until the lease would run out; the work must stop.
	LeaseLost LeaseEventKind = "lost"
	// LeaseTakenOver: a claim took over a record whose lease ran out (after
	// a not-committed verdict, or blindly with Config.BlindTakeover).
	LeaseTakenOver LeaseEventKind = "taken_over"
)

// LeaseEvent reports one lease event.
type LeaseEvent struct {
	Dialect   string
	Operation string
	KeyDigest string
	Kind      LeaseEventKind
	// Attempt is the holder number of the lease (of the new holder for
	// LeaseTakenOver).
	Attempt int
}

// StatusCheckEvent reports one call of Config.StatusCheck.
type StatusCheckEvent struct {
	Dialect   string
	Operation string
	KeyDigest string
	// Verdict is the verdict acted on: VerdictUnknown also when the check
	// failed (Failed).
	Verdict VerdictKind
	// Failed is true when the check returned an error, panicked, overran
	// its timeout or answered an invalid verdict.
	Failed bool
	// Attempt is the stale holder's number.
	Attempt int
	Latency time.Duration
}

// ReapEvent reports one pass of a [Reaper].
type ReapEvent struct {
	Dialect string
	// Report counts what the pass did.
	Report ReapReport
	// Batches counts the DELETE statements of the pass.
	Batches int
	// Behind is true when the pass stopped at ReaperConfig.MaxBatches with
	// its last batch full: expired records are most likely left for the
	// next pass (unless that batch took exactly the last of them).
	Behind bool
	// StaleFound counts the stale leases the pass listed (at most
	// ReaperConfig.StaleLimit); StaleLeft those of them the pass did not
	// finalise or hand over (unknown, unresolved, failed, or taken by
	// another reaper or claimer first).
	StaleFound, StaleLeft int
	// Latency is the pass's duration.
	Latency time.Duration
}

// observeStart returns the time an observed operation starts, or the zero
// time without an Observer (no clock read on the unobserved path).
func (s *Store[TTx]) observeStart() time.Time {
	if s.cfg.Observer == nil {
		return time.Time{}
	}
	return time.Now()
}

func (s *Store[TTx]) operation(scope string) string {
	if f := s.cfg.Observer.Operation; f != nil {
		return f(scope)
	}
	return ""
}

// observeClaim reports a claim's outcome. Callers check s.cfg.Observer.
func (s *Store[TTx]) observeClaim(ctx context.Context, start time.Time, scope, key string, c *Claim, err error) {
	o := s.cfg.Observer
	if o.Claim == nil {
		return
	}
	e := ClaimEvent{
		Dialect: s.dialect.Name(), Operation: s.operation(scope), KeyDigest: digest.Key(scope, key),
		Outcome: claimOutcome(c, err), Latency: time.Since(start),
	}
	if e.Outcome == ClaimAcquired {
		e.Attempt = c.Attempt
	}
	o.Claim(ctx, e)
}

func claimOutcome(c *Claim, err error) ClaimOutcome {
	switch {
	case err == nil && c.Acquired():
		return ClaimAcquired
	case err == nil && c != nil:
		return ClaimReplayed
	case errors.Is(err, ErrFingerprint):
		return ClaimMismatch
	case errors.Is(err, ErrInProgress):
		return ClaimInProgress
	case errors.Is(err, ErrStoreUnavailable):
		return ClaimStoreUnavailable
	default:
		return ClaimError
	}
}

// observeComplete reports a completion. Callers check s.cfg.Observer.
func (s *Store[TTx]) observeComplete(ctx context.Context, start time.Time, c *Claim, status Status, resp *Response, err error) {
	o := s.cfg.Observer
	if o.Complete == nil || c == nil {
		return
	}
	e := CompleteEvent{
		Dialect: s.dialect.Name(), Operation: s.operation(c.Scope), KeyDigest: digest.Key(c.Scope, c.Key),
		Status: status, Latency: time.Since(start),
	}
	if resp != nil {
		e.ResponseBytes = len(resp.Body)
	}
	switch {
	case err == nil:
		e.Outcome = CompleteStored
	case errors.Is(err, ErrFenced):
		e.Outcome = CompleteFenced
	case errors.Is(err, ErrStoreUnavailable):
		e.Outcome = CompleteStoreUnavailable
	default:
		e.Outcome = CompleteError
	}
	o.Complete(ctx, e)
}

// observeLease reports a lease event, if the store is observed.
func (s *Store[TTx]) observeLease(ctx context.Context, scope, key string, kind LeaseEventKind, attempt int) {
	if o := s.cfg.Observer; o != nil && o.Lease != nil {
		o.Lease(ctx, LeaseEvent{
			Dialect: s.dialect.Name(), Operation: s.operation(scope), KeyDigest: digest.Key(scope, key),
			Kind: kind, Attempt: attempt,
		})
	}
}

// observeRenewal reports the result of a lease renewal.
func (s *Store[TTx]) observeRenewal(ctx context.Context, c *Claim, err error) {
	if s.cfg.Observer == nil {
		return
	}
	kind := LeaseRenewed
	switch {
	case errors.Is(err, ErrFenced):
		kind = LeaseLost
	case err != nil:
		kind = LeaseRenewFailed
	}
	s.observeLease(ctx, c.Scope, c.Key, kind, c.Attempt)
}

// observeCheck reports a status check, if the store is observed.
func (s *Store[TTx]) observeCheck(ctx context.Context, start time.Time, rec *Record, v Verdict, err error) {
	if o := s.cfg.Observer; o != nil && o.StatusCheck != nil {
		o.StatusCheck(ctx, StatusCheckEvent{
			Dialect: s.dialect.Name(), Operation: s.operation(rec.Scope), KeyDigest: digest.Key(rec.Scope, rec.Key),
			Verdict: v.Kind, Failed: err != nil, Attempt: rec.Attempt, Latency: time.Since(start),
		})
	}
}

// observeReap reports a reaper pass, if the store is observed.
func (s *Store[TTx]) observeReap(ctx context.Context, start time.Time, ev ReapEvent) {
	if o := s.cfg.Observer; o != nil && o.Reap != nil {
		ev.Dialect = s.dialect.Name()
		ev.StaleLeft = max(ev.StaleFound-ev.Report.Finalised-ev.Report.HandedOver, 0)
		ev.Latency = time.Since(start)
		o.Reap(ctx, ev)
	}
}
