package conformance

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// executorOptimisticCases test idem.OptimisticClaimer, clause by clause of
// its doc comment, on dialects that Features says answer with it; the
// first case checks, on every dialect, that one that does not answers
// idem.ErrSkipDefer and begins nothing.
func executorOptimisticCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "ExecutorOptimisticInterface", run: testExecutorOptimisticInterface[TTx]},
		{name: "ExecutorOptimisticClaimFree", run: testExecutorOptimisticClaimFree[TTx], applies: optimisticDo},
		{name: "ExecutorOptimisticClaimExisting", run: testExecutorOptimisticClaimExisting[TTx], applies: optimisticDo},
		{name: "ExecutorOptimisticCompleteFenced", run: testExecutorOptimisticCompleteFenced[TTx], applies: optimisticDo},
		{name: "ExecutorOptimisticCompleteWaits", run: testExecutorOptimisticCompleteWaits[TTx], applies: concurrentOptimistic},
	}
}

// concurrentOptimistic selects optimistic dialects whose transactions can
// hold a key uncommitted while another writes.
func concurrentOptimistic(f Features) bool { return f.OptimisticDo && !f.SingleWriter }

// optimistic returns the dialect's OptimisticClaimer, failing t when it has
// none.
func (b *exBundle[TTx]) optimistic(t *testing.T) idem.OptimisticClaimer[TTx] {
	t.Helper()
	oc, ok := b.d.(idem.OptimisticClaimer[TTx])
	require.True(t, ok, "Features.OptimisticDo: the dialect must implement idem.OptimisticClaimer")
	return oc
}

// beginOptimistic runs BeginClaimOptimistic, rolling its transaction back
// when t ends unless the case finished it.
func (b *exBundle[TTx]) beginOptimistic(ctx context.Context, t *testing.T, p *idem.ClaimParams) (TTx, *idem.ClaimResult, error) {
	t.Helper()
	tx, res, err := b.optimistic(t).BeginClaimOptimistic(ctx, p)
	t.Cleanup(func() { _ = b.d.Rollback(context.WithoutCancel(ctx), tx) })
	return tx, res, err
}

func testExecutorOptimisticInterface[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	oc, ok := b.d.(idem.OptimisticClaimer[TTx])
	if b.feat.OptimisticDo {
		require.True(t, ok, "Features.OptimisticDo: the dialect must implement idem.OptimisticClaimer")
		return
	}
	if !ok {
		return
	}
	tx, res, err := oc.BeginClaimOptimistic(ctx, claimArgs(newKey("optimistic-off")))
	require.ErrorIs(t, err, idem.ErrSkipDefer, "a dialect not set up for optimistic claims must skip them")
	require.Nil(t, res)
	var zero TTx
	require.Equal(t, zero, tx, "a skipped optimistic claim begins nothing")
}

// testExecutorOptimisticClaimFree: the claim of a free key writes nothing
// and answers Created with the record its completion inserts; the
// completion inserts the finished record with the claim's token,
// fingerprint and times and the completion's, and commits it with the
// business row.
func testExecutorOptimisticClaimFree[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	oc := b.optimistic(t)
	p := claimArgs(newKey("optimistic-free"))
	p.Now = at(0)
	tx, res, err := b.beginOptimistic(ctx, t, p)
	require.NoError(t, err)
	requireCreatedAt0(t, p, res, "optimistic")
	rec := res.Record
	_, err = b.d.Tx(tx).Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: &longAgo})
	require.ErrorIs(t, err, idem.ErrNotFound, "an optimistic claim writes nothing, even in its transaction")

	// Nothing is locked: a pool claim of the key acquires at once, and
	// releases it again.
	other := claimArgs(p.Key)
	other.WaitTimeout = 0
	got, err := b.ex.Claim(ctx, other)
	require.NoError(t, err)
	require.True(t, got.Created, "an optimistic claim must hold no lock on the key")
	require.NoError(t, b.ex.Release(ctx, &idem.ReleaseParams{Scope: p.Scope, Key: p.Key, Token: other.Token}))

	require.NoError(t, b.ns.InsertOrder(ctx, tx, p.Key))
	c := completeDeferredOf(p, rec, at(time.Second))
	c.WaitTimeout = time.Second
	require.NoError(t, oc.CompleteOptimisticCommit(ctx, tx, c))
	requireFinishedAt1s(t, b.record(ctx, t, p), p, c, "optimistic")
	n, err := b.ns.CountOrders(ctx, p.Key)
	require.NoError(t, err)
	require.Equal(t, 1, n, "the business row committed with the record")
}

