package conformance

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func waitCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "WaitTimeoutGivesInProgress", run: testWaitTimeoutGivesInProgress[TTx]},
		{name: "WaiterSeesHolderCommit", run: testWaiterSeesHolderCommit[TTx]},
		{name: "WaiterAcquiresAfterHolderRollback", run: testWaiterAcquiresAfterHolderRollback[TTx]},
		{name: "WaiterWithOldSnapshotSeesHolderCommit", run: testWaiterWithOldSnapshotSeesHolderCommit[TTx], applies: concurrentWriters},
	}
}

func testWaitTimeoutGivesInProgress[TTx any](t *testing.T, h Harness[TTx]) {
	const wait = time.Second
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: wait})
	key := newKey("wait")

	holder := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, holder, "t1/create", key, fp("x"))
	require.NoError(t, err)
	require.True(t, c.Acquired())

	upper := wait + b.feat.WaitGranularity + 2*time.Second
	start := time.Now()
	_, err = b.store.Claim(ctx, "t1/create", key, fp("x"))
	elapsed := time.Since(start)
	require.GreaterOrEqual(t, elapsed, wait-50*time.Millisecond, "gave up before WaitTimeout")
	require.Less(t, elapsed, upper, "waited far longer than WaitTimeout")
	if b.feat.SingleWriter {
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	} else {
		require.ErrorIs(t, err, idem.ErrInProgress)
		var ip *idem.InProgressError
		require.ErrorAs(t, err, &ip)
		require.Positive(t, ip.RetryAfter)
		require.NotEmpty(t, ip.KeyDigest)
		require.Error(t, ip.Cause, "a wait that timed out carries the driver's error as Cause")

		// The same wait inside a caller's transaction.
		waiter := b.begin(ctx, t)
		start = time.Now()
		_, err = b.store.ClaimTx(ctx, waiter, "t1/create", key, fp("x"))
		elapsed = time.Since(start)
		require.ErrorAs(t, err, &ip)
		require.GreaterOrEqual(t, elapsed, wait-50*time.Millisecond)
		require.Less(t, elapsed, upper)
		require.Equal(t, b.feat.WaitAbortsTx, ip.TxAborted)
		require.Error(t, ip.Cause, "a wait that timed out carries the driver's error as Cause")
		if !ip.TxAborted {
			require.NoError(t, b.ns.InsertOrder(ctx, waiter, "still-usable"), "the waiter's transaction must survive the timeout")
		}
		require.NoError(t, b.ns.Dialect.Rollback(ctx, waiter))
	}

	require.NoError(t, b.ns.Dialect.Rollback(ctx, holder))
	next, err := b.store.Claim(ctx, "t1/create", key, fp("x"))
	require.NoError(t, err)
	require.True(t, next.Acquired())
}

func testWaiterSeesHolderCommit[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 10 * time.Second})
	key := newKey("holdcommit")

	holder := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, holder, "t1/create", key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.ns.InsertOrder(ctx, holder, key))
	require.NoError(t, b.store.CompleteTx(ctx, holder, c, orderResponse(key)))

	type outcome struct {
		claim   *idem.Claim
		err     error
		elapsed time.Duration
	}
	var (
		wg      sync.WaitGroup
		same    outcome
		other   outcome
		viaDo   outcome
		doRes   *idem.Result
		doCalls counter
	)
	start := time.Now()
	wg.Add(3)
	go func() {
		defer wg.Done()
		same.claim, same.err = b.store.Claim(ctx, "t1/create", key, fp("x"))
		same.elapsed = time.Since(start)
	}()
	go func() {
		defer wg.Done()
		other.claim, other.err = b.store.Claim(ctx, "t1/create", key, fp("y"))
		other.elapsed = time.Since(start)
	}()
	go func() {
		defer wg.Done()
		doRes, viaDo.err = b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &doCalls))
		viaDo.elapsed = time.Since(start)
	}()
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, b.ns.Dialect.Commit(ctx, holder))
	wg.Wait()

	require.NoError(t, same.err)
	require.False(t, same.claim.Acquired(), "a waiter acquired while the holder could still commit")
	requireSameResponse(t, orderResponse(key), same.claim.Replay.Response)
	require.GreaterOrEqual(t, same.elapsed, 250*time.Millisecond, "the waiter did not wait for the holder")
	require.ErrorIs(t, other.err, idem.ErrFingerprint)
	require.NoError(t, viaDo.err)
	require.True(t, doRes.Replayed)
	require.Equal(t, entriesWhileHeld(h.Features()), doCalls.get())
	require.Equal(t, 1, b.orders(ctx, t, key))
}

