package conformance

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// The deferred claim is an optional interface of the Dialect
// (idem.DeferredClaimer, and its pipelined forms idem.DeferredTxPipeliner).
// Features says which dialects must have it, and the first case fails on a
// mismatch either way, so a dialect that loses it fails instead of
// skipping. The other cases take one clause of DeferredClaimer's doc
// comment each, on every path the dialect offers (unpiped, and pipelined
// where it pipelines).
func executorDeferredCases[TTx any]() []testCase[TTx] {
	deferred := func(f Features) bool { return f.DeferredClaims }
	return []testCase[TTx]{
		{name: "ExecutorDeferredInterfaces", run: testExecutorDeferredInterfaces[TTx]},
		{name: "ExecutorDeferredClaimFree", run: testExecutorDeferredClaimFree[TTx], applies: deferred},
		{name: "ExecutorDeferredClaimExisting", run: testExecutorDeferredClaimExisting[TTx], applies: deferred},
		{name: "ExecutorDeferredHoldsKey", run: testExecutorDeferredHoldsKey[TTx], applies: deferred},
		{name: "ExecutorDeferredWaitTimeout", run: testExecutorDeferredWaitTimeout[TTx], applies: deferred},
		{name: "ExecutorDeferredCompleteFenced", run: testExecutorDeferredCompleteFenced[TTx], applies: deferred},
	}
}

// testExecutorDeferredInterfaces: the dialect implements the optional
// interfaces Features says it must, and no others.
func testExecutorDeferredInterfaces[TTx any](t *testing.T, h Harness[TTx]) {
	_, b := exSetup(t, h)
	_, deferred := b.d.(idem.DeferredClaimer[TTx])
	require.Equal(t, b.feat.DeferredClaims, deferred, "Features.DeferredClaims against idem.DeferredClaimer")
	_, piped := b.d.(idem.TxPipeliner[TTx])
	require.Equal(t, b.feat.Pipelined, piped, "Features.Pipelined against idem.TxPipeliner")
	_, both := b.d.(idem.DeferredTxPipeliner[TTx])
	require.Equal(t, b.feat.DeferredClaims && b.feat.Pipelined, both, "idem.DeferredTxPipeliner")
}

// deferredPath is one way to run a deferred claim in a transaction of its
// own and to complete and commit it.
type deferredPath[TTx any] struct {
	name string
	// claim begins a transaction (rolled back when t ends unless finished)
	// and claims p in it.
	claim func(ctx context.Context, t *testing.T, p *idem.ClaimParams) (TTx, *idem.ClaimResult, error)
	// completeCommit completes the deferred claim in tx and commits tx; on
	// an error nothing is committed.
	completeCommit func(ctx context.Context, tx TTx, p *idem.CompleteDeferredParams) error
}

// deferredPaths returns the dialect's deferred claimer and its paths:
// Dialect.Begin, ClaimDeferred, CompleteDeferred and Commit; with
// Features.Pipelined also BeginClaimDeferred and CompleteDeferredCommit.
// It fails t when the dialect lacks an interface Features promises.
func (b *exBundle[TTx]) deferredPaths(t *testing.T) (idem.DeferredClaimer[TTx], []deferredPath[TTx]) {
	t.Helper()
	dc, ok := b.d.(idem.DeferredClaimer[TTx])
	require.True(t, ok, "Features.DeferredClaims: the dialect must implement idem.DeferredClaimer")
	paths := []deferredPath[TTx]{{
		name: "unpiped",
		claim: func(ctx context.Context, t *testing.T, p *idem.ClaimParams) (TTx, *idem.ClaimResult, error) {
			tx := b.begin(ctx, t)
			res, err := dc.ClaimDeferred(ctx, tx, p)
			return tx, res, err
		},
		completeCommit: func(ctx context.Context, tx TTx, p *idem.CompleteDeferredParams) error {
			if err := dc.CompleteDeferred(ctx, tx, p); err != nil {
				return err
			}
			return b.d.Commit(ctx, tx)
		},
	}}
	if !b.feat.Pipelined {
		return dc, paths
	}
	dp, ok := b.d.(idem.DeferredTxPipeliner[TTx])
	require.True(t, ok, "Features.Pipelined: the dialect must implement idem.DeferredTxPipeliner")
	return dc, append(paths, deferredPath[TTx]{
		name: "pipelined",
		claim: func(ctx context.Context, t *testing.T, p *idem.ClaimParams) (TTx, *idem.ClaimResult, error) {
			tx, res, err := dp.BeginClaimDeferred(ctx, p)
			t.Cleanup(func() { _ = b.d.Rollback(context.WithoutCancel(ctx), tx) })
			return tx, res, err
		},
		completeCommit: dp.CompleteDeferredCommit,
	})
}

