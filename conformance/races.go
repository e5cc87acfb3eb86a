package conformance

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// Cases that force one interleaving at a time: another holder acts between a
// claimer's read and its write. They came from a review that found the
// takeover could overwrite a record completed a moment earlier.
func raceCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "TakeoverMustNotOverwriteFreshCompletion", run: testTakeoverMustNotOverwriteFreshCompletion[TTx]},
		{name: "BlindTakeoverMustNotStealRenewedLease", run: testBlindTakeoverMustNotStealRenewedLease[TTx]},
		{name: "CheckReservationMustNotStealRenewedLease", run: testCheckReservationMustNotStealRenewedLease[TTx]},
		{name: "RenewedLeaseOutlivesRetention", run: testRenewedLeaseOutlivesRetention[TTx]},
		{name: "TakeoverWaitIsBounded", run: testTakeoverWaitIsBounded[TTx], applies: concurrentWriters},
		{name: "ReplayWhileAnotherTxReplays", run: testReplayWhileAnotherTxReplays[TTx], applies: concurrentWriters},
		{name: "CancelDuringWait", run: testCancelDuringWait[TTx], applies: concurrentWriters},
		{name: "DoInProgressLeavesNothingToRollBack", run: testDoInProgressLeavesNothingToRollBack[TTx], applies: concurrentWriters},
	}
}

// hookDialect runs a hook once, just before the wrapped executor's
// Takeover or RenewLease, to force an interleaving.
type hookDialect[TTx any] struct {
	idem.Dialect[TTx]
	once           sync.Once
	beforeTakeover func()
	beforeRenew    func(p *idem.RenewLeaseParams)
}

func (d *hookDialect[TTx]) DB() idem.Executor { return &hookExec[TTx]{Executor: d.Dialect.DB(), d: d} }
func (d *hookDialect[TTx]) Tx(tx TTx) idem.Executor {
	return &hookExec[TTx]{Executor: d.Dialect.Tx(tx), d: d}
}

type hookExec[TTx any] struct {
	idem.Executor
	d *hookDialect[TTx]
}

func (e *hookExec[TTx]) Takeover(ctx context.Context, p *idem.TakeoverParams) error {
	if e.d.beforeTakeover != nil {
		e.d.once.Do(e.d.beforeTakeover)
	}
	return e.Executor.Takeover(ctx, p)
}

func (e *hookExec[TTx]) RenewLease(ctx context.Context, p *idem.RenewLeaseParams) (time.Time, error) {
	if e.d.beforeRenew != nil {
		e.d.once.Do(func() { e.d.beforeRenew(p) })
	}
	return e.Executor.RenewLease(ctx, p)
}

// testTakeoverMustNotOverwriteFreshCompletion: a slow holder whose record
// passed its retention deadline completes between another claimer's read
// and its takeover. Completion keeps the token, so only the retention
// condition, re-checked by the takeover, saves the fresh result.
func testTakeoverMustNotOverwriteFreshCompletion[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	cfg := &idem.Config{LeaseDuration: time.Minute, Retention: time.Hour, Now: clk.Now}
	ctx, b := setup(t, h, cfg)
	key := newKey("zombie")

	holder, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	clk.advance(2 * time.Hour)

	hd := &hookDialect[TTx]{Dialect: b.ns.Dialect}
	hd.beforeTakeover = func() {
		require.NoError(t, b.store.Complete(ctx, holder, orderResponse("holder")))
	}
	other, err := idem.New[TTx](hd, cfg)
	require.NoError(t, err)

	c, err := other.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, c.Acquired(), "the takeover overwrote a record completed a moment earlier")
	requireSameResponse(t, orderResponse("holder"), c.Replay.Response)
	rec, err := b.store.Get(ctx, "t1/pay", key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
}

// testBlindTakeoverMustNotStealRenewedLease: the holder renews between a
// claimer's read of its expired lease and the blind takeover.
func testBlindTakeoverMustNotStealRenewedLease[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	cfg := &idem.Config{LeaseDuration: 30 * time.Second, Now: clk.Now, BlindTakeover: true}
	ctx, b := setup(t, h, cfg)
	key := newKey("renewed")
	holder, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	clk.advance(time.Minute)

	hd := &hookDialect[TTx]{Dialect: b.ns.Dialect}
	hd.beforeTakeover = func() { require.NoError(t, holder.Renew(ctx)) }
	other, err := idem.New[TTx](hd, cfg)
	require.NoError(t, err)

	_, err = other.Acquire(ctx, "t1/pay", key, fp("x"))
	require.ErrorIs(t, err, idem.ErrInProgress, "a blind takeover stole a lease renewed a moment earlier")
	require.NoError(t, holder.Complete(ctx, chargedResponse(key)))
}

