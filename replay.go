package idem

import (
	"context"
	"errors"
	"sync/atomic"
	"time"
)

// ReplayRead says when [Store.Do] first reads the key on the pool, before it
// begins its transaction, so that a replay costs one primary-key read
// instead of a transaction with a claim in it (BEGIN, a claim statement
// that takes the key's lock, ROLLBACK).
//
// The read answers only a completed, live record of the same fingerprint.
// Anything else (no record, a processing one, one past its retention
// deadline, another fingerprint, an error, a record that fails validation)
// falls through to the transaction, which decides exactly as it would have
// without the read; a new key then pays for one extra primary-key read.
type ReplayRead int

// ReplayRead settings.
const (
	// ReplayReadAuto reads first while replays are at least half of the
	// store's recent Do answers (a moving average over about the last 16),
	// and goes straight to the transaction otherwise: a service whose
	// requests are mostly first attempts pays nothing, one that answers
	// many retries (a client retrying after timeouts, a queue
	// redelivering) gets replays at the speed of a read. The average is
	// per Store, over every scope.
	ReplayReadAuto ReplayRead = iota
	// ReplayReadAlways reads first on every Do.
	ReplayReadAlways
	// ReplayReadNever never reads first: every Do runs its transaction,
	// as before the read existed.
	ReplayReadNever
)

// ReplayReader is implemented, optionally, by an [Executor] that can read
// what a replay needs more cheaply than Get: the dialects of this module
// select only the six columns a replay answers from. [Store.Do]'s first
// read uses it on Dialect.DB when present, and Executor.Get otherwise.
type ReplayReader interface {
	// GetCompleted returns the record for (Scope, Key) with a non-locking
	// read, only when it is completed (StatusSucceeded or StatusFailed)
	// and its ExpiresAt is after now; otherwise [ErrNotFound]. Only Scope,
	// Key, Fingerprint, Status, Response and ExpiresAt are filled in; the
	// rest is zero (an Executor of another module may leave ExpiresAt zero
	// too: the replay cache then does not keep what it read). A stored value that cannot be decoded is [ErrCorruptRecord],
	// as in Get.
	GetCompleted(ctx context.Context, p *GetParams) (*Record, error)
}

// replayGate holds ReplayReadAuto's moving average of replays among Do's
// answers, in units of 1/replayScale. Updates are a load and a store, not a
// compare-and-swap: a concurrent update may be lost, which only blurs an
// estimate that is a heuristic anyway.
type replayGate struct {
	rate atomic.Uint32
}

const (
	// replayScale is the fixed-point unit of replayGate.rate.
	replayScale = 1 << 16
	// replayWeightShift makes each answer weigh 1/16 of the average.
	replayWeightShift = 4
	// replayThreshold is the average from which Do reads first: from
	// there the saved transactions outweigh the extra reads of new keys
	// on every dialect (a replay through the transaction costs 1.4 to 4.5
	// primary-key reads on the load tool's machine, so a read first pays
	// from a replay share between 0.22 and 0.7).
	replayThreshold = replayScale / 2
)

// replayAnswer is what one Do answered, for the moving average.
type replayAnswer int

const (
	// answerRan: Do ran its callback (or answered about the key without
	// replaying: a mismatch, in progress).
	answerRan replayAnswer = iota
	// answerReplayed: Do replayed a stored response.
	answerReplayed
)

// answerOf is the answer of a Do that returned res.
func answerOf(res *Result) replayAnswer {
	if res.Replayed {
		return answerReplayed
	}
	return answerRan
}

// note adds one answer of Do to the average.
func (g *replayGate) note(a replayAnswer) {
	old := g.rate.Load()
	next := old - old>>replayWeightShift
	if a == answerReplayed {
		next += replayScale >> replayWeightShift
	}
	g.rate.Store(next)
}

func (g *replayGate) open() bool { return g.rate.Load() >= replayThreshold }

// readFirst reports whether Do reads the key on the pool before its
// transaction.
func (s *Store[TTx]) readFirst() bool {
	switch s.cfg.ReplayRead {
	case ReplayReadAlways:
		return true
	case ReplayReadNever:
		return false
	default:
		return s.replays.open()
	}
}

// noteDo feeds the outcome of a Do that ran its transaction to the
// moving average. Errors other than a mismatch or an in-progress answer say
// nothing about the traffic (the store failing) and are left out.
func (s *Store[TTx]) noteDo(res *Result, err error) {
	if s.cfg.ReplayRead != ReplayReadAuto {
		return
	}
	switch {
	case err == nil:
		s.replays.note(answerOf(res))
	case isTrafficAnswer(err):
		s.replays.note(answerRan)
	}
}

// isTrafficAnswer reports whether err is an answer about the key (another
// request's key, or one in progress) rather than a failure of the store.
func isTrafficAnswer(err error) bool {
	return errors.Is(err, ErrFingerprint) || errors.Is(err, ErrInProgress)
}