// completeDeferredOf completes the deferred claim p, whose record (as the
// claim returned it) is rec, at now.
func completeDeferredOf(p *idem.ClaimParams, rec *idem.Record, now *time.Time) *idem.CompleteDeferredParams {
	return &idem.CompleteDeferredParams{
		CompleteParams: *completeOf(p, now),
		Fingerprint:    rec.Fingerprint, CreatedAt: rec.CreatedAt, LeaseExpiresAt: rec.LeaseExpiresAt,
	}
}

// testExecutorDeferredClaimFree: a deferred claim of a free key writes
// nothing, not even in its own transaction, and answers Created with the
// record its completion will insert; the completion inserts the finished
// record with the claim's token, fingerprint and times and the
// completion's, and commits it with the business row.
func testExecutorDeferredClaimFree[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	_, paths := b.deferredPaths(t)
	for _, path := range paths {
		p := claimArgs(newKey("deferred-" + path.name))
		p.Now = at(0)
		tx, res, err := path.claim(ctx, t, p)
		require.NoError(t, err, path.name)
		requireCreatedAt0(t, p, res, path.name)
		rec := res.Record
		_, err = b.d.Tx(tx).Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: &longAgo})
		require.ErrorIs(t, err, idem.ErrNotFound, "%s: a deferred claim writes nothing, even in its transaction", path.name)
		require.False(t, b.exists(ctx, t, p.Key), path.name)
		require.NoError(t, b.ns.InsertOrder(ctx, tx, p.Key))

		c := completeDeferredOf(p, rec, at(time.Second))
		require.NoError(t, path.completeCommit(ctx, tx, c), path.name)
		requireFinishedAt1s(t, b.record(ctx, t, p), p, c, path.name)
		n, err := b.ns.CountOrders(ctx, p.Key)
		require.NoError(t, err)
		require.Equal(t, 1, n, "%s: the business row committed with the record", path.name)
	}
}

// requireCreatedAt0 asserts that res is a deferred or optimistic claim of
// p's free key at exClock: Created, with the record its completion will
// insert.
func requireCreatedAt0(t *testing.T, p *idem.ClaimParams, res *idem.ClaimResult, what string) {
	t.Helper()
	require.True(t, res.Created, what)
	require.Equal(t, exClock, res.Now, what)
	rec := res.Record
	require.Equal(t, p.Scope, rec.Scope, what)
	require.Equal(t, p.Key, rec.Key, what)
	require.Equal(t, p.Token, rec.Token, what)
	require.True(t, rec.Fingerprint.Equal(p.Fingerprint), what)
	require.Equal(t, idem.StatusProcessing, rec.Status, what)
	require.Equal(t, 1, rec.Attempt, what)
	require.Equal(t, exClock, rec.CreatedAt, what)
	require.Equal(t, exClock.Add(p.LeaseDuration), rec.LeaseExpiresAt, what)
	require.Equal(t, exClock.Add(p.Retention), rec.ExpiresAt, what)
}

