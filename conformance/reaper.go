package conformance

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func reaperCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "ReaperResolvesStaleLeases", run: testReaperResolvesStaleLeases[TTx]},
		{name: "ReaperTwoReapersCheckOnce", run: testReaperTwoReapersCheckOnce[TTx]},
		{name: "ReaperDeletesInBatchesWhileClaimsRun", run: testReaperDeletesInBatchesWhileClaimsRun[TTx]},
		{name: "ReaperStopsOnCancel", run: testReaperStopsOnCancel[TTx]},
		{name: "ReaperPausesBetweenBatches", run: testReaperPausesBetweenBatches[TTx]},
	}
}

// testReaperResolvesStaleLeases: one pass finalises a charged record, hands
// over an uncharged one (deleted: the next retry acquires), keeps an
// undecided one, deletes an expired one and leaves live records alone.
func testReaperResolvesStaleLeases[TTx any](t *testing.T, h Harness[TTx]) {
	p := newProvider()
	undecided := newKey("undecided")
	check := func(ctx context.Context, rec idem.Record) (idem.Verdict, error) {
		if rec.Key == undecided {
			return idem.Unknown(), nil
		}
		return p.check(ctx, rec)
	}
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 30 * time.Second, Retention: time.Hour, Now: clk.Now, StatusCheck: check})
	reaper, err := idem.NewReaper(b.store, &idem.ReaperConfig{BatchSize: 10})
	require.NoError(t, err)

	charged, uncharged, live, old := newKey("charged"), newKey("uncharged"), newKey("live"), newKey("old")
	_, err = b.store.Acquire(ctx, "t1/pay", old, fp("x"))
	require.NoError(t, err)
	clk.advance(2 * time.Hour) // old is now past retention
	for _, k := range []string{charged, uncharged, undecided} {
		_, err := b.store.Acquire(ctx, "t1/pay", k, fp("x"))
		require.NoError(t, err)
	}
	p.charge(charged)
	clk.advance(time.Minute) // their leases ran out
	liveLease, err := b.store.Acquire(ctx, "t1/pay", live, fp("x"))
	require.NoError(t, err)

	rep, err := reaper.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, idem.ReapReport{Deleted: 1, Finalised: 1, HandedOver: 1, Unknown: 1}, rep)

	rec, err := b.store.Get(ctx, "t1/pay", charged)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
	requireSameResponse(t, chargedResponse(charged), rec.Response)

	_, err = b.store.Get(ctx, "t1/pay", uncharged)
	require.ErrorIs(t, err, idem.ErrNotFound)
	retry, err := b.store.Acquire(ctx, "t1/pay", uncharged, fp("x"))
	require.NoError(t, err)
	require.True(t, retry.Acquired())

	rec, err = b.store.Get(ctx, "t1/pay", undecided)
	require.NoError(t, err)
	require.Equal(t, idem.StatusProcessing, rec.Status)
	require.True(t, rec.LeaseExpiresAt.After(clk.Now()), "an undecided record's lease is pushed out")

	require.NoError(t, liveLease.Complete(ctx, chargedResponse(live)), "the reaper must not touch a live lease")

	// Nothing left to do on a second pass.
	rep, err = reaper.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, idem.ReapReport{}, rep)
}

// testReaperTwoReapersCheckOnce runs two reapers of two stores (two
// instances) on one database at the same moment: a stale record is checked
// exactly once.
func testReaperTwoReapersCheckOnce[TTx any](t *testing.T, h Harness[TTx]) {
	var calls atomic.Int32
	check := func(ctx context.Context, rec idem.Record) (idem.Verdict, error) {
		calls.Add(1)
		time.Sleep(150 * time.Millisecond)
		return idem.Committed(chargedResponse(rec.Key)), nil
	}
	clk := newClock()
	cfg := &idem.Config{LeaseDuration: 30 * time.Second, Now: clk.Now, StatusCheck: check}
	ctx, b := setup(t, h, cfg)
	other, err := idem.New(b.ns.Dialect, cfg)
	require.NoError(t, err)

	const stale = 5
	keys := make([]string, stale)
	for i := range keys {
		keys[i] = newKey("two-reapers")
		_, err := b.store.Acquire(ctx, "t1/pay", keys[i], fp("x"))
		require.NoError(t, err)
	}
	clk.advance(time.Minute)

	var (
		wg      sync.WaitGroup
		reports [2]idem.ReapReport
		errs    [2]error
	)
	for i, s := range []*idem.Store[TTx]{b.store, other} {
		r, err := idem.NewReaper(s, nil)
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			reports[i], errs[i] = r.RunOnce(ctx)
		}()
	}
	wg.Wait()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.Equal(t, int32(stale), calls.Load(), "each stale record must be checked exactly once")
	require.Equal(t, stale, reports[0].Finalised+reports[1].Finalised)
	for _, k := range keys {
		rec, err := b.store.Get(ctx, "t1/pay", k)
		require.NoError(t, err)
		require.Equal(t, idem.StatusSucceeded, rec.Status)
	}
}

