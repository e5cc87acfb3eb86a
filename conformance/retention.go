package conformance

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func retentionCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "RetentionExpiredKeyClaimedAnew", run: testRetentionExpiredKeyClaimedAnew[TTx]},
		{name: "RetentionCountsFromCompletion", run: testRetentionCountsFromCompletion[TTx]},
		{name: "RetentionExpiredProcessingTakenOverOnce", run: testRetentionExpiredProcessingTakenOverOnce[TTx]},
	}
}

func testRetentionExpiredKeyClaimedAnew[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{Retention: time.Hour, Now: clk.Now})
	key := newKey("retention")
	var calls counter

	_, err := b.store.Do(ctx, "t1/create", key, fp("first"), orderFn(b.ns, "first-"+key, &calls))
	require.NoError(t, err)
	old, err := b.store.Get(ctx, "t1/create", key)
	require.NoError(t, err)

	clk.advance(time.Hour - time.Second)
	_, err = b.store.Do(ctx, "t1/create", key, fp("second"), orderFn(b.ns, "second-"+key, &calls))
	require.ErrorIs(t, err, idem.ErrFingerprint, "before the deadline the key is still bound")

	clk.advance(2 * time.Second)
	_, err = b.store.Get(ctx, "t1/create", key)
	require.ErrorIs(t, err, idem.ErrNotFound, "a record past its deadline is absent")

	res, err := b.store.Do(ctx, "t1/create", key, fp("second"), orderFn(b.ns, "second-"+key, &calls))
	require.NoError(t, err)
	require.False(t, res.Replayed, "an expired key must be claimed anew")
	require.Equal(t, 2, calls.get())
	require.Equal(t, 1, b.orders(ctx, t, "second-"+key))

	rec, err := b.store.Get(ctx, "t1/create", key)
	require.NoError(t, err)
	require.True(t, rec.Fingerprint.Equal(fp("second")))
	require.Equal(t, 1, rec.Attempt)
	require.Greater(t, rec.Token, old.Token)
	require.True(t, clk.Now().Equal(rec.CreatedAt))
	require.True(t, clk.Now().Add(time.Hour).Equal(rec.ExpiresAt))
	require.Equal(t, 1, b.records(ctx, t))

	_, err = b.store.Do(ctx, "t1/create", key, fp("first"), orderFn(b.ns, "first-"+key, &calls))
	require.ErrorIs(t, err, idem.ErrFingerprint, "the old request is now a different one")
}

func testRetentionCountsFromCompletion[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: time.Hour, Retention: time.Hour, Now: clk.Now})
	key := newKey("fromcompletion")

	c, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	clk.advance(30 * time.Minute)
	require.NoError(t, b.store.Complete(ctx, c, orderResponse(key)))
	rec, err := b.store.Get(ctx, "t1/pay", key)
	require.NoError(t, err)
	require.True(t, clk.Now().Equal(rec.CompletedAt))
	require.True(t, clk.Now().Add(time.Hour).Equal(rec.ExpiresAt))

	clk.advance(45 * time.Minute) // past claim+retention, before completion+retention
	again, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, again.Acquired())
}

func testRetentionExpiredProcessingTakenOverOnce[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: time.Minute, Retention: time.Hour, Now: clk.Now})
	key := newKey("stuck")

	stale, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	clk.advance(2 * time.Hour)

	const claimers = 10
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		acquired []*idem.Claim
		others   []error
	)
	for range claimers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
			mu.Lock()
			defer mu.Unlock()
			if err == nil && c.Acquired() {
				acquired = append(acquired, c)
				return
			}
			others = append(others, err)
		}()
	}
	wg.Wait()
	require.Len(t, acquired, 1, "exactly one claimer may take over an expired record")
	for _, err := range others {
		require.ErrorIs(t, err, idem.ErrInProgress)
	}
	require.Greater(t, acquired[0].Token, stale.Token)
	require.ErrorIs(t, b.store.Complete(ctx, stale, orderResponse("stale")), idem.ErrFenced)
	require.NoError(t, b.store.Complete(ctx, acquired[0], orderResponse("new")))
}