func testWaiterAcquiresAfterHolderRollback[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 10 * time.Second, MaxTxRetries: 20})
	key := newKey("holdrollback")

	holder := b.begin(ctx, t)
	_, err := b.store.ClaimTx(ctx, holder, "t1/create", key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.ns.InsertOrder(ctx, holder, key))

	const waiters = 4
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		results []*idem.Result
		errs    []error
		calls   counter
	)
	for range waiters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
			mu.Lock()
			results = append(results, res)
			errs = append(errs, err)
			mu.Unlock()
		}()
	}
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, b.ns.Dialect.Rollback(ctx, holder))
	wg.Wait()

	executed := 0
	for i, err := range errs {
		require.NoError(t, err, "waiter %d", i)
		if !results[i].Replayed {
			executed++
		}
		requireSameResponse(t, orderResponse(key), results[i].Response)
	}
	require.Equal(t, 1, executed, "exactly one waiter must take over after the rollback")
	require.Equal(t, 1, b.orders(ctx, t, key))
}

// testWaiterWithOldSnapshotSeesHolderCommit: a waiter whose transaction has
// already read (fixing its snapshot under REPEATABLE READ, MySQL's default)
// before the holder commits must still see the holder's record after its
// claim waited for it: a replay for the same fingerprint, ErrFingerprint for
// another. Not run where writers serialise at BEGIN (SQLite), where a waiter
// cannot hold a snapshot while the holder is uncommitted.
func testWaiterWithOldSnapshotSeesHolderCommit[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 10 * time.Second})
	key := newKey("oldsnap")

	holder := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, holder, "t1/create", key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.ns.InsertOrder(ctx, holder, key))
	require.NoError(t, b.store.CompleteTx(ctx, holder, c, orderResponse(key)))

	// Each waiter reads first: under REPEATABLE READ this fixes its snapshot
	// before the holder commits.
	same := b.begin(ctx, t)
	_, err = b.store.GetTx(ctx, same, "t1/create", key)
	require.ErrorIs(t, err, idem.ErrNotFound)
	other := b.begin(ctx, t)
	_, err = b.store.GetTx(ctx, other, "t1/create", key)
	require.ErrorIs(t, err, idem.ErrNotFound)

	type outcome struct {
		claim *idem.Claim
		err   error
	}
	sameCh := make(chan outcome, 1)
	otherCh := make(chan outcome, 1)
	// Each waiter ends its transaction as soon as its claim answers: on
	// MySQL the claim keeps a lock on the row until then, which the other
	// waiter would queue behind.
	go func() {
		c, err := b.store.ClaimTx(ctx, same, "t1/create", key, fp("x"))
		_ = b.ns.Dialect.Rollback(ctx, same)
		sameCh <- outcome{c, err}
	}()
	go func() {
		c, err := b.store.ClaimTx(ctx, other, "t1/create", key, fp("y"))
		_ = b.ns.Dialect.Rollback(ctx, other)
		otherCh <- outcome{c, err}
	}()
	time.Sleep(300 * time.Millisecond)
	require.NoError(t, b.ns.Dialect.Commit(ctx, holder))

	s := <-sameCh
	require.NoError(t, s.err, "a waiter with an older snapshot must see the holder's committed record")
	require.False(t, s.claim.Acquired())
	requireSameResponse(t, orderResponse(key), s.claim.Replay.Response)
	o := <-otherCh
	require.ErrorIs(t, o.err, idem.ErrFingerprint)
	require.Equal(t, 1, b.orders(ctx, t, key))
}
