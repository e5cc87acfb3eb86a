package idem

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemstore/idem/internal/digest"
)

// Claim is the result of claiming a key: either the caller now owns the key
// (Acquired) and must run the business effect and complete the claim, or the
// key was already completed and Replay holds the stored record.
type Claim struct {
	// Scope and Key name the record.
	Scope string
	Key   string
	// Token is the fencing token of this holder; completion is accepted
	// only while the record still carries it.
	Token int64
	// Attempt counts holders of this key.
	Attempt int
	// LeaseExpiresAt is when other claimers may presume this holder gone;
	// for a takeover it is estimated (early) from the database clock.
	LeaseExpiresAt time.Time
	// Replay is the completed record when the key was used before with the
	// same fingerprint. The caller must answer with Replay.Response and must
	// not run the business effect again.
	Replay *Record

	// deferred is set by deferred claims ([DeferredClaimer]): no record
	// exists yet, and the completion inserts it with fingerprint and
	// createdAt.
	deferred bool
	// optimistic marks a deferred claim of an [OptimisticClaimer]: no lock
	// holds the key either, and only Do's own completion may follow.
	optimistic  bool
	fingerprint Fingerprint
	createdAt   time.Time
}

// Acquired reports whether the caller owns the key and must run the
// business effect.
func (c *Claim) Acquired() bool { return c != nil && c.Replay == nil }

// Claim claims key in scope for the request identified by fp on the pool,
// committing the processing record at once: it is visible to every other
// claimer before Claim returns. Use it when the business effect is not in the
// same database; otherwise prefer [Store.ClaimTx] or [Store.Do], which commit
// the claim with the business rows.
//
// Outcomes:
//   - the key is new, or past its retention deadline: the caller acquires it;
//   - the key was completed with the same fingerprint: a Claim with Replay set;
//   - the key was used with another fingerprint: [ErrFingerprint];
//   - another holder owns it: [ErrInProgress] (as *[InProgressError]).
//
// It returns [ErrInvalidKey] or [ErrInvalidScope] for bad input (nothing is
// written) and [ErrStoreUnavailable] when the database cannot be reached. A
// deadlock is retried up to Config.MaxTxRetries times before [ErrRetryable]
// is returned.
func (s *Store[TTx]) Claim(ctx context.Context, scope, key string, fp Fingerprint) (c *Claim, err error) {
	if s.cfg.Observer != nil {
		start := time.Now()
		defer func() { s.observeClaim(ctx, start, scope, key, c, err) }()
	}
	if err := validate(scope, key); err != nil {
		return nil, err
	}
	if c, done, err := s.replayFast(ctx, scope, key, fp); done {
		return c, err
	}
	// On the pool each statement commits on its own, so a deadlock victim
	// (possible on MySQL when claimers of one key pile up) lost nothing but
	// that statement: trying again is safe, unlike inside a caller's tx.
	for try := 0; ; try++ {
		c, err := s.claim(ctx, &claimer{exec: s.dialect.DB(), site: onPool}, scope, key, fp)
		if err == nil || !errors.Is(err, ErrRetryable) || try >= s.cfg.MaxTxRetries || ctx.Err() != nil {
			return c, err
		}
		if err := sleepCtx(ctx, backoff(try)); err != nil {
			return nil, err
		}
	}
}

