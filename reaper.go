package idem

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/idemstore/idem/internal/digest"
)

// ReaperConfig configures a [Reaper]. A nil *ReaperConfig, and every zero
// field, means the default.
type ReaperConfig struct {
	// Interval is the time between two passes of [Reaper.Run]. Defaults to 1m.
	Interval time.Duration
	// Jitter is the upper bound of a random delay added to each Interval, so
	// reapers of several instances drift apart. Defaults to Interval/10;
	// a negative value disables it.
	Jitter time.Duration
	// BatchSize is the most expired records one DELETE statement removes,
	// which bounds how long it holds its locks. Defaults to 1000.
	BatchSize int
	// MaxBatches is the most DELETE statements one pass runs; the rest waits
	// for the next pass. Defaults to 100.
	MaxBatches int
	// BatchPause is a pause between two DELETE statements of one pass. A
	// large backlog deleted back to back keeps a database core busy, which
	// on a small server shows in the claims' tail latency; a pause gives
	// that core back to the claims, at the price of a slower cleanup (what
	// it bought on a 2-core machine is in docs/performance.md). Defaults
	// to 0: no pause.
	BatchPause time.Duration
	// StaleLimit is the most stale leases one pass resolves. Defaults to 100.
	StaleLimit int
	// OnReport, if set, receives the report of every pass of [Reaper.Run].
	// It is called from the reaper's goroutine and must not block for long.
	// Defaults to nil; passes are logged through Config.Logger either way.
	OnReport func(ReapReport)
	// BodyGrace is the grace period of the reaper's sweep of the store's
	// BodyStore ([Store.SweepBodies]), made at most once per BodySweepEvery:
	// objects no record names, written longer ago than this, are deleted.
	// Defaults to 1h.
	BodyGrace time.Duration
	// BodySweepEvery is the least time between two sweeps of the
	// BodyStore, each of which lists every object and looks up, through
	// the digest index, the record of each one older than BodyGrace.
	// Defaults to 1h.
	BodySweepEvery time.Duration
}

const (
	defaultReapInterval   = time.Minute
	defaultReapBatchSize  = 1000
	defaultReapMaxBatches = 100
	defaultReapStaleLimit = 100
)

// ReapReport counts what one pass of a [Reaper] did.
type ReapReport struct {
	// Deleted counts records removed after their retention deadline.
	Deleted int
	// Finalised counts stale records the status check found committed;
	// their recovered response is now replayed.
	Finalised int
	// HandedOver counts stale records found not committed, or taken blindly
	// with Config.BlindTakeover: deleted, so the next retry acquires.
	HandedOver int
	// Unknown counts stale records the check could not decide (including
	// check errors and panics); they stay processing with a longer lease.
	Unknown int
	// Unresolved counts stale records left alone because no StatusCheck is
	// configured and BlindTakeover is off.
	Unresolved int
	// Errors counts failed statements. The pass goes on after an error.
	Errors int
	// BodiesDeleted counts objects the pass's sweep of the BodyStore deleted.
	BodiesDeleted int
}

// Reaper deletes records past their retention deadline, in batches, and
// resolves processing records whose lease ran out through
// Config.StatusCheck. Run it in every instance or in one: reapers on one
// database coordinate through fencing tokens, so each stale record is
// checked by one reaper at a time, and DELETE batches skip rows other
// transactions hold where the dialect can (PostgreSQL, MySQL).
//
// A Reaper is safe for concurrent use, though one Run per process is enough.
type Reaper[TTx any] struct {
	store *Store[TTx]
	cfg   ReaperConfig
	sweep bodySweep
}

