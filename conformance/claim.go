package conformance

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func claimCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "ClaimNewKeyAcquires", run: testClaimNewKeyAcquires[TTx]},
		{name: "SequentialReplay", run: testSequentialReplay[TTx]},
		{name: "FingerprintMismatch", run: testFingerprintMismatch[TTx]},
		{name: "InProgressLiveLease", run: testInProgressLiveLease[TTx]},
		{name: "ScopesAreIndependent", run: testScopesAreIndependent[TTx]},
		{name: "OwnershipAndFencing", run: testOwnershipAndFencing[TTx]},
		{name: "ReleaseFreesKey", run: testReleaseFreesKey[TTx]},
		{name: "FailIsStoredAndReplayed", run: testFailIsStoredAndReplayed[TTx]},
		{name: "KeysMatchLiterally", run: testKeysMatchLiterally[TTx]},
	}
}

func testClaimNewKeyAcquires[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	cfg := &idem.Config{LeaseDuration: 40 * time.Second, Retention: time.Hour, Now: clk.Now}
	ctx, b := setup(t, h, cfg)
	key := newKey("new")

	c, err := b.store.Claim(ctx, "tenant-1/orders", key, fp("body-1"))
	require.NoError(t, err)
	require.True(t, c.Acquired())
	require.Nil(t, c.Replay)
	require.Equal(t, 1, c.Attempt)
	require.Positive(t, c.Token)

	rec, err := b.store.Get(ctx, "tenant-1/orders", key)
	require.NoError(t, err)
	require.Equal(t, "tenant-1/orders", rec.Scope)
	require.Equal(t, key, rec.Key)
	require.Equal(t, idem.StatusProcessing, rec.Status)
	require.True(t, rec.Fingerprint.Equal(fp("body-1")))
	require.Equal(t, c.Token, rec.Token)
	require.Equal(t, 1, rec.Attempt)
	require.Nil(t, rec.Response)
	require.True(t, rec.CompletedAt.IsZero())
	now := clk.Now()
	require.True(t, now.Equal(rec.CreatedAt), "created %v, want %v", rec.CreatedAt, now)
	require.True(t, now.Equal(rec.UpdatedAt))
	require.True(t, now.Add(40*time.Second).Equal(rec.LeaseExpiresAt), "lease %v", rec.LeaseExpiresAt)
	require.True(t, now.Add(time.Hour).Equal(rec.ExpiresAt), "expires %v", rec.ExpiresAt)
	require.Equal(t, time.UTC, rec.CreatedAt.Location())
	require.Equal(t, 1, b.records(ctx, t))
}