// replayFast answers a pool-level claim of a completed key with one plain
// read by primary key on the pool: no transaction, no lock, no write. It is
// correct because a completed record never changes until its retention
// deadline, which the read checks with the database's clock (Executor.Get
// returns only live records): the replay or mismatch it reports is exactly
// what the claim would have decided at the moment of the read. done is false
// when the key is absent, processing or past retention; the caller then
// claims as usual (a new key pays this one extra primary-key read).
//
// Only the pool path uses it. Inside a caller's transaction the claim must
// take the dialect's locks (MySQL's shared lock keeps a completed record
// from being taken over until the transaction ends), and Do, which claims in
// its own transaction, would pay the extra read on every new key for no
// saving on its replays' round trips (on PostgreSQL the claim travels with
// BEGIN).
func (s *Store[TTx]) replayFast(ctx context.Context, scope, key string, fp Fingerprint) (_ *Claim, done bool, _ error) {
	rec, err := s.dialect.DB().Get(ctx, &GetParams{Scope: scope, Key: key, Now: s.now()})
	switch {
	case errors.Is(err, ErrNotFound):
		return nil, false, nil
	case err != nil:
		kd := digest.Key(scope, key)
		return nil, true, fmt.Errorf("idem: claim key %s: %w", kd, s.checkRead(ctx, nil, err, kd))
	case !rec.Status.Final():
		return nil, false, nil
	case !rec.Fingerprint.Equal(fp):
		kd := digest.Key(scope, key)
		s.logOutcome(ctx, kd, "fingerprint_mismatch")
		return nil, true, fmt.Errorf("%w (key %s)", ErrFingerprint, kd)
	}
	if err := s.checkRead(ctx, rec, nil, digest.Key(scope, key)); err != nil {
		return nil, true, fmt.Errorf("idem: claim key %s: %w", digest.Key(scope, key), err)
	}
	s.logKey(ctx, scope, key, "replay")
	return &Claim{Scope: scope, Key: key, Token: rec.Token, Attempt: rec.Attempt, Replay: rec}, true, nil
}

// ClaimTx claims key in scope inside the caller's transaction tx, with the
// outcomes and errors of [Store.Claim]. idem never commits or rolls back tx;
// the claim becomes visible, and durable, when the caller commits. Until then
// other claimers of the key wait (up to Config.WaitTimeout; on SQLite they
// wait to begin their transactions), and if tx rolls back the key is free
// again. On MySQL the claim holds a lock on the record until tx ends, even
// when it did not acquire: end tx promptly after a replay or an error.
//
// After an acquired ClaimTx, run the business writes on tx, then
// [Store.CompleteTx] on tx, then commit: the stored response and the business
// rows commit together, or neither does. Commit only after CompleteTx (or
// FailTx, or ReleaseTx) succeeded: on PostgreSQL and SQLite the claim
// writes no record (it is deferred, as in [Store.Do]: a lock on the key
// keeps other claimers out until tx ends, and CompleteTx inserts the
// finished record, one row version instead of two), so a commit without
// the completion leaves the key free, as a rollback would, while on MySQL
// it leaves the processing record in progress. A second ClaimTx of the
// same key in the same tx therefore acquires again on PostgreSQL and
// SQLite (it answers in progress on MySQL), and the second completion
// fails with [ErrFenced]; roll tx back then. Pass the errors of your own
// statements and of the commit through [Store.Classify] to learn whether
// running the whole transaction again may succeed ([ErrRetryable]; on
// MariaDB Galera a certification failure can end any statement or COMMIT).
//
// After any error, roll tx back unless the error is an *[InProgressError]
// with TxAborted false or [ErrFingerprint]; on PostgreSQL every database
// error aborts the transaction.
func (s *Store[TTx]) ClaimTx(ctx context.Context, tx TTx, scope, key string, fp Fingerprint) (c *Claim, err error) {
	if s.cfg.Observer != nil {
		start := time.Now()
		defer func() { s.observeClaim(ctx, start, scope, key, c, err) }()
	}
	return s.claim(ctx, s.txClaimer(tx, inCallerTx), scope, key, fp)
}

// txClaimer runs the claim statements of a claim in tx, at site: deferred
// on a [DeferredClaimer].
func (s *Store[TTx]) txClaimer(tx TTx, site claimSite) *claimer {
	cl := &claimer{exec: s.dialect.Tx(tx), site: site}
	if dc, ok := s.dialect.(DeferredClaimer[TTx]); ok {
		cl.deferred = func(ctx context.Context, p *ClaimParams) (*ClaimResult, error) {
			return dc.ClaimDeferred(ctx, tx, p)
		}
	}
	return cl
}

// maxClaimRounds bounds how often a claim starts over when the record it
// found changed under it (deleted by the reaper, taken over by a concurrent
// claimer). Each round is caused by another writer's progress.
const maxClaimRounds = 5

// claimSite is where a claim's statements run, which decides what a stale
// lease and a free key lead to.
type claimSite int

const (
	// onPool: each statement commits on its own, and a stale lease's status
	// check runs at once ([Store.Claim], [Store.Acquire]).
	onPool claimSite = iota
	// inCallerTx: a caller's transaction ([Store.ClaimTx]), where the check
	// must not run: a stale lease answers in progress.
	inCallerTx
	// inDoTx: the transaction [Store.Do] began for itself. The claim is
	// deferred on a [DeferredClaimer], since fn never sees the record, and
	// a stale lease returns errStaleLease, which Do settles on the pool.
	inDoTx
)

