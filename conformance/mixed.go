package conformance

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// mixedCases run Do next to ClaimTx and the pool's Claim on the same key.
// Do may claim without writing a row (a deferred claim, where the dialect
// supports it), so these check that every path still excludes the others:
// one execution per key, waits bounded, replays that do not queue.
func mixedCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "MixedPathsOneKey", run: testMixedPathsOneKey[TTx]},
		{name: "DoHolderMakesClaimTxWait", run: testDoHolderMakesClaimTxWait[TTx], applies: concurrentWriters},
		{name: "ClaimTxHolderMakesDoWait", run: testClaimTxHolderMakesDoWait[TTx], applies: concurrentWriters},
		{name: "DoReplaysWhileTxReplays", run: testDoReplaysWhileTxReplays[TTx], applies: concurrentWriters},
		{name: "OptimisticLoserReplays", run: testOptimisticLoserReplays[TTx], applies: optimisticDo},
		{name: "OptimisticDoLosesToPoolClaim", run: testOptimisticDoLosesToPoolClaim[TTx], applies: optimisticDo},
	}
}

// testMixedPathsOneKey starts 30 goroutines on one key at once, each taking
// one of the three ways to claim it (Do; ClaimTx, the order and CompleteTx
// in one transaction; a pool Claim committed first, then the order and
// CompleteTx): exactly one runs the business effect.
func testMixedPathsOneKey[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 10 * time.Second, MaxTxRetries: 20})
	const goroutines = 30
	for round := range 3 {
		key := newKey(fmt.Sprintf("mixed%d", round))
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			winners int
			bad     []error
			calls   counter
		)
		outcome := func(ran bool, err error) {
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil && ran:
				winners++
			case err == nil, errors.Is(err, idem.ErrInProgress), errors.Is(err, idem.ErrRetryable):
				// A replay, a holder met, or a deadlock victim (MySQL) that
				// committed nothing: none ran the effect.
			default:
				bad = append(bad, err)
			}
		}
		startGun := make(chan struct{})
		for g := range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-startGun
				switch g % 3 {
				case 0:
					res, err := b.store.Do(ctx, "t1/mixed", key, fp("same"), orderFn(b.ns, key, &calls))
					outcome(err == nil && !res.Replayed, err)
				case 1:
					outcome(mixedClaimTx(ctx, b, key, &calls))
				default:
					outcome(mixedPoolClaim(ctx, b, key, &calls))
				}
			}()
		}
		close(startGun)
		wg.Wait()
		require.Empty(t, bad, "unexplained outcomes in round %d", round)
		require.Equal(t, 1, winners, "round %d", round)
		if h.Features().OptimisticDo {
			// Overlapping Do calls all enter fn; all but one roll back.
			require.GreaterOrEqual(t, calls.get(), 1, "round %d", round)
		} else {
			require.Equal(t, 1, calls.get(), "round %d: the effect was entered more than once", round)
		}
		require.Equal(t, 1, b.orders(ctx, t, key), "round %d: the business effect committed more than once", round)
	}
}

// mixedClaimTx claims key with ClaimTx and, when acquired, inserts the
// order and completes in the same transaction. ran reports a commit of the
// effect.
func mixedClaimTx[TTx any](ctx context.Context, b *bundle[TTx], key string, calls *counter) (ran bool, _ error) {
	d := b.ns.Dialect
	tx, err := d.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() { _ = d.Rollback(context.WithoutCancel(ctx), tx) }()
	c, err := b.store.ClaimTx(ctx, tx, "t1/mixed", key, fp("same"))
	if err != nil || !c.Acquired() {
		return false, err
	}
	if _, err := orderFn(b.ns, key, calls)(ctx, tx); err != nil {
		return false, err
	}
	if err := b.store.CompleteTx(ctx, tx, c, orderResponse(key)); err != nil {
		return false, err
	}
	return true, d.Commit(ctx, tx)
}