// testCheckReservationMustNotStealRenewedLease: same, for the reservation
// that precedes a status check; the check must not even run.
func testCheckReservationMustNotStealRenewedLease[TTx any](t *testing.T, h Harness[TTx]) {
	p := newProvider()
	clk := newClock()
	cfg := &idem.Config{LeaseDuration: 30 * time.Second, Now: clk.Now, StatusCheck: p.check}
	ctx, b := setup(t, h, cfg)
	key := newKey("renewed-check")
	holder, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	clk.advance(time.Minute)

	hd := &hookDialect[TTx]{Dialect: b.ns.Dialect}
	hd.beforeRenew = func(*idem.RenewLeaseParams) { require.NoError(t, holder.Renew(ctx)) }
	other, err := idem.New[TTx](hd, cfg)
	require.NoError(t, err)

	_, err = other.Acquire(ctx, "t1/pay", key, fp("x"))
	require.ErrorIs(t, err, idem.ErrInProgress)
	require.Zero(t, p.checked(), "a renewed lease must not be checked")
	require.NoError(t, holder.Complete(ctx, chargedResponse(key)))
}

// testRenewedLeaseOutlivesRetention: a lease kept alive past the record's
// retention deadline keeps the key: no claim takes it as expired and the
// reaper does not delete it.
func testRenewedLeaseOutlivesRetention[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 30 * time.Minute, Retention: time.Hour, Now: clk.Now})
	key := newKey("long-job")
	l, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	for range 4 { // two hours of work, renewed every half hour
		clk.advance(25 * time.Minute)
		require.NoError(t, l.Renew(ctx))
	}
	rec, err := b.store.Get(ctx, "t1/pay", key)
	require.NoError(t, err)
	require.False(t, rec.ExpiresAt.Before(rec.LeaseExpiresAt), "retention must cover a live lease")

	_, err = b.store.Acquire(ctx, "t1/pay", key, fp("y"))
	require.ErrorIs(t, err, idem.ErrFingerprint, "the key must still be bound")
	reaper, err := idem.NewReaper(b.store, nil)
	require.NoError(t, err)
	rep, err := reaper.RunOnce(ctx)
	require.NoError(t, err)
	require.Zero(t, rep.Deleted)
	require.NoError(t, l.Complete(ctx, chargedResponse(key)))
}

// testTakeoverWaitIsBounded: between a claimer's read of an expired record
// and its takeover, another transaction takes the record over and stays
// open. The takeover's wait is bounded by WaitTimeout like the claim's.
func testTakeoverWaitIsBounded[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	const wait = time.Second
	cfg := &idem.Config{LeaseDuration: time.Minute, Retention: time.Hour, WaitTimeout: wait, Now: clk.Now}
	ctx, b := setup(t, h, cfg)
	key := newKey("expired")
	c0, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.store.Complete(ctx, c0, orderResponse("old")))
	clk.advance(2 * time.Hour)

	hd := &hookDialect[TTx]{Dialect: b.ns.Dialect}
	hd.beforeTakeover = func() {
		tx := b.begin(ctx, t)
		c, err := b.store.ClaimTx(ctx, tx, "t1/pay", key, fp("y"))
		require.NoError(t, err)
		require.True(t, c.Acquired())
		time.AfterFunc(6*time.Second, func() { _ = b.ns.Dialect.Rollback(context.WithoutCancel(ctx), tx) })
	}
	other, err := idem.New[TTx](hd, cfg)
	require.NoError(t, err)

	start := time.Now()
	_, err = other.Claim(ctx, "t1/pay", key, fp("z"))
	elapsed := time.Since(start)
	require.ErrorIs(t, err, idem.ErrInProgress)
	require.GreaterOrEqual(t, elapsed, wait-50*time.Millisecond)
	require.Less(t, elapsed, wait+b.feat.WaitGranularity+2*time.Second, "the takeover waited far longer than WaitTimeout")
}

// testReplayWhileAnotherTxReplays: a completed key replayed inside a
// transaction that stays open does not keep other retries from replaying.
func testReplayWhileAnotherTxReplays[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: time.Second})
	key := newKey("replaylock")
	c, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.store.Complete(ctx, c, orderResponse(key)))

	tx := b.begin(ctx, t)
	r1, err := b.store.ClaimTx(ctx, tx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, r1.Acquired())

	start := time.Now()
	r2, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err, "a completed key must replay, not report in progress")
	require.False(t, r2.Acquired())
	require.Less(t, time.Since(start), 500*time.Millisecond, "replays must not queue behind each other")

	tx2 := b.begin(ctx, t)
	r3, err := b.store.ClaimTx(ctx, tx2, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, r3.Acquired())
}