func testSequentialReplay[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("seq")
	var calls counter

	first, err := b.store.Do(ctx, "t1/create", key, fp("same"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.False(t, first.Replayed)
	requireSameResponse(t, orderResponse(key), first.Response)

	second, err := b.store.Do(ctx, "t1/create", key, fp("same"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.True(t, second.Replayed)
	requireSameResponse(t, orderResponse(key), second.Response)

	require.Equal(t, 1, calls.get(), "the business callback ran again on a replay")
	require.Equal(t, 1, b.orders(ctx, t, key))

	// The pool-level claim replays the same stored record.
	c, err := b.store.Claim(ctx, "t1/create", key, fp("same"))
	require.NoError(t, err)
	require.False(t, c.Acquired())
	require.Equal(t, idem.StatusSucceeded, c.Replay.Status)
	requireSameResponse(t, orderResponse(key), c.Replay.Response)
	require.False(t, c.Replay.CompletedAt.IsZero())
}

func testFingerprintMismatch[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("mismatch")
	var calls counter

	_, err := b.store.Do(ctx, "t1/create", key, fp("amount=10"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	before, err := b.store.Get(ctx, "t1/create", key)
	require.NoError(t, err)

	_, err = b.store.Do(ctx, "t1/create", key, fp("amount=99"), orderFn(b.ns, key, &calls))
	require.ErrorIs(t, err, idem.ErrFingerprint)
	_, err = b.store.Claim(ctx, "t1/create", key, fp("amount=99"))
	require.ErrorIs(t, err, idem.ErrFingerprint)

	after, err := b.store.Get(ctx, "t1/create", key)
	require.NoError(t, err)
	require.Equal(t, before, after, "a mismatch must leave the stored record exactly as it was")
	require.Equal(t, 1, calls.get())
	require.Equal(t, 1, b.orders(ctx, t, key))

	// A processing record is protected the same way.
	other := newKey("mismatch-processing")
	_, err = b.store.Claim(ctx, "t1/create", other, fp("a"))
	require.NoError(t, err)
	_, err = b.store.Claim(ctx, "t1/create", other, fp("b"))
	require.ErrorIs(t, err, idem.ErrFingerprint)
	rec, err := b.store.Get(ctx, "t1/create", other)
	require.NoError(t, err)
	require.True(t, rec.Fingerprint.Equal(fp("a")))
}

func testInProgressLiveLease[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 30 * time.Second, Now: clk.Now})
	key := newKey("lease")

	c, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, c.Acquired())

	clk.advance(12 * time.Second)
	_, err = b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.ErrorIs(t, err, idem.ErrInProgress)
	var ip *idem.InProgressError
	require.ErrorAs(t, err, &ip)
	require.Equal(t, 18*time.Second, ip.RetryAfter)
	require.False(t, ip.TxAborted)
	require.NotEmpty(t, ip.KeyDigest)

	// Do sees the same and never runs the callback.
	var calls counter
	_, err = b.store.Do(ctx, "t1/pay", key, fp("x"), orderFn(b.ns, key, &calls))
	require.ErrorIs(t, err, idem.ErrInProgress)
	require.Zero(t, calls.get())

	// Once completed, the next claim replays.
	require.NoError(t, b.store.Complete(ctx, c, orderResponse(key)))
	again, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, again.Acquired())
	requireSameResponse(t, orderResponse(key), again.Replay.Response)
}

func testScopesAreIndependent[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("shared")
	var calls counter

	a, err := b.store.Do(ctx, "tenant-a/create", key, fp("same"), orderFn(b.ns, "a-"+key, &calls))
	require.NoError(t, err)
	require.False(t, a.Replayed)
	bb, err := b.store.Do(ctx, "tenant-b/create", key, fp("same"), orderFn(b.ns, "b-"+key, &calls))
	require.NoError(t, err)
	require.False(t, bb.Replayed, "the same key in another scope is another record")
	require.Equal(t, 2, calls.get())

	ra, err := b.store.Do(ctx, "tenant-a/create", key, fp("same"), orderFn(b.ns, "a-"+key, &calls))
	require.NoError(t, err)
	require.True(t, ra.Replayed)
	requireSameResponse(t, orderResponse("a-"+key), ra.Response)
	rb, err := b.store.Do(ctx, "tenant-b/create", key, fp("same"), orderFn(b.ns, "b-"+key, &calls))
	require.NoError(t, err)
	require.True(t, rb.Replayed)
	requireSameResponse(t, orderResponse("b-"+key), rb.Response)
	require.Equal(t, 2, b.records(ctx, t))

	// A scope that is a prefix of another is still another scope.
	c, err := b.store.Claim(ctx, "tenant-a", key, fp("same"))
	require.NoError(t, err)
	require.True(t, c.Acquired())
}

func testOwnershipAndFencing[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	const scope = "t1/create"

	t.Run("CompleteTwice", func(t *testing.T) {
		key := newKey("twice")
		c, err := b.store.Claim(ctx, scope, key, fp("x"))
		require.NoError(t, err)
		require.NoError(t, b.store.Complete(ctx, c, orderResponse("first")))
		before, err := b.store.Get(ctx, scope, key)
		require.NoError(t, err)

		require.ErrorIs(t, b.store.Complete(ctx, c, orderResponse("second")), idem.ErrFenced)
		require.ErrorIs(t, b.store.Fail(ctx, c, orderResponse("third")), idem.ErrFenced)
		require.ErrorIs(t, b.store.Release(ctx, c), idem.ErrFenced)
		after, err := b.store.Get(ctx, scope, key)
		require.NoError(t, err)
		require.Equal(t, before, after)
	})

	t.Run("StaleToken", func(t *testing.T) {
		key := newKey("stale")
		c, err := b.store.Claim(ctx, scope, key, fp("x"))
		require.NoError(t, err)
		before, err := b.store.Get(ctx, scope, key)
		require.NoError(t, err)

		stale := *c
		stale.Token--
		require.ErrorIs(t, b.store.Complete(ctx, &stale, orderResponse("stale")), idem.ErrFenced)
		require.ErrorIs(t, b.store.Release(ctx, &stale), idem.ErrFenced)
		after, err := b.store.Get(ctx, scope, key)
		require.NoError(t, err)
		require.Equal(t, before, after)
		require.Equal(t, idem.StatusProcessing, after.Status)

		// The real holder still completes.
		require.NoError(t, b.store.Complete(ctx, c, orderResponse("real")))
	})

	t.Run("NeverClaimed", func(t *testing.T) {
		key := newKey("never")
		forged := &idem.Claim{Scope: scope, Key: key, Token: 1, Attempt: 1}
		require.ErrorIs(t, b.store.Complete(ctx, forged, orderResponse("x")), idem.ErrFenced)
		_, err := b.store.Get(ctx, scope, key)
		require.ErrorIs(t, err, idem.ErrNotFound)
	})

	t.Run("ReplayIsNotOwnership", func(t *testing.T) {
		key := newKey("replay-owner")
		c, err := b.store.Claim(ctx, scope, key, fp("x"))
		require.NoError(t, err)
		require.NoError(t, b.store.Complete(ctx, c, orderResponse("x")))
		replay, err := b.store.Claim(ctx, scope, key, fp("x"))
		require.NoError(t, err)
		require.ErrorIs(t, b.store.Complete(ctx, replay, orderResponse("y")), idem.ErrFenced)
		require.ErrorIs(t, b.store.Complete(ctx, nil, orderResponse("y")), idem.ErrFenced)
	})
}

func testReleaseFreesKey[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("release")

	c, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.store.Release(ctx, c))
	_, err = b.store.Get(ctx, "t1/pay", key)
	require.ErrorIs(t, err, idem.ErrNotFound)

	next, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, next.Acquired(), "a released key is acquired at once by the next claimer")
	require.ErrorIs(t, b.store.Complete(ctx, c, orderResponse("old")), idem.ErrFenced, "the released holder must not complete the new claim")
}