// NewReaper returns a Reaper over store. It starts nothing: call
// [Reaper.Run] in a goroutine, or [Reaper.RunOnce] from a cron job.
func NewReaper[TTx any](store *Store[TTx], cfg *ReaperConfig) (*Reaper[TTx], error) {
	if store == nil {
		return nil, errors.New("idem: NewReaper needs a store")
	}
	var c ReaperConfig
	if cfg != nil {
		c = *cfg
	}
	if c.Interval < 0 || c.BatchSize < 0 || c.MaxBatches < 0 || c.StaleLimit < 0 || c.BatchPause < 0 {
		return nil, errors.New("idem: ReaperConfig fields must not be negative (except Jitter)")
	}
	if c.Interval == 0 {
		c.Interval = defaultReapInterval
	}
	if c.Jitter == 0 {
		c.Jitter = c.Interval / 10
	}
	if c.BatchSize == 0 {
		c.BatchSize = defaultReapBatchSize
	}
	if c.MaxBatches == 0 {
		c.MaxBatches = defaultReapMaxBatches
	}
	if c.StaleLimit == 0 {
		c.StaleLimit = defaultReapStaleLimit
	}
	if err := c.bodyDefaults(); err != nil {
		return nil, err
	}
	return &Reaper[TTx]{store: store, cfg: c}, nil
}

// Run makes a pass at once and then every Interval (plus jitter) until ctx
// ends, then returns nil. It holds no goroutine of its own: when Run returns,
// the reaper has stopped. Errors of a pass are logged and counted in its
// report; they never stop the loop.
func (r *Reaper[TTx]) Run(ctx context.Context) error {
	for {
		report, err := r.RunOnce(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			r.store.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: reaper pass failed", r.errorAttrs(err)...)
		}
		if r.cfg.OnReport != nil {
			r.cfg.OnReport(report)
		}
		if err := sleepCtx(ctx, r.nextDelay()); err != nil {
			return nil
		}
	}
}

// errorAttrs describes a pass's error for a log record: its step, the key's
// digest, class and driver code, never the driver's text.
func (r *Reaper[TTx]) errorAttrs(err error) []slog.Attr {
	if re, ok := errors.AsType[*reapError](err); ok {
		return re.logAttrs(r.store)
	}
	return r.store.storeErrorAttrs(err)
}

func (r *Reaper[TTx]) nextDelay() time.Duration {
	if r.cfg.Jitter <= 0 {
		return r.cfg.Interval
	}
	return r.cfg.Interval + rand.N(r.cfg.Jitter) //nolint:gosec // not security-sensitive: jitter only spreads reapers apart
}

// RunOnce makes one pass: it deletes expired records, up to MaxBatches
// batches of BatchSize, then resolves up to StaleLimit stale leases, then
// sweeps the BodyStore when its turn has come. It returns what it did and
// the first error it met (the pass goes on after errors, and counts them).
func (r *Reaper[TTx]) RunOnce(ctx context.Context) (ReapReport, error) {
	var pass reapPass
	exec := r.store.dialect.DB()
	start := r.store.observeStart()
	batches, behind, err := r.deleteExpired(ctx, exec, &pass)
	if err != nil {
		return pass.rep, err
	}
	if ctx.Err() != nil {
		return pass.rep, ctx.Err()
	}
	staleFound := r.resolveStaleLeases(ctx, exec, &pass)
	if ctx.Err() == nil {
		n, err := r.sweepBodies(ctx)
		pass.rep.BodiesDeleted = n
		if err != nil {
			pass.fail(&reapError{step: "sweep bodies", err: err})
		}
	}
	r.logPass(ctx, pass.rep)
	r.store.observeReap(ctx, start, ReapEvent{Report: pass.rep, Batches: batches, Behind: behind, StaleFound: staleFound})
	return pass.rep, pass.firstErr
}

// reapPass is what one pass has done so far.
type reapPass struct {
	rep      ReapReport
	firstErr error
}

// fail counts err and keeps it if it is the pass's first.
func (p *reapPass) fail(err error) {
	p.rep.Errors++
	if p.firstErr == nil {
		p.firstErr = err
	}
}

// deleteExpired runs the pass's DELETE batches until one comes back short
// or MaxBatches ran; behind reports that the last one was still full (a
// backlog is left for the next pass). err is set only when ctx ended during
// a BatchPause; a failed batch is counted in pass and ends the deletion.
func (r *Reaper[TTx]) deleteExpired(ctx context.Context, exec Executor, pass *reapPass) (batches int, behind bool, err error) {
	for batch := range r.cfg.MaxBatches {
		if batch > 0 && r.cfg.BatchPause > 0 {
			if err := sleepCtx(ctx, r.cfg.BatchPause); err != nil {
				return batches, behind, err
			}
		}
		n, err := exec.DeleteExpired(ctx, &DeleteExpiredParams{Limit: r.cfg.BatchSize, Now: r.store.now()})
		pass.rep.Deleted += n
		batches++
		if err != nil {
			pass.fail(&reapError{step: "delete expired", err: err})
			return batches, behind, nil
		}
		if n < r.cfg.BatchSize {
			return batches, behind, nil
		}
		behind = batch == r.cfg.MaxBatches-1
	}
	return batches, behind, nil
}