// testCancelDuringWait: cancelling the caller's context while its claim
// waits for an uncommitted holder is a cancellation, not an outage.
func testCancelDuringWait[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 5 * time.Second})
	key := newKey("cancelwait")
	holder := b.begin(ctx, t)
	_, err := b.store.ClaimTx(ctx, holder, "t1/pay", key, fp("x"))
	require.NoError(t, err)

	cctx, cancel := context.WithCancel(ctx)
	time.AfterFunc(300*time.Millisecond, cancel)
	start := time.Now()
	_, err = b.store.Claim(cctx, "t1/pay", key, fp("x"))
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, idem.ErrStoreUnavailable, "a caller's cancellation is not an outage")
	require.Less(t, time.Since(start), 3*time.Second)

	require.NoError(t, b.ns.Dialect.Rollback(ctx, holder))
	c, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, c.Acquired(), "the cancelled claim must have left nothing behind")
}

// testDoInProgressLeavesNothingToRollBack: Do owns its transaction and has
// rolled it back, so its in-progress error never asks the caller to.
func testDoInProgressLeavesNothingToRollBack[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 500 * time.Millisecond})
	key := newKey("doaborted")
	holder := b.begin(ctx, t)
	_, err := b.store.ClaimTx(ctx, holder, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	var calls counter
	_, err = b.store.Do(ctx, "t1/pay", key, fp("x"), orderFn(b.ns, key, &calls))
	var ip *idem.InProgressError
	require.ErrorAs(t, err, &ip)
	require.False(t, ip.TxAborted)
	require.Equal(t, entriesWhileHeld(h.Features()), calls.get())
	require.Zero(t, b.orders(ctx, t, key), "the in-progress Do committed its callback's writes")
}

// staleCases cover a stale lease met inside a caller's transaction, where
// the status check must not run (its verdict would roll back with the
// transaction), and Do, which settles it on the pool instead.
func staleCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "ClaimTxLeavesStaleLeaseToThePool", run: testClaimTxLeavesStaleLeaseToThePool[TTx]},
		{name: "DoKeepsRecoveredResponse", run: testDoKeepsRecoveredResponse[TTx]},
		{name: "DoRunsHandedOverKeyOnce", run: testDoRunsHandedOverKeyOnce[TTx]},
		{name: "DoUnknownKeepsLeasePushedOut", run: testDoUnknownKeepsLeasePushedOut[TTx]},
		{name: "ReaperReportsFencedVerdict", run: testReaperReportsFencedVerdict[TTx]},
	}
}

func testClaimTxLeavesStaleLeaseToThePool[TTx any](t *testing.T, h Harness[TTx]) {
	p := newProvider()
	ctx, b, clk := leaseSetup(t, h, p.check)
	key := newKey("claimtx-stale")
	_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	p.charge(key)
	clk.advance(31 * time.Second)

	tx := b.begin(ctx, t)
	_, err = b.store.ClaimTx(ctx, tx, "t1/pay", key, fp("x"))
	var ip *idem.InProgressError
	require.ErrorAs(t, err, &ip)
	require.Positive(t, ip.RetryAfter)
	require.Zero(t, p.checked(), "the status check must not run inside a caller's transaction")
	require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))

	// A pool-level claim settles it.
	c, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, c.Acquired())
	requireSameResponse(t, chargedResponse(key), c.Replay.Response)
}