func testFailIsStoredAndReplayed[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("fail")

	c, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	declined := &idem.Response{StatusCode: 402, Body: []byte(`{"code":"card_declined"}`)}
	require.NoError(t, b.store.Fail(ctx, c, declined))

	again, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.False(t, again.Acquired())
	require.Equal(t, idem.StatusFailed, again.Replay.Status)
	require.Equal(t, 402, again.Replay.Response.StatusCode)
	require.Equal(t, declined.Body, again.Replay.Response.Body)
	require.Empty(t, again.Replay.Response.Header)

	// An empty body replays as empty, not as a missing response.
	k2 := newKey("empty")
	c2, err := b.store.Claim(ctx, "t1/pay", k2, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.store.Complete(ctx, c2, &idem.Response{StatusCode: 204}))
	r2, err := b.store.Claim(ctx, "t1/pay", k2, fp("x"))
	require.NoError(t, err)
	require.Equal(t, 204, r2.Replay.Response.StatusCode)
	require.Empty(t, r2.Replay.Response.Body)
}

func testKeysMatchLiterally[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	keys := []string{
		"'; DROP TABLE idempotency_keys; --",
		`" OR "1"="1`,
		`\'; DELETE FROM idempotency_keys WHERE '1'='1`,
		"100%",
		"1000",
		"a_c",
		"abc",
		"Key-Case",
		"key-case",
		"ключ-🔑-鍵",
		"trailing ",
		"trailing",
		`$1`,
		"?",
	}
	scopes := []string{"tenant'--/op", "tenant%/op", "tenant_/op"}
	for _, scope := range scopes {
		for i, key := range keys {
			c, err := b.store.Claim(ctx, scope, key, fp(key))
			require.NoError(t, err, "key #%d", i)
			require.True(t, c.Acquired(), "key #%d collided with another key", i)
			require.NoError(t, b.store.Complete(ctx, c, &idem.Response{StatusCode: 200, Body: []byte(scope + "|" + key)}))
		}
	}
	require.Equal(t, len(keys)*len(scopes), b.records(ctx, t))
	for _, scope := range scopes {
		for i, key := range keys {
			rec, err := b.store.Get(ctx, scope, key)
			require.NoError(t, err, "key #%d", i)
			require.Equal(t, key, rec.Key)
			require.Equal(t, scope, rec.Scope)
			require.Equal(t, []byte(scope+"|"+key), rec.Response.Body)
		}
	}
	// Pattern characters are not patterns.
	_, err := b.store.Get(ctx, "tenant%/op", "a%")
	require.ErrorIs(t, err, idem.ErrNotFound)
	_, err = b.store.Get(ctx, "tenant_/op", "a_")
	require.ErrorIs(t, err, idem.ErrNotFound)
}