// mixedPoolClaim claims key on the pool (the claim commits at once) and,
// when acquired, inserts the order and completes in one transaction,
// releasing the key if that fails.
func mixedPoolClaim[TTx any](ctx context.Context, b *bundle[TTx], key string, calls *counter) (ran bool, _ error) {
	c, err := b.store.Claim(ctx, "t1/mixed", key, fp("same"))
	if err != nil || !c.Acquired() {
		return false, err
	}
	d := b.ns.Dialect
	err = func() error {
		tx, err := d.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = d.Rollback(context.WithoutCancel(ctx), tx) }()
		if _, err := orderFn(b.ns, key, calls)(ctx, tx); err != nil {
			return err
		}
		if err := b.store.CompleteTx(ctx, tx, c, orderResponse(key)); err != nil {
			return err
		}
		return d.Commit(ctx, tx)
	}()
	if err != nil {
		return false, errors.Join(err, b.store.Release(context.WithoutCancel(ctx), c))
	}
	return true, nil
}

// testDoHolderMakesClaimTxWait: while Do's callback runs, a ClaimTx of the
// key waits for Do's transaction (bounded by WaitTimeout) and, once Do has
// committed, replays Do's response.
func testDoHolderMakesClaimTxWait[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 300 * time.Millisecond})
	key := newKey("doholder")
	entered, proceed := make(chan struct{}), make(chan struct{})
	var calls counter
	done := make(chan error, 1)
	go func() {
		_, err := b.store.Do(ctx, "t1/pay", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
			close(entered)
			<-proceed
			return orderFn(b.ns, key, &calls)(ctx, tx)
		})
		done <- err
	}()
	<-entered

	if h.Features().OptimisticDo {
		// Do holds nothing while its callback runs: a ClaimTx acquires at
		// once, and Do commits once it has rolled back.
		tx := b.begin(ctx, t)
		start := time.Now()
		c, err := b.store.ClaimTx(ctx, tx, "t1/pay", key, fp("x"))
		require.NoError(t, err)
		require.True(t, c.Acquired(), "an optimistic Do holds no lock while its callback runs")
		require.Less(t, time.Since(start), 250*time.Millisecond, "the ClaimTx waited for an optimistic Do")
		require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))
	} else {
		tx := b.begin(ctx, t)
		start := time.Now()
		_, err := b.store.ClaimTx(ctx, tx, "t1/pay", key, fp("x"))
		require.ErrorIs(t, err, idem.ErrInProgress, "a ClaimTx must not acquire a key Do holds")
		require.GreaterOrEqual(t, time.Since(start), 250*time.Millisecond, "the ClaimTx must have waited for Do's transaction")
		require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))

		c, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
		require.ErrorIs(t, err, idem.ErrInProgress, "a pool Claim must not acquire a key Do holds")
		require.Nil(t, c)
	}

	close(proceed)
	require.NoError(t, <-done)
	tx2 := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, tx2, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, c.Acquired())
	requireSameResponse(t, orderResponse(key), c.Replay.Response)
	require.NoError(t, b.ns.Dialect.Rollback(ctx, tx2))
	require.Equal(t, 1, calls.get())
	require.Equal(t, 1, b.orders(ctx, t, key))
}

// testClaimTxHolderMakesDoWait: Do on a key that another transaction
// claimed with ClaimTx waits for it and replays what it committed, without
// running its callback.
func testClaimTxHolderMakesDoWait[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 10 * time.Second})
	key := newKey("txholder")
	holder := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, holder, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, c.Acquired())

	var calls counter
	type answer struct {
		res *idem.Result
		err error
	}
	done := make(chan answer, 1)
	go func() {
		res, err := b.store.Do(ctx, "t1/pay", key, fp("x"), orderFn(b.ns, key, &calls))
		done <- answer{res, err}
	}()
	time.Sleep(time.Duration(200+rand.IntN(100)) * time.Millisecond) //nolint:gosec // test timing jitter
	select {
	case a := <-done:
		t.Fatalf("Do answered while the key's holder was open: %+v, %v", a.res, a.err)
	default:
	}
	require.NoError(t, b.ns.InsertOrder(ctx, holder, key))
	require.NoError(t, b.store.CompleteTx(ctx, holder, c, orderResponse(key)))
	require.NoError(t, b.ns.Dialect.Commit(ctx, holder))

	a := <-done
	require.NoError(t, a.err)
	require.True(t, a.res.Replayed)
	requireSameResponse(t, orderResponse(key), a.res.Response)
	require.Equal(t, entriesWhileHeld(h.Features()), calls.get())
	require.Equal(t, 1, b.orders(ctx, t, key))
}