// claimer runs the claim statements of one claim where it takes place:
// Executor.Claim on exec or, in a transaction whose claims may defer, the
// dialect's deferred claim until the dialect answers ErrSkipDefer.
type claimer struct {
	exec Executor
	site claimSite
	// deferred is the dialect's ClaimDeferred bound to the claim's
	// transaction; nil when the claim writes its record.
	deferred func(ctx context.Context, p *ClaimParams) (*ClaimResult, error)
}

// claimStep is the answer of one claim statement.
type claimStep struct {
	res *ClaimResult
	err error
	// deferred marks a Created answer of a deferred claim: nothing was
	// written, and the completion must insert the record.
	deferred bool
}

// run runs the claim statement p.
func (cl *claimer) run(ctx context.Context, p *ClaimParams) claimStep {
	if cl.deferred == nil {
		res, err := cl.exec.Claim(ctx, p)
		return claimStep{res: res, err: err}
	}
	res, err := cl.deferred(ctx, p)
	return cl.deferredStep(ctx, p, res, err)
}

// deferredStep is the step a deferred claim statement p answered (res,
// err). When the dialect skipped the deferral, p runs as Executor.Claim,
// and so does every later claim statement of the transaction.
func (cl *claimer) deferredStep(ctx context.Context, p *ClaimParams, res *ClaimResult, err error) claimStep {
	if errors.Is(err, ErrSkipDefer) {
		cl.deferred = nil
		res, err = cl.exec.Claim(ctx, p)
		return claimStep{res: res, err: err}
	}
	return claimStep{res: res, err: err, deferred: err == nil && res.Created}
}

// claim runs the decision table on cl from a first claim statement.
func (s *Store[TTx]) claim(ctx context.Context, cl *claimer, scope, key string, fp Fingerprint) (*Claim, error) {
	if err := validate(scope, key); err != nil {
		return nil, err
	}
	p := s.claimParams(scope, key, fp)
	return s.settleClaim(ctx, cl, p, cl.run(ctx, p))
}

// claimParams are the parameters of one claim statement, with a new token.
func (s *Store[TTx]) claimParams(scope, key string, fp Fingerprint) *ClaimParams {
	return &ClaimParams{
		Scope:         scope,
		Key:           key,
		Fingerprint:   fp,
		Token:         newToken(),
		LeaseDuration: s.cfg.LeaseDuration,
		Retention:     s.cfg.Retention,
		WaitTimeout:   s.cfg.WaitTimeout,
		Now:           s.now(),
	}
}

// settleClaim decides what the claim statement p answered (step) means,
// and claims again on cl while the record it met changed under it. The
// first statement is the caller's, so that Do's pipelined BeginClaim goes
// through the same table.
func (s *Store[TTx]) settleClaim(ctx context.Context, cl *claimer, p *ClaimParams, step claimStep) (*Claim, error) {
	for round := 1; ; round++ {
		c, again, err := s.decideClaim(ctx, cl, p, step)
		if !again {
			return c, err
		}
		if round == maxClaimRounds {
			return nil, fmt.Errorf("idem: claim key %s: the record kept changing under concurrent writers: %w",
				digest.Key(p.Scope, p.Key), ErrRetryable)
		}
		p = s.claimParams(p.Scope, p.Key, p.Fingerprint)
		step = cl.run(ctx, p)
	}
}

