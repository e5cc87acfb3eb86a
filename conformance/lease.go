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

func leaseCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "LeaseLiveGivesInProgress", run: testLeaseLiveGivesInProgress[TTx]},
		{name: "LeaseCrashAfterChargeRecovered", run: testLeaseCrashAfterChargeRecovered[TTx]},
		{name: "LeaseCrashBeforeChargeHandedOver", run: testLeaseCrashBeforeChargeHandedOver[TTx]},
		{name: "LeaseHolderProcessKilledAfterEffect", run: testLeaseHolderProcessKilledAfterEffect[TTx]},
		{name: "LeaseHolderProcessKilledBeforeEffect", run: testLeaseHolderProcessKilledBeforeEffect[TTx]},
		{name: "LeaseUndecidedCheckKeepsProcessing", run: testLeaseUndecidedCheckKeepsProcessing[TTx]},
		{name: "LeaseExpiredWithoutCheckStaysInProgress", run: testLeaseExpiredWithoutCheckStaysInProgress[TTx]},
		{name: "LeaseBlindTakeover", run: testLeaseBlindTakeover[TTx]},
		{name: "LeaseStaleInCallerTx", run: testLeaseStaleInCallerTx[TTx]},
		{name: "LeaseConcurrentClaimersCheckOnce", run: testLeaseConcurrentClaimersCheckOnce[TTx]},
		{name: "LeaseRenewAndRelease", run: testLeaseRenewAndRelease[TTx]},
		{name: "LeaseKeepAliveOutlivesLeases", run: testLeaseKeepAliveOutlivesLeases[TTx]},
		{name: "LeaseKeepAliveReportsLoss", run: testLeaseKeepAliveReportsLoss[TTx]},
	}
}

// provider fakes an outside system (a payment provider) that remembers
// what it did per idempotency key, as real providers do.
type provider struct {
	mu      sync.Mutex
	charged map[string]int
	checks  int
}

func newProvider() *provider { return &provider{charged: map[string]int{}} }

func (p *provider) charge(key string) {
	p.mu.Lock()
	p.charged[key]++
	p.mu.Unlock()
}

func (p *provider) count(key string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.charged[key]
}

func (p *provider) checked() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.checks
}

func chargedResponse(key string) *idem.Response {
	return &idem.Response{StatusCode: 200, Header: map[string][]string{"Content-Type": {"application/json"}}, Body: []byte(`{"charged":"` + key + `"}`)}
}

// check answers from the provider's own records.
func (p *provider) check(_ context.Context, rec idem.Record) (idem.Verdict, error) {
	p.mu.Lock()
	p.checks++
	n := p.charged[rec.Key]
	p.mu.Unlock()
	if n > 0 {
		return idem.Committed(chargedResponse(rec.Key)), nil
	}
	return idem.NotCommitted(), nil
}

// pay is leased work: charge, then complete inside a business transaction.
func pay[TTx any](ctx context.Context, t *testing.T, b *bundle[TTx], p *provider, l *idem.Lease[TTx], key string) error {
	t.Helper()
	p.charge(key)
	tx := b.begin(ctx, t)
	if err := b.ns.InsertOrder(ctx, tx, key); err != nil {
		return err
	}
	if err := l.CompleteTx(ctx, tx, chargedResponse(key)); err != nil {
		_ = b.ns.Dialect.Rollback(ctx, tx)
		return err
	}
	return b.ns.Dialect.Commit(ctx, tx)
}

func leaseSetup[TTx any](t *testing.T, h Harness[TTx], check idem.StatusCheck) (context.Context, *bundle[TTx], *clock) {
	t.Helper()
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 30 * time.Second, Retention: 24 * time.Hour, Now: clk.Now, StatusCheck: check})
	return ctx, b, clk
}