// testDoReplaysWhileTxReplays: a completed key replayed by ClaimTx in a
// transaction that stays open does not hold up Do's replay of it.
func testDoReplaysWhileTxReplays[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 2 * time.Second})
	key := newKey("doreplay")
	var calls counter
	_, err := b.store.Do(ctx, "t1/pay", key, fp("x"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)

	tx := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, tx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, c.Acquired())

	start := time.Now()
	res, err := b.store.Do(ctx, "t1/pay", key, fp("x"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.True(t, res.Replayed)
	require.Less(t, time.Since(start), 500*time.Millisecond, "Do's replay must not wait for another replayer")
	require.Equal(t, 1, calls.get())
}

// testOptimisticLoserReplays: two Do calls of one key overlap; the second
// to start completes first, and the first, whose callback has already
// written, is rolled back and replays the second's response: both callbacks
// ran, one order committed.
func testOptimisticLoserReplays[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: 5 * time.Second})
	key := newKey("optloser")
	var calls counter
	written, proceed := make(chan struct{}), make(chan struct{})
	type answer struct {
		res *idem.Result
		err error
	}
	first := make(chan answer, 1)
	var once sync.Once
	go func() {
		res, err := b.store.Do(ctx, "t1/pay", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
			resp, err := orderFn(b.ns, key, &calls)(ctx, tx)
			if err == nil {
				once.Do(func() { close(written); <-proceed })
			}
			return resp, err
		})
		first <- answer{res, err}
	}()
	<-written

	res, err := b.store.Do(ctx, "t1/pay", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		resp, err := orderFn(b.ns, key, &calls)(ctx, tx)
		if resp != nil {
			resp.Header = map[string][]string{"X-Winner": {"second"}}
		}
		return resp, err
	})
	require.NoError(t, err)
	require.False(t, res.Replayed, "the second Do found nothing to wait for")
	close(proceed)

	a := <-first
	require.NoError(t, a.err)
	require.True(t, a.res.Replayed, "the first Do must lose to the committed record and replay it")
	require.Equal(t, []string{"second"}, a.res.Response.Header["X-Winner"])
	require.Equal(t, 2, calls.get(), "both callbacks ran")
	require.Equal(t, 1, b.orders(ctx, t, key), "exactly one callback's writes committed")
}

// testOptimisticDoLosesToPoolClaim: a pool Claim commits its processing
// record while an optimistic Do's callback runs; Do's completion meets it,
// rolls back and answers in progress, and later replays the pool claimer's
// response.
func testOptimisticDoLosesToPoolClaim[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: time.Second})
	key := newKey("optpool")
	var calls counter
	entered, proceed := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := b.store.Do(ctx, "t1/pay", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
			if calls.get() == 0 {
				close(entered)
				<-proceed
			}
			return orderFn(b.ns, key, &calls)(ctx, tx)
		})
		done <- err
	}()
	<-entered
	c, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, c.Acquired())
	close(proceed)
	require.ErrorIs(t, <-done, idem.ErrInProgress)
	require.Zero(t, b.orders(ctx, t, key), "the losing Do committed its callback's writes")

	require.NoError(t, b.store.Complete(ctx, c, orderResponse(key)))
	res, err := b.store.Do(ctx, "t1/pay", key, fp("x"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.True(t, res.Replayed)
	requireSameResponse(t, orderResponse(key), res.Response)
}