// testReaperDeletesInBatchesWhileClaimsRun deletes 100 000 expired records
// in batches while new claims keep succeeding.
func testReaperDeletesInBatchesWhileClaimsRun[TTx any](t *testing.T, h Harness[TTx]) {
	const seeded = 100_000
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 10 * time.Second})
	require.NoError(t, b.ns.SeedExpired(ctx, seeded, time.Now().Add(-time.Hour)))
	require.Equal(t, seeded, b.records(ctx, t))

	reaper, err := idem.NewReaper(b.store, &idem.ReaperConfig{BatchSize: 1000, MaxBatches: 1000})
	require.NoError(t, err)

	var (
		claims     atomic.Int32
		slowest    atomic.Int64
		claimErr   error
		reaperDone = make(chan struct{})
		wg         sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-reaperDone:
				return
			default:
			}
			key := newKey("during-reap")
			start := time.Now()
			var calls counter
			res, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
			if err == nil && res.Replayed {
				err = errors.New("a fresh key replayed")
			}
			if err != nil {
				claimErr = err
				return
			}
			claims.Add(1)
			if d := int64(time.Since(start)); d > slowest.Load() {
				slowest.Store(d)
			}
		}
	}()
	rep, err := reaper.RunOnce(ctx)
	close(reaperDone)
	wg.Wait()
	require.NoError(t, err)
	require.NoError(t, claimErr, "a claim failed while the reaper ran")
	require.Equal(t, seeded, rep.Deleted)
	require.Positive(t, claims.Load(), "no claim completed while the reaper ran")
	require.Equal(t, int(claims.Load()), b.records(ctx, t), "the reaper deleted a live record")
	t.Logf("deleted %d rows; %d claims meanwhile, slowest %v", rep.Deleted, claims.Load(), time.Duration(slowest.Load()))
}

// testReaperStopsOnCancel: Run returns promptly when its context ends, and
// it keeps no goroutine: once Run has returned, the reaper has stopped.
func testReaperStopsOnCancel[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	var passes atomic.Int32
	reaper, err := idem.NewReaper(b.store, &idem.ReaperConfig{
		Interval: 20 * time.Millisecond,
		OnReport: func(idem.ReapReport) { passes.Add(1) },
	})
	require.NoError(t, err)

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- reaper.Run(runCtx) }()
	require.Eventually(t, func() bool { return passes.Load() >= 3 }, 10*time.Second, 5*time.Millisecond,
		"the reaper must keep making passes")
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(2 * time.Second):
		t.Fatal("Run did not return after its context was cancelled")
	}
	after := passes.Load()
	time.Sleep(100 * time.Millisecond)
	require.Equal(t, after, passes.Load(), "the reaper made a pass after Run returned")

	// A long interval is interrupted too.
	slow, err := idem.NewReaper(b.store, &idem.ReaperConfig{Interval: time.Hour})
	require.NoError(t, err)
	runCtx, cancel = context.WithCancel(ctx)
	go func() { done <- slow.Run(runCtx) }()
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	cancel()
	require.NoError(t, <-done)
	require.Less(t, time.Since(start), time.Second)
}

// testReaperPausesBetweenBatches: with BatchPause, a pass pauses between
// its DELETE statements (and still deletes everything), and a context that
// ends during a pause ends the pass.
func testReaperPausesBetweenBatches[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	require.NoError(t, b.ns.SeedExpired(ctx, 4, time.Now().Add(-time.Hour)))
	const pause = 150 * time.Millisecond
	reaper, err := idem.NewReaper(b.store, &idem.ReaperConfig{BatchSize: 2, BatchPause: pause})
	require.NoError(t, err)
	start := time.Now()
	rep, err := reaper.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 4, rep.Deleted)
	// Batches of 2 over 4 rows: three statements (the last finds none), two pauses.
	require.GreaterOrEqual(t, time.Since(start), 2*pause, "the pass must pause between batches")
	require.Zero(t, b.records(ctx, t))

	require.NoError(t, b.ns.SeedExpired(ctx, 4, time.Now().Add(-time.Hour)))
	long, err := idem.NewReaper(b.store, &idem.ReaperConfig{BatchSize: 2, BatchPause: time.Hour})
	require.NoError(t, err)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	start = time.Now()
	rep, err = long.RunOnce(cctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, 2, rep.Deleted, "one batch, then the pause the context ended")
	require.Less(t, time.Since(start), 5*time.Second)

	_, err = idem.NewReaper(b.store, &idem.ReaperConfig{BatchPause: -time.Second})
	require.Error(t, err, "a negative pause is refused")
}