func testLeaseLiveGivesInProgress[TTx any](t *testing.T, h Harness[TTx]) {
	p := newProvider()
	ctx, b, clk := leaseSetup(t, h, p.check)
	key := newKey("live")

	l, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, l.Acquired())
	require.Equal(t, 1, l.Attempt())
	require.True(t, clk.Now().Add(30*time.Second).Equal(l.ExpiresAt()))
	require.NotEmpty(t, l.KeyDigest())
	require.NotContains(t, l.KeyDigest(), key)

	clk.advance(10 * time.Second)
	_, err = b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	var ip *idem.InProgressError
	require.ErrorAs(t, err, &ip)
	require.Equal(t, 20*time.Second, ip.RetryAfter)
	require.Zero(t, p.checked(), "a live lease must not be checked")

	require.NoError(t, pay(ctx, t, b, p, l, key))
	again, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, again.Acquired())
	requireSameResponse(t, chargedResponse(key), again.Replay.Response)
	require.Equal(t, 1, p.count(key))
}

// testLeaseCrashAfterChargeRecovered: the holder charged and died before
// completing. After the lease runs out, a retry asks the check, which finds
// the charge: the retry replays the recovered response, no second charge.
func testLeaseCrashAfterChargeRecovered[TTx any](t *testing.T, h Harness[TTx]) {
	p := newProvider()
	ctx, b, clk := leaseSetup(t, h, p.check)
	key := newKey("crash-after")

	dead, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	p.charge(key) // ... and the process dies here.

	clk.advance(31 * time.Second)
	retry, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, retry.Acquired(), "a committed effect must be replayed, not run again")
	requireSameResponse(t, chargedResponse(key), retry.Replay.Response)
	require.Equal(t, idem.StatusSucceeded, retry.Replay.Status)
	require.Equal(t, 1, p.count(key))
	require.Equal(t, 1, p.checked())

	// The dead holder, should it wake up, is fenced out.
	require.ErrorIs(t, dead.Complete(ctx, chargedResponse("zombie")), idem.ErrFenced)
	rec, err := b.store.Get(ctx, "t1/pay", key)
	require.NoError(t, err)
	requireSameResponse(t, chargedResponse(key), rec.Response)
}

// testLeaseCrashBeforeChargeHandedOver: the holder died before the charge.
// The check finds nothing: the retry acquires as attempt 2 with a new token,
// and the old holder's completion is fenced.
func testLeaseCrashBeforeChargeHandedOver[TTx any](t *testing.T, h Harness[TTx]) {
	p := newProvider()
	ctx, b, clk := leaseSetup(t, h, p.check)
	key := newKey("crash-before")

	dead, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)

	clk.advance(31 * time.Second)
	retry, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, retry.Acquired(), "an effect that never happened must run again")
	require.Equal(t, 2, retry.Attempt())
	require.Greater(t, retry.Token(), dead.Token())

	// The old holder wakes up and tries to finish: fenced, its tx rolls back.
	err = pay(ctx, t, b, p, dead, key)
	require.ErrorIs(t, err, idem.ErrFenced)
	require.Zero(t, b.orders(ctx, t, key), "a fenced holder's business writes must roll back")

	require.NoError(t, pay(ctx, t, b, p, retry, key))
	rec, err := b.store.Get(ctx, "t1/pay", key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
	require.Equal(t, 2, rec.Attempt)
	require.Equal(t, 1, b.orders(ctx, t, key))
}

// testLeaseHolderProcessKilledAfterEffect: a child process acquires the key,
// charges through a provider outside both processes, and is killed with
// SIGKILL while its completion sits in an uncommitted business transaction.
// The database must roll that back and free the record; after the lease runs
// out, a retry asks the check, which finds the charge: the retry replays the
// recovered response and the charge happened once.
func testLeaseHolderProcessKilledAfterEffect[TTx any](t *testing.T, h Harness[TTx]) {
	p := newFileProvider(t)
	ctx, b, clk := leaseSetup(t, h, p.check)
	key := newKey("killed-after")

	c := startChild(t, b.ns, childSpec{Scope: "t1/pay", Key: key, Fingerprint: "x",
		Now: clk.Now(), LeaseDuration: 30 * time.Second, Effect: true, EffectFile: p.path})
	_, attempt := c.waitHolding(t)
	require.Equal(t, 1, attempt)
	c.kill(t)
	requireCharges(t, p, key, 1)

	clk.advance(31 * time.Second)
	retry, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, retry.Acquired(), "a committed effect must be replayed, not run again")
	requireSameResponse(t, chargedResponse(key), retry.Replay.Response)
	require.Equal(t, idem.StatusSucceeded, retry.Replay.Status)
	require.Equal(t, 1, retry.Replay.Attempt)
	require.Equal(t, 1, p.checked(), "the killed holder's completion must not have committed")
	requireCharges(t, p, key, 1)

	again, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	requireSameResponse(t, chargedResponse(key), again.Replay.Response)
	require.Equal(t, 1, p.checked(), "a finalised record needs no more checks")
}

