package conformance

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// The deferred claim (ClaimParams.Defer, CompleteParams.Insert) is one
// case in one file, so that it moves as a whole when the mode becomes an
// optional interface of its own.
func executorDeferredCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "ExecutorDeferredClaim", run: testExecutorDeferredClaim[TTx]},
	}
}

// testExecutorDeferredClaim: in a transaction of Dialect.Begin, a claim
// with Defer of a free key either writes nothing and reports Deferred (the
// completion with Insert then writes the finished record, with the claim's
// token, fingerprint and times) or, on a dialect without the mode, claims
// as usual. A key with a record is read as by any claim; and an Insert that
// finds a record written meanwhile is fenced and leaves it alone.
func testExecutorDeferredClaim[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	p := claimArgs(newKey("deferred"))
	p.Defer, p.Now = true, at(0)
	tx := b.begin(ctx, t)
	res, err := b.d.Tx(tx).Claim(ctx, p)
	require.NoError(t, err)
	require.True(t, res.Created)
	rec := res.Record
	require.Equal(t, p.Token, rec.Token)
	require.True(t, rec.Fingerprint.Equal(p.Fingerprint))
	require.Equal(t, idem.StatusProcessing, rec.Status)
	require.Equal(t, exClock, rec.CreatedAt)
	require.Equal(t, exClock.Add(p.LeaseDuration), rec.LeaseExpiresAt)
	require.Equal(t, exClock.Add(p.Retention), rec.ExpiresAt)
	require.False(t, b.exists(ctx, t, p.Key), "nothing committed yet")

	c := completeOf(p, at(time.Second))
	if res.Deferred {
		_, err := b.d.Tx(tx).Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: at(0)})
		require.ErrorIs(t, err, idem.ErrNotFound, "a deferred claim writes nothing")
		c.Insert, c.Fingerprint, c.CreatedAt, c.LeaseExpiresAt = true, rec.Fingerprint, rec.CreatedAt, rec.LeaseExpiresAt
	} else {
		got, err := b.d.Tx(tx).Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: at(0)})
		require.NoError(t, err, "without the mode the claim wrote its record")
		require.Equal(t, rec, got)
	}
	require.NoError(t, b.d.Tx(tx).Complete(ctx, c))
	require.NoError(t, b.d.Commit(ctx, tx))
	done := b.record(ctx, t, p)
	require.Equal(t, idem.StatusSucceeded, done.Status)
	require.Equal(t, p.Token, done.Token)
	require.True(t, done.Fingerprint.Equal(p.Fingerprint))
	require.Equal(t, 1, done.Attempt)
	require.Equal(t, exClock, done.CreatedAt)
	require.Equal(t, exClock.Add(p.LeaseDuration), done.LeaseExpiresAt)
	require.Equal(t, exClock.Add(time.Second), done.CompletedAt)
	require.Equal(t, exClock.Add(time.Second+c.Retention), done.ExpiresAt)
	require.Equal(t, []byte("done"), done.Response.Body)

	// A key with a record: read as by any claim, never deferred.
	again := *p
	again.Token = exTokens.Add(1)
	tx = b.begin(ctx, t)
	res, err = b.d.Tx(tx).Claim(ctx, &again)
	require.NoError(t, err)
	require.False(t, res.Created)
	require.False(t, res.Deferred)
	require.Equal(t, done, res.Record)
	if !c.Insert {
		return // the dialect never asks for an Insert
	}
	// An Insert for a key whose record exists (written by a claimer that
	// took no lock, such as an older idem) is fenced.
	late := *c
	late.Token, late.Now = again.Token, at(time.Minute)
	require.ErrorIs(t, b.d.Tx(tx).Complete(ctx, &late), idem.ErrFenced)
	require.NoError(t, b.d.Rollback(ctx, tx))
	require.Equal(t, done, b.record(ctx, t, p), "the existing record is left alone")
}