// testExecutorOptimisticClaimExisting: the claim of a key with a record
// returns the record as it is, Created false, live or expired.
func testExecutorOptimisticClaimExisting[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	for _, expired := range []bool{false, true} {
		retention, now := time.Hour, at(time.Minute)
		if expired {
			retention = time.Second
		}
		seeded := b.seedCompleted(ctx, t, newKey("optimistic-existing"), exClock, retention)
		want := b.record(ctx, t, seeded)
		p := claimArgs(seeded.Key)
		p.Now = now
		tx, res, err := b.beginOptimistic(ctx, t, p)
		require.NoError(t, err)
		require.False(t, res.Created, "expired=%v", expired)
		require.Equal(t, want, res.Record, "expired=%v: returned as it is", expired)
		require.Equal(t, *now, res.Now)
		require.NoError(t, b.d.Rollback(ctx, tx))
		require.Equal(t, want, b.record(ctx, t, seeded), "unchanged")
	}
}

// testExecutorOptimisticCompleteFenced: when the key's record was committed
// after the claim read it as free, the completion returns ErrFenced and
// commits nothing, the business row included; the record is untouched.
func testExecutorOptimisticCompleteFenced[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	oc := b.optimistic(t)
	p := claimArgs(newKey("optimistic-fenced"))
	tx, res, err := b.beginOptimistic(ctx, t, p)
	require.NoError(t, err)
	require.True(t, res.Created)

	first := claimArgs(p.Key)
	got, err := b.ex.Claim(ctx, first)
	require.NoError(t, err)
	require.True(t, got.Created)
	want := b.record(ctx, t, first)

	require.NoError(t, b.ns.InsertOrder(ctx, tx, p.Key))
	c := completeDeferredOf(p, res.Record, nil)
	c.WaitTimeout = time.Second
	err = oc.CompleteOptimisticCommit(ctx, tx, c)
	require.ErrorIs(t, err, idem.ErrFenced)
	require.NoError(t, b.d.Rollback(ctx, tx))
	require.Equal(t, want, b.record(ctx, t, first), "the first claimer's record is untouched")
	n, err := b.ns.CountOrders(ctx, p.Key)
	require.NoError(t, err)
	require.Zero(t, n, "a fenced completion commits nothing")
}

// testExecutorOptimisticCompleteWaits: a completion that meets the key
// written by an open transaction waits for it: past WaitTimeout it returns
// an *InProgressError and commits nothing; when the writer commits within
// it, ErrFenced; when the writer rolls back, the completion commits.
func testExecutorOptimisticCompleteWaits[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	oc := b.optimistic(t)
	for _, end := range []string{"timeout", "commit", "rollback"} {
		p := claimArgs(newKey("optimistic-wait-" + end))
		tx, res, err := b.beginOptimistic(ctx, t, p)
		require.NoError(t, err)
		require.True(t, res.Created)

		writer := b.begin(ctx, t)
		got, err := b.d.Tx(writer).Claim(ctx, claimArgs(p.Key))
		require.NoError(t, err)
		require.True(t, got.Created)

		c := completeDeferredOf(p, res.Record, nil)
		c.WaitTimeout = time.Second
		if end != "timeout" {
			c.WaitTimeout = 10 * time.Second
		}
		errc := make(chan error, 1)
		start := time.Now()
		go func() { errc <- oc.CompleteOptimisticCommit(ctx, tx, c) }()
		switch end {
		case "timeout":
			err = <-errc
			var ip *idem.InProgressError
			require.ErrorAs(t, err, &ip, end)
			require.GreaterOrEqual(t, time.Since(start), 900*time.Millisecond, "it must wait for the writer")
			require.NoError(t, b.d.Rollback(ctx, tx))
			require.NoError(t, b.d.Rollback(ctx, writer))
			require.False(t, b.exists(ctx, t, p.Key), "nothing committed")
			continue
		case "commit":
			time.Sleep(300 * time.Millisecond)
			require.NoError(t, b.d.Commit(ctx, writer))
			err = <-errc
			require.ErrorIs(t, err, idem.ErrFenced, end)
			require.NoError(t, b.d.Rollback(ctx, tx))
			require.Equal(t, got.Record.Token, b.record(ctx, t, p).Token, "the writer's record stands")
		case "rollback":
			time.Sleep(300 * time.Millisecond)
			require.NoError(t, b.d.Rollback(ctx, writer))
			err = <-errc
			require.NoError(t, err, end)
			require.Equal(t, idem.StatusSucceeded, b.record(ctx, t, p).Status)
			require.Equal(t, p.Token, b.record(ctx, t, p).Token)
		}
	}
}