// replayFirst answers Do from one read on the pool when the key holds a
// completed, live record of fp, and returns nil otherwise (the caller then
// runs Do's transaction, which decides as if this read had not happened).
//
// It is correct for the reason replayFast is: a completed record does not
// change until its retention deadline, which the read checks with the
// database's clock (or the pinned Now), so at the moment of the read the
// transaction's claim would have found the same record and replayed it.
// A record that fails validation falls through too, so that the
// transaction reports (and logs, once) ErrCorruptRecord as it always has;
// body references are decoded by the same checkRecord.
func (s *Store[TTx]) replayFirst(ctx context.Context, scope, key string, fp Fingerprint) *Result {
	if !s.readFirst() {
		return nil
	}
	var start time.Time
	if s.cfg.Observer != nil {
		start = time.Now()
	}
	// The read's parameters and the answer in one allocation: both escape
	// (the parameters through the Executor interface), and a replay is
	// meant to cost what a plain read does.
	both := &struct {
		res Result
		p   GetParams
	}{p: GetParams{Scope: scope, Key: key, Now: s.now()}}
	rec, err := s.readCompleted(ctx, &both.p)
	// No digest for checkRecord: a failure is not reported from here.
	if err != nil || !rec.Status.Final() || !rec.Fingerprint.Equal(fp) || checkRecord(rec, "") != nil {
		return nil
	}
	s.logKey(ctx, scope, key, "replay")
	if s.cfg.Observer != nil {
		s.observeClaim(ctx, start, scope, key, &Claim{Scope: scope, Key: key, Token: rec.Token, Attempt: rec.Attempt, Replay: rec}, nil)
	}
	s.replays.note(answerReplayed)
	both.res = Result{Response: rec.Response, Replayed: true, Status: rec.Status, replayed: rec}
	return &both.res
}

// replayCached answers Do from the replay cache when it holds a live
// response of (scope, key) for fp, and returns nil otherwise.
func (s *Store[TTx]) replayCached(ctx context.Context, scope, key string, fp Fingerprint, now time.Time) *Result {
	rec := s.cache.get(scope, key, fp, now)
	if rec == nil {
		return nil
	}
	s.logKey(ctx, scope, key, "replay")
	if s.cfg.Observer != nil {
		s.observeClaim(ctx, now, scope, key, &Claim{Scope: scope, Key: key, Token: rec.Token, Attempt: rec.Attempt, Replay: rec}, nil)
	}
	s.replays.note(answerReplayed)
	return &Result{Response: rec.Response, Replayed: true, Status: rec.Status}
}

// cacheAnswer fills the replay cache from a Do that answered res. A
// completion is cached for MaxAge from began, which is before the record's
// completion time, so the entry ends before the record's retention
// deadline. A replay is cached only when its read returned the record's
// deadline, and never beyond it.
//
// That deadline is on the database's clock and began on this process's,
// unless Config.Now pins both. A record read with less than two MaxAge
// left is then not cached: every entry ends at least MaxAge before its
// record's deadline, which keeps it inside the retention while the
// database's clock runs less than MaxAge ahead of the process's. Taking
// the smaller of the two deadlines instead would let an entry outlive its
// record by the clocks' difference.
func (s *Store[TTx]) cacheAnswer(scope, key string, fp Fingerprint, res *Result, gen uint64, began time.Time) {
	if s.cache == nil || res == nil {
		return
	}
	maxAge := s.cache.cfg.MaxAge
	deadline := began.Add(maxAge)
	rec := res.replayed
	if res.Replayed {
		if rec == nil || rec.ExpiresAt.IsZero() {
			return
		}
		if s.cfg.Now == nil && rec.ExpiresAt.Sub(began) < 2*maxAge {
			return
		}
		deadline = minTime(deadline, rec.ExpiresAt)
	} else {
		rec = &Record{Scope: scope, Key: key, Fingerprint: fp, Status: res.Status, Response: res.Response}
	}
	s.cache.put(rec, gen, deadline, s.cacheNow())
}

// cacheNow is the replay cache's clock: Config.Now when it is pinned, as
// the records' deadlines are then on that clock too (a test that moves it
// past a record's retention must not get the record's replay from the
// cache), the process's clock otherwise.
func (s *Store[TTx]) cacheNow() time.Time {
	if s.cfg.Now != nil {
		return s.cfg.Now()
	}
	return time.Now()
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// readCompleted is the read of replayFirst: GetCompleted when the pool's
// Executor has it, Get otherwise.
func (s *Store[TTx]) readCompleted(ctx context.Context, p *GetParams) (*Record, error) {
	exec := s.dialect.DB()
	if rr, ok := exec.(ReplayReader); ok {
		return rr.GetCompleted(ctx, p)
	}
	return exec.Get(ctx, p)
}