// testLeaseHolderProcessKilledBeforeEffect: a child process acquires the
// key and is killed with SIGKILL before it charges. While its lease runs,
// claimers are told to wait; after it runs out, the check finds nothing and
// the retry acquires as attempt 2 with a newer token, then charges once.
func testLeaseHolderProcessKilledBeforeEffect[TTx any](t *testing.T, h Harness[TTx]) {
	p := newFileProvider(t)
	ctx, b, clk := leaseSetup(t, h, p.check)
	key := newKey("killed-before")

	c := startChild(t, b.ns, childSpec{Scope: "t1/pay", Key: key, Fingerprint: "x",
		Now: clk.Now(), LeaseDuration: 30 * time.Second, EffectFile: p.path})
	deadToken, attempt := c.waitHolding(t)
	require.Equal(t, 1, attempt)

	clk.advance(10 * time.Second)
	_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	var ip *idem.InProgressError
	require.ErrorAs(t, err, &ip, "the child's lease is live")
	require.Equal(t, 20*time.Second, ip.RetryAfter)

	c.kill(t)
	clk.advance(21 * time.Second)
	retry, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, retry.Acquired(), "an effect that never happened must run again")
	require.Equal(t, 2, retry.Attempt())
	require.Greater(t, retry.Token(), deadToken)
	require.Equal(t, 1, p.checked())

	require.NoError(t, p.charge(key))
	tx := b.begin(ctx, t)
	require.NoError(t, b.ns.InsertOrder(ctx, tx, key))
	require.NoError(t, retry.CompleteTx(ctx, tx, chargedResponse(key)))
	require.NoError(t, b.ns.Dialect.Commit(ctx, tx))

	rec, err := b.store.Get(ctx, "t1/pay", key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
	require.Equal(t, 2, rec.Attempt)
	requireSameResponse(t, chargedResponse(key), rec.Response)
	requireCharges(t, p, key, 1)
	require.Equal(t, 1, b.orders(ctx, t, key))
}

func requireCharges(t *testing.T, p *fileProvider, key string, want int) {
	t.Helper()
	n, err := p.count(key)
	require.NoError(t, err)
	require.Equal(t, want, n, "charges for the key")
}

// testLeaseUndecidedCheckKeepsProcessing: unknown verdicts, errors, panics
// and malformed verdicts never finalise or hand over anything.
func testLeaseUndecidedCheckKeepsProcessing[TTx any](t *testing.T, h Harness[TTx]) {
	answers := []func() (idem.Verdict, error){
		func() (idem.Verdict, error) { return idem.Unknown(), nil },
		func() (idem.Verdict, error) { return idem.Committed(nil), nil },
		func() (idem.Verdict, error) { return idem.NotCommitted(), errors.New("provider unreachable") },
		func() (idem.Verdict, error) { panic("check bug") },
		func() (idem.Verdict, error) { return idem.Verdict{Kind: 42}, nil },
	}
	var (
		mu    sync.Mutex
		next  int
		calls int
	)
	check := func(ctx context.Context, rec idem.Record) (idem.Verdict, error) {
		mu.Lock()
		answer := answers[next]
		calls++
		mu.Unlock()
		return answer()
	}
	ctx, b, clk := leaseSetup(t, h, check)
	key := newKey("undecided")
	first, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)

	for i := range answers {
		mu.Lock()
		next = i
		mu.Unlock()
		clk.advance(16 * time.Minute) // past any pushed-out lease
		_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		var ip *idem.InProgressError
		require.ErrorAs(t, err, &ip, "answer %d", i)
		require.Positive(t, ip.RetryAfter, "answer %d: the lease must be pushed out", i)

		rec, err := b.store.Get(ctx, "t1/pay", key)
		require.NoError(t, err)
		require.Equal(t, idem.StatusProcessing, rec.Status, "answer %d", i)
		require.Nil(t, rec.Response)
		require.Equal(t, 1, rec.Attempt, "answer %d: nothing may be handed over", i)
		require.True(t, rec.LeaseExpiresAt.After(clk.Now()))

		// While pushed out, claimers get in progress without a new check.
		before := calls
		_, err = b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		require.ErrorIs(t, err, idem.ErrInProgress)
		require.Equal(t, before, calls)
	}
	require.Equal(t, len(answers), calls)
	require.ErrorIs(t, first.Complete(ctx, chargedResponse(key)), idem.ErrFenced,
		"the check's reservation fences the old holder")
}