// requireFinishedAt1s asserts that done is the record the completion c of
// the claim p, made one second after exClock, inserted: the claim's token,
// fingerprint, creation time and lease, the completion's times, retention
// and response.
func requireFinishedAt1s(t *testing.T, done *idem.Record, p *idem.ClaimParams, c *idem.CompleteDeferredParams, what string) {
	t.Helper()
	require.Equal(t, idem.StatusSucceeded, done.Status, what)
	require.Equal(t, p.Token, done.Token, what)
	require.True(t, done.Fingerprint.Equal(p.Fingerprint), what)
	require.Equal(t, 1, done.Attempt, what)
	require.Equal(t, exClock, done.CreatedAt, "%s: the claim's time, not the completion's", what)
	require.Equal(t, exClock.Add(p.LeaseDuration), done.LeaseExpiresAt, what)
	require.Equal(t, exClock.Add(time.Second), done.CompletedAt, what)
	require.Equal(t, exClock.Add(time.Second), done.UpdatedAt, what)
	require.Equal(t, exClock.Add(time.Second+c.Retention), done.ExpiresAt, what)
	require.Equal(t, c.Response.StatusCode, done.Response.StatusCode, what)
	require.Equal(t, []byte("done"), done.Response.Body, what)
}

// testExecutorDeferredClaimExisting: a deferred claim of a key with a
// record returns the record as it is, Created false, live or expired.
func testExecutorDeferredClaimExisting[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	_, paths := b.deferredPaths(t)
	for _, path := range paths {
		for _, expired := range []bool{false, true} {
			retention, now := time.Hour, at(time.Minute)
			if expired {
				retention = time.Second
			}
			seeded := b.seedCompleted(ctx, t, newKey("deferred-existing-"+path.name), exClock, retention)
			want := b.record(ctx, t, seeded)
			p := claimArgs(seeded.Key)
			p.Now = now
			tx, res, err := path.claim(ctx, t, p)
			require.NoError(t, err, path.name)
			require.False(t, res.Created, "%s expired=%v", path.name, expired)
			require.Equal(t, want, res.Record, "%s expired=%v: returned as it is", path.name, expired)
			require.Equal(t, *now, res.Now)
			require.NoError(t, b.d.Rollback(ctx, tx))
			require.Equal(t, want, b.record(ctx, t, seeded), "unchanged")
		}
	}
}

// testExecutorDeferredHoldsKey: while a deferred claim's transaction is
// open, a claim of the key on the pool and another deferred claim wait for
// it and create nothing; when it commits they see its record, and when it
// rolls back the key is free.
func testExecutorDeferredHoldsKey[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	dc, paths := b.deferredPaths(t)
	for _, path := range paths {
		for _, commit := range []bool{true, false} {
			p := claimArgs(newKey("deferred-held-" + path.name))
			holder, res, err := path.claim(ctx, t, p)
			require.NoError(t, err)
			require.True(t, res.Created)

			type answer struct {
				res *idem.ClaimResult
				err error
			}
			onPool, deferred := make(chan answer, 1), make(chan answer, 1)
			poolWaiter := claimArgs(p.Key)
			go func() {
				res, err := b.ex.Claim(ctx, poolWaiter)
				onPool <- answer{res, err}
			}()
			if commit { // with a rollback, which waiter gets the key is a race
				go func() {
					tx, err := b.d.Begin(ctx)
					if err != nil {
						deferred <- answer{nil, err}
						return
					}
					defer func() { _ = b.d.Rollback(context.WithoutCancel(ctx), tx) }()
					res, err := dc.ClaimDeferred(ctx, tx, claimArgs(p.Key))
					deferred <- answer{res, err}
				}()
			}
			select {
			case a := <-onPool:
				t.Fatalf("%s: a pool claim returned while the deferred claim's transaction was open: %+v", path.name, a)
			case a := <-deferred:
				t.Fatalf("%s: a deferred claim returned while another held the key: %+v", path.name, a)
			case <-time.After(300 * time.Millisecond):
			}
			require.False(t, b.exists(ctx, t, p.Key), "%s: nothing created while the holder is open", path.name)
			if !commit {
				require.NoError(t, b.d.Rollback(ctx, holder))
				a := <-onPool
				require.NoError(t, a.err)
				require.True(t, a.res.Created, "%s: the holder rolled back, the key is free", path.name)
				require.Equal(t, poolWaiter.Token, b.record(ctx, t, p).Token)
				continue
			}
			require.NoError(t, path.completeCommit(ctx, holder, completeDeferredOf(p, res.Record, nil)))
			for _, ch := range []chan answer{onPool, deferred} {
				a := <-ch
				require.NoError(t, a.err, path.name)
				require.False(t, a.res.Created, "%s: the holder committed its record", path.name)
				require.Equal(t, p.Token, a.res.Record.Token)
				require.Equal(t, idem.StatusSucceeded, a.res.Record.Status, "%s: seen as the holder committed it", path.name)
			}
		}
	}
}