// testDoKeepsRecoveredResponse: a leased holder crashed after charging; the
// retry comes through Do. The check says committed, Do replays the recovered
// response, and the finalisation sticks.
func testDoKeepsRecoveredResponse[TTx any](t *testing.T, h Harness[TTx]) {
	p := newProvider()
	ctx, b, clk := leaseSetup(t, h, p.check)
	key := newKey("do-recover")
	_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	p.charge(key) // ... and dies
	clk.advance(31 * time.Second)

	var calls counter
	res, err := b.store.Do(ctx, "t1/pay", key, fp("x"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.True(t, res.Replayed)
	requireSameResponse(t, chargedResponse(key), res.Response)
	require.Zero(t, calls.get())
	require.Equal(t, 1, p.checked())

	rec, err := b.store.Get(ctx, "t1/pay", key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status, "Do replayed a recovered response but did not keep it")
	again, err := b.store.Do(ctx, "t1/pay", key, fp("x"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.True(t, again.Replayed)
	require.Equal(t, 1, p.checked(), "a kept recovery needs no second check")
}

// testDoRunsHandedOverKeyOnce: the crashed holder never charged; Do takes
// the key over as attempt 2, runs once, and a callback failure frees it.
func testDoRunsHandedOverKeyOnce[TTx any](t *testing.T, h Harness[TTx]) {
	p := newProvider()
	ctx, b, clk := leaseSetup(t, h, p.check)
	key := newKey("do-handover")
	dead, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	clk.advance(31 * time.Second)

	boom := errors.New("declined")
	_, err = b.store.Do(ctx, "t1/pay", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		if err := b.ns.InsertOrder(ctx, tx, key); err != nil {
			return nil, err
		}
		return nil, boom
	})
	require.ErrorIs(t, err, boom)
	require.Zero(t, b.orders(ctx, t, key))
	_, err = b.store.Get(ctx, "t1/pay", key)
	require.ErrorIs(t, err, idem.ErrNotFound, "a failed callback must free the handed-over key")

	var calls counter
	res, err := b.store.Do(ctx, "t1/pay", key, fp("x"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.False(t, res.Replayed)
	require.Equal(t, 1, calls.get())
	require.Equal(t, 1, b.orders(ctx, t, key))
	require.ErrorIs(t, dead.Complete(ctx, chargedResponse("zombie")), idem.ErrFenced)

	// Handed over and completed in one Do.
	k2 := newKey("do-handover-ok")
	_, err = b.store.Acquire(ctx, "t1/pay", k2, fp("x"))
	require.NoError(t, err)
	clk.advance(31 * time.Second)
	res, err = b.store.Do(ctx, "t1/pay", k2, fp("x"), orderFn(b.ns, k2, &calls))
	require.NoError(t, err)
	require.False(t, res.Replayed)
	rec, err := b.store.Get(ctx, "t1/pay", k2)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
	require.Equal(t, 2, rec.Attempt)
	require.Equal(t, 1, b.orders(ctx, t, k2))
}

// testDoUnknownKeepsLeasePushedOut: an unknown verdict reached through Do
// pushes the lease out for real, so the next retry does not ask at once.
func testDoUnknownKeepsLeasePushedOut[TTx any](t *testing.T, h Harness[TTx]) {
	var checks counter
	check := func(context.Context, idem.Record) (idem.Verdict, error) {
		checks.inc()
		return idem.Unknown(), nil
	}
	ctx, b, clk := leaseSetup(t, h, check)
	key := newKey("do-unknown")
	_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	clk.advance(31 * time.Second)

	var calls counter
	_, err = b.store.Do(ctx, "t1/pay", key, fp("x"), orderFn(b.ns, key, &calls))
	var ip *idem.InProgressError
	require.ErrorAs(t, err, &ip)
	rec, err := b.store.Get(ctx, "t1/pay", key)
	require.NoError(t, err)
	require.True(t, rec.LeaseExpiresAt.Sub(clk.Now()) >= ip.RetryAfter, "the RetryAfter promised a lease that does not exist")

	_, err = b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.ErrorIs(t, err, idem.ErrInProgress)
	require.Equal(t, 1, checks.get())
	require.Zero(t, calls.get())
}

// testReaperReportsFencedVerdict: the reaper's check overruns its timeout,
// a claimer settles the record meanwhile, and the reaper's late verdict is
// discarded and fenced: its report must say so.
func testReaperReportsFencedVerdict[TTx any](t *testing.T, h Harness[TTx]) {
	var first sync.Once
	check := func(ctx context.Context, rec idem.Record) (idem.Verdict, error) {
		slow := false
		first.Do(func() { slow = true })
		if slow {
			time.Sleep(400 * time.Millisecond) // ignores its context
		}
		return idem.Committed(chargedResponse(rec.Key)), nil
	}
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 50 * time.Millisecond, StatusCheckTimeout: 100 * time.Millisecond, StatusCheck: check})
	key := newKey("reaper-fenced")
	_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	time.Sleep(100 * time.Millisecond)
	r, err := idem.NewReaper(b.store, nil)
	require.NoError(t, err)
	done := make(chan idem.ReapReport, 1)
	go func() { rep, _ := r.RunOnce(ctx); done <- rep }()
	time.Sleep(200 * time.Millisecond) // the reaper's check is running
	// Until the reaper's reservation runs out the key is in progress; then
	// this claimer reserves it, checks and replays.
	c, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	for deadline := time.Now().Add(5 * time.Second); errors.Is(err, idem.ErrInProgress) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
		c, err = b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	}
	require.NoError(t, err)
	require.False(t, c.Acquired())
	rep := <-done
	require.Equal(t, 1, rep.Errors, "a verdict fenced after the reaper's reservation must be reported: %+v", rep)
	require.Zero(t, rep.Finalised)
	rec, err := b.store.Get(ctx, "t1/pay", key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
}