func testLeaseExpiredWithoutCheckStaysInProgress[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b, clk := leaseSetup(t, h, nil)
	key := newKey("nocheck")
	l, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	clk.advance(time.Hour)
	_, err = b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.ErrorIs(t, err, idem.ErrInProgress, "without a check an expired lease is never taken over")
	// The holder can still finish: nobody took the key.
	require.NoError(t, l.Complete(ctx, chargedResponse(key)))
}

// testLeaseStaleInCallerTx: a ClaimTx that meets a stale lease does not run
// the status check inside the caller's transaction. It answers in progress
// with no Cause (Cause is only ever the driver's error that ended a wait,
// and none did), and the transaction stays usable. Do on the same key then
// settles the record on the pool and runs its callback once.
func testLeaseStaleInCallerTx[TTx any](t *testing.T, h Harness[TTx]) {
	p := newProvider()
	ctx, b, clk := leaseSetup(t, h, p.check)
	key := newKey("stale-in-tx")
	l, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, l.Acquired())
	clk.advance(31 * time.Second)

	tx := b.begin(ctx, t)
	_, err = b.store.ClaimTx(ctx, tx, "t1/pay", key, fp("x"))
	var ip *idem.InProgressError
	require.ErrorAs(t, err, &ip)
	require.Equal(t, time.Second, ip.RetryAfter)
	require.NotEmpty(t, ip.KeyDigest)
	require.False(t, ip.TxAborted)
	require.NoError(t, ip.Cause, "no driver error ended a wait: Cause must be nil")
	require.Zero(t, p.checked(), "the check must not run inside the caller's transaction")
	require.NoError(t, b.ns.InsertOrder(ctx, tx, key+"-usable"), "the caller's transaction must still be usable")
	require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))

	res, err := b.store.Do(ctx, "t1/pay", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		p.charge(key)
		return chargedResponse(key), b.ns.InsertOrder(ctx, tx, key)
	})
	require.NoError(t, err)
	require.False(t, res.Replayed, "a not-committed verdict hands the key to Do")
	require.Equal(t, 1, p.checked())
	require.Equal(t, 1, p.count(key))
	require.Equal(t, 1, b.orders(ctx, t, key))
}

func testLeaseBlindTakeover[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 30 * time.Second, Now: clk.Now, BlindTakeover: true})
	key := newKey("blind")
	old, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	clk.advance(29 * time.Second)
	_, err = b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.ErrorIs(t, err, idem.ErrInProgress)
	clk.advance(2 * time.Second)
	next, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, next.Acquired())
	require.Equal(t, 2, next.Attempt())
	require.ErrorIs(t, old.Complete(ctx, chargedResponse("old")), idem.ErrFenced)
	require.NoError(t, next.Complete(ctx, chargedResponse("new")))
}

// testLeaseConcurrentClaimersCheckOnce: many retries meet one stale record
// at once; the check runs once and exactly one of them takes the key over.
func testLeaseConcurrentClaimersCheckOnce[TTx any](t *testing.T, h Harness[TTx]) {
	p := newProvider()
	slowCheck := func(ctx context.Context, rec idem.Record) (idem.Verdict, error) {
		time.Sleep(100 * time.Millisecond) // widen the window for a second check
		return p.check(ctx, rec)
	}
	ctx, b, clk := leaseSetup(t, h, slowCheck)
	key := newKey("stale-storm")
	_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	clk.advance(time.Minute)

	const claimers = 12
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		acquired int
		bad      []error
	)
	for range claimers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil && l.Acquired():
				acquired++
			case errors.Is(err, idem.ErrInProgress):
			default:
				bad = append(bad, err)
			}
		}()
	}
	wg.Wait()
	require.Empty(t, bad)
	require.Equal(t, 1, acquired)
	require.Equal(t, 1, p.checked(), "the check must run once for one stale record")
}