// testExecutorDeferredWaitTimeout: a claim that waits for a deferred
// claim's transaction past its WaitTimeout fails as a wait of Claim does
// (on a single writer the pool's claim finds the database busy), and
// nothing is created.
func testExecutorDeferredWaitTimeout[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	dc, paths := b.deferredPaths(t)
	for _, path := range paths {
		p := claimArgs(newKey("deferred-timeout-" + path.name))
		holder, res, err := path.claim(ctx, t, p)
		require.NoError(t, err)
		require.True(t, res.Created)

		waiter := claimArgs(p.Key)
		waiter.WaitTimeout = b.feat.WaitGranularity
		_, err = b.ex.Claim(ctx, waiter)
		if b.feat.SingleWriter {
			require.ErrorIs(t, err, idem.ErrStoreUnavailable, "%s: the database is busy", path.name)
		} else {
			var ip *idem.InProgressError
			require.ErrorAs(t, err, &ip, path.name)
			require.False(t, ip.TxAborted, "the pool's claim has no caller transaction")

			tx := b.begin(ctx, t)
			start := time.Now()
			_, err = dc.ClaimDeferred(ctx, tx, waiter)
			require.ErrorAs(t, err, &ip, path.name)
			require.Equal(t, b.feat.WaitAbortsTx, ip.TxAborted, path.name)
			require.GreaterOrEqual(t, time.Since(start), waiter.WaitTimeout-50*time.Millisecond)
			require.NoError(t, b.d.Rollback(ctx, tx))
		}
		require.NoError(t, b.d.Rollback(ctx, holder))
		require.False(t, b.exists(ctx, t, p.Key), "%s: no waiter created a record", path.name)
	}
}

// testExecutorDeferredCompleteFenced: a deferred completion that finds a
// record of the key (written by a claimer that does not take the key's
// lock) leaves it alone, returns ErrFenced and commits nothing, the
// business row included.
func testExecutorDeferredCompleteFenced[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	_, paths := b.deferredPaths(t)
	for _, path := range paths {
		seeded := b.seedCompleted(ctx, t, newKey("deferred-fenced-"+path.name), exClock, time.Hour)
		want := b.record(ctx, t, seeded)
		p := claimArgs(seeded.Key)
		p.Now = at(time.Minute)
		tx, res, err := path.claim(ctx, t, p)
		require.NoError(t, err)
		require.False(t, res.Created)
		require.NoError(t, b.ns.InsertOrder(ctx, tx, p.Key))
		late := &idem.Record{Fingerprint: p.Fingerprint, CreatedAt: exClock.Add(time.Minute), LeaseExpiresAt: exClock.Add(2 * time.Minute)}
		require.ErrorIs(t, path.completeCommit(ctx, tx, completeDeferredOf(p, late, at(2*time.Minute))), idem.ErrFenced, path.name)
		require.NoError(t, b.d.Rollback(ctx, tx), "a rollback after the fenced completion is harmless")
		require.Equal(t, want, b.record(ctx, t, seeded), "%s: the existing record is left alone", path.name)
		n, err := b.ns.CountOrders(ctx, p.Key)
		require.NoError(t, err)
		require.Zero(t, n, "%s: nothing committed", path.name)
	}
}