// decideClaim is the claim decision table for one claim statement's
// answer. again asks for another round: the record vanished or was taken
// over before this claimer could act on it.
func (s *Store[TTx]) decideClaim(ctx context.Context, cl *claimer, p *ClaimParams, step claimStep) (_ *Claim, again bool, _ error) {
	res, err := step.res, step.err
	if errors.Is(err, ErrNotFound) {
		return nil, true, nil // the conflicting record vanished before we read it
	}
	if err != nil {
		kd := digest.Key(p.Scope, p.Key)
		if inProgress, ok := inProgressWithDigest(err, kd); ok {
			s.logOutcome(ctx, kd, "in_progress_uncommitted")
			return nil, false, inProgress
		}
		return nil, false, fmt.Errorf("idem: claim key %s: %w", kd, s.checkRead(ctx, nil, err, kd))
	}
	rec := res.Record
	switch {
	case res.Created:
		s.logKey(ctx, p.Scope, p.Key, "acquired")
		c := &Claim{Scope: p.Scope, Key: p.Key, Token: rec.Token, Attempt: rec.Attempt, LeaseExpiresAt: rec.LeaseExpiresAt}
		if step.deferred {
			c.deferred, c.fingerprint, c.createdAt = true, p.Fingerprint, rec.CreatedAt
		}
		return c, false, nil
	case !rec.ExpiresAt.After(res.Now):
		return s.takeoverExpired(ctx, cl.exec, p, rec, res.Now)
	case !rec.Fingerprint.Equal(p.Fingerprint):
		kd := digest.Key(p.Scope, p.Key)
		s.logOutcome(ctx, kd, "fingerprint_mismatch")
		return nil, false, fmt.Errorf("%w (key %s)", ErrFingerprint, kd)
	case rec.Status.Final():
		if err := s.checkRead(ctx, rec, nil, digest.Key(p.Scope, p.Key)); err != nil {
			return nil, false, fmt.Errorf("idem: claim key %s: %w", digest.Key(p.Scope, p.Key), err)
		}
		s.logKey(ctx, p.Scope, p.Key, "replay")
		return &Claim{Scope: p.Scope, Key: p.Key, Token: rec.Token, Attempt: rec.Attempt, Replay: rec}, false, nil
	case rec.LeaseExpiresAt.After(res.Now):
		kd := digest.Key(p.Scope, p.Key)
		s.logOutcome(ctx, kd, "in_progress")
		return nil, false, &InProgressError{KeyDigest: kd, RetryAfter: rec.LeaseExpiresAt.Sub(res.Now)}
	}
	kd := digest.Key(p.Scope, p.Key)
	c, err := s.claimStale(ctx, cl.exec, cl.site, rec, res.Now, kd)
	if errors.Is(err, ErrFenced) {
		return nil, true, nil // another claimer, a reaper or a renewal got to the record first
	}
	if inProgress, ok := inProgressWithDigest(err, kd); ok {
		return nil, false, inProgress
	}
	return c, false, err
}

// takeoverExpired claims a key whose record is past retention: the old
// intent is forgotten, and the takeover is fenced by the old token so that
// only one claimer wins.
func (s *Store[TTx]) takeoverExpired(ctx context.Context, exec Executor, p *ClaimParams, rec *Record, now time.Time) (_ *Claim, again bool, _ error) {
	newTok := max(p.Token, rec.Token+1)
	err := exec.Takeover(ctx, &TakeoverParams{
		Scope:         p.Scope,
		Key:           p.Key,
		Token:         rec.Token,
		NewToken:      newTok,
		Fingerprint:   p.Fingerprint,
		Attempt:       1,
		LeaseDuration: s.cfg.LeaseDuration,
		Retention:     s.cfg.Retention,
		Condition:     TakeoverRetentionExpired,
		WaitTimeout:   s.cfg.WaitTimeout,
		Now:           s.now(),
	})
	if errors.Is(err, ErrFenced) {
		return nil, true, nil // another claimer took it over, or the holder completed, first
	}
	kd := digest.Key(p.Scope, p.Key)
	if inProgress, ok := inProgressWithDigest(err, kd); ok {
		return nil, false, inProgress
	}
	if err != nil {
		return nil, false, fmt.Errorf("idem: claim expired key %s: %w", kd, err)
	}
	s.logOutcome(ctx, kd, "acquired_expired")
	return &Claim{Scope: p.Scope, Key: p.Key, Token: newTok, Attempt: 1, LeaseExpiresAt: now.Add(s.cfg.LeaseDuration)}, false, nil
}

// inProgressWithDigest returns a copy of the *InProgressError in err's
// chain with KeyDigest set to kd: Executors leave the digest empty, and the
// copy keeps the Executor's error itself unchanged.
func inProgressWithDigest(err error, kd string) (*InProgressError, bool) {
	inProgress, ok := errors.AsType[*InProgressError](err)
	if !ok {
		return nil, false
	}
	out := *inProgress
	out.KeyDigest = kd
	return &out, true
}