func testLeaseRenewAndRelease[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b, clk := leaseSetup(t, h, nil)
	key := newKey("renew")
	l, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)

	clk.advance(20 * time.Second)
	require.NoError(t, l.Renew(ctx))
	require.True(t, clk.Now().Add(30*time.Second).Equal(l.ExpiresAt()))
	require.NoError(t, l.Extend(ctx, 5*time.Minute))
	require.True(t, clk.Now().Add(5*time.Minute).Equal(l.ExpiresAt()))
	rec, err := b.store.Get(ctx, "t1/pay", key)
	require.NoError(t, err)
	require.True(t, l.ExpiresAt().Equal(rec.LeaseExpiresAt))
	require.Equal(t, l.Token(), rec.Token, "a renewal keeps the token")

	clk.advance(4 * time.Minute)
	_, err = b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.ErrorIs(t, err, idem.ErrInProgress)

	require.NoError(t, l.Release(ctx))
	require.ErrorIs(t, l.Renew(ctx), idem.ErrFenced, "a released lease cannot be renewed")
	next, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, next.Acquired())
	require.Equal(t, 1, next.Attempt())
	require.NoError(t, next.Complete(ctx, chargedResponse(key)))
	require.ErrorIs(t, next.Renew(ctx), idem.ErrFenced, "a completed lease cannot be renewed")
}

// testLeaseKeepAliveOutlivesLeases runs work for several lease durations on
// the database's clock while a blind-takeover competitor keeps trying: the
// renewals must keep it out.
func testLeaseKeepAliveOutlivesLeases[TTx any](t *testing.T, h Harness[TTx]) {
	// Renewals run every third of the lease; 2s leaves each one more than
	// half a second, which a loaded two-core machine with a Galera cluster
	// and parallel suites needs (1s failed there once).
	const lease = 2 * time.Second
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: lease, BlindTakeover: true})
	key := newKey("keepalive")
	l, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)

	workCtx, stop := l.KeepAlive(ctx)
	deadline := time.Now().Add(3*lease + lease/2)
	for time.Now().Before(deadline) {
		_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		require.ErrorIs(t, err, idem.ErrInProgress, "the competitor took over a kept-alive lease")
		require.NoError(t, workCtx.Err())
		time.Sleep(50 * time.Millisecond)
	}
	require.NoError(t, stop())
	require.Error(t, workCtx.Err(), "stop ends the work context")
	require.NoError(t, l.Complete(ctx, chargedResponse(key)))
}

// testLeaseKeepAliveReportsLoss: when a newer holder takes the key, the
// next renewal fails, the work context is cancelled with ErrFenced as its
// cause, and stop reports it.
func testLeaseKeepAliveReportsLoss[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 300 * time.Millisecond, Now: clk.Now, BlindTakeover: true})
	key := newKey("keepalive-loss")
	l, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	workCtx, stop := l.KeepAlive(ctx)

	// Renewals use the pinned clock, so jumping it past the lease lets a
	// competitor take over before the next renewal.
	clk.advance(time.Hour)
	thief, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	for errors.Is(err, idem.ErrInProgress) { // a renewal slipped in first
		clk.advance(time.Hour)
		thief, err = b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	}
	require.NoError(t, err)
	require.True(t, thief.Acquired())

	select {
	case <-workCtx.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the work context was not cancelled after the lease was lost")
	}
	require.ErrorIs(t, context.Cause(workCtx), idem.ErrFenced)
	require.ErrorIs(t, stop(), idem.ErrFenced)
	require.ErrorIs(t, l.Complete(ctx, chargedResponse("old")), idem.ErrFenced)
}