// resolveStaleLeases lists up to StaleLimit stale leases and resolves each,
// counting the outcomes in pass; it returns how many it found.
func (r *Reaper[TTx]) resolveStaleLeases(ctx context.Context, exec Executor, pass *reapPass) int {
	stale, now, err := exec.ListStaleLeases(ctx, &ListStaleLeasesParams{Limit: r.cfg.StaleLimit, Now: r.store.now()})
	if err != nil {
		pass.fail(&reapError{step: "list stale leases", err: err})
	}
	for _, rec := range stale {
		if ctx.Err() != nil {
			break
		}
		outcome, err := r.resolve(ctx, exec, rec, now)
		if err != nil {
			pass.fail(&reapError{step: "resolve", keyDigest: digest.Key(rec.Scope, rec.Key), err: err})
			continue
		}
		pass.rep.count(outcome)
	}
	return len(stale)
}

// count adds a resolution's outcome to the report. An empty outcome (another
// reaper or a claimer took the record first: theirs now) counts nowhere.
func (rep *ReapReport) count(outcome string) {
	switch outcome {
	case resolvedCommitted:
		rep.Finalised++
	case resolvedNotCommitted:
		rep.HandedOver++
	case resolvedUnknown:
		rep.Unknown++
	case resolvedSkipped:
		rep.Unresolved++
	}
}

// logPass logs the pass's counts at debug level.
func (r *Reaper[TTx]) logPass(ctx context.Context, rep ReapReport) {
	r.store.cfg.Logger.LogAttrs(ctx, slog.LevelDebug, "idem: reaper pass",
		slog.String("dialect", r.store.dialect.Name()),
		slog.Int("deleted", rep.Deleted), slog.Int("finalised", rep.Finalised),
		slog.Int("handed_over", rep.HandedOver), slog.Int("unknown", rep.Unknown),
		slog.Int("unresolved", rep.Unresolved), slog.Int("bodies_deleted", rep.BodiesDeleted), slog.Int("errors", rep.Errors))
}

// resolve settles one stale record: through the status check, blindly, or
// not at all. Handing over deletes the record, so the next retry acquires.
// It returns an empty outcome and no error when another reaper or a claimer
// got to the record first; a verdict fenced after this reaper reserved the
// record is an error.
func (r *Reaper[TTx]) resolve(ctx context.Context, exec Executor, rec *Record, now time.Time) (string, error) {
	s := r.store
	takenElsewhere := func(err error) bool { return errors.Is(err, ErrFenced) || errors.Is(err, ErrInProgress) }
	switch {
	case s.cfg.StatusCheck != nil:
		tok, err := s.reserveStale(ctx, exec, rec)
		if takenElsewhere(err) {
			return "", nil
		}
		if err != nil {
			return "", err
		}
		outcome, _, err := s.resolveStale(ctx, exec, rec, now, tok, func() error {
			return exec.Release(ctx, &ReleaseParams{Scope: rec.Scope, Key: rec.Key, Token: tok})
		})
		return outcome, err
	case s.cfg.BlindTakeover:
		// Only while the lease is still out: a holder that renewed keeps its key.
		err := exec.Release(ctx, &ReleaseParams{Scope: rec.Scope, Key: rec.Key, Token: rec.Token, OnlyIfLeaseExpired: true, Now: s.now()})
		if takenElsewhere(err) {
			return "", nil
		}
		if err != nil {
			return "", err
		}
		s.logResolution(ctx, digest.Key(rec.Scope, rec.Key), "handed_over_blind", rec.Attempt)
		return resolvedNotCommitted, nil
	default:
		return resolvedSkipped, nil
	}
}
