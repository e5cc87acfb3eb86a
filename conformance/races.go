package conformance

import (
	"context"
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
	require.Zero(t, calls.get())
}
