package conformance

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// The operations API (idem.Operator through Store.Check, Lookup,
// LookupDigest, Delete, PurgeScope, ReleaseLease and Stats).
func opsCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "OpsCheckMigrated", run: testOpsCheckMigrated[TTx]},
		{name: "OpsCheckUnreachable", run: testOpsCheckUnreachable[TTx]},
		{name: "OpsLookupEveryState", run: testOpsLookupEveryState[TTx]},
		{name: "OpsLookupDigestEveryWritePath", run: testOpsLookupDigestEveryWritePath[TTx]},
		{name: "OpsDeleteRefusesLiveLease", run: testOpsDeleteRefusesLiveLease[TTx]},
		{name: "OpsPurgeScope", run: testOpsPurgeScope[TTx]},
		{name: "OpsReleaseLeaseFenced", run: testOpsReleaseLeaseFenced[TTx]},
		{name: "OpsStatsCountsTable", run: testOpsStatsCountsTable[TTx]},
	}
}

func testOpsCheckMigrated[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	require.NoError(t, b.store.Check(ctx), "a namespace migrated by the harness is ready")
	require.Equal(t, 0, b.records(ctx, t), "Check writes nothing")
}

func testOpsCheckUnreachable[TTx any](t *testing.T, h Harness[TTx]) {
	ctx := t.Context()
	store, err := idem.New(h.Unreachable(ctx, t), &idem.Config{WaitTimeout: time.Second})
	require.NoError(t, err)
	cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	err = store.Check(cctx)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	require.NotErrorIs(t, err, idem.ErrNotReady)
}

func testOpsLookupEveryState[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 10 * time.Second, Retention: time.Hour, Now: clk.Now})
	scope := "ops/lookup"
	kOK, kFail, kProc := newKey("ok"), newKey("fail"), newKey("proc")
	var calls counter
	_, err := b.store.Do(ctx, scope, kOK, fp("a"), orderFn(b.ns, kOK, &calls))
	require.NoError(t, err)
	declined := &idem.Response{StatusCode: http.StatusPaymentRequired, Header: http.Header{}, Body: []byte("declined")}
	_, err = b.store.Do(ctx, scope, kFail, fp("b"), func(context.Context, TTx) (*idem.Response, error) {
		return nil, idem.FinalFailure(declined)
	})
	require.NoError(t, err)
	held, err := b.store.Claim(ctx, scope, kProc, fp("c"))
	require.NoError(t, err)

	rec, err := b.store.Lookup(ctx, scope, kOK)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
	requireSameResponse(t, orderResponse(kOK), rec.Response)
	rec, err = b.store.Lookup(ctx, scope, kFail)
	require.NoError(t, err)
	require.Equal(t, idem.StatusFailed, rec.Status)
	require.Equal(t, declined.Body, rec.Response.Body)
	rec, err = b.store.Lookup(ctx, scope, kProc)
	require.NoError(t, err)
	require.Equal(t, idem.StatusProcessing, rec.Status)
	require.Equal(t, held.Token, rec.Token, "Lookup shows the token ReleaseLease is fenced by")
	require.Nil(t, rec.Response)

	_, err = b.store.Lookup(ctx, scope, newKey("absent"))
	require.ErrorIs(t, err, idem.ErrNotFound)
	_, err = b.store.Lookup(ctx, scope, "")
	require.ErrorIs(t, err, idem.ErrInvalidKey)

	clk.advance(2 * time.Hour)
	_, err = b.store.Get(ctx, scope, kOK)
	require.ErrorIs(t, err, idem.ErrNotFound, "Get hides a record past retention")
	rec, err = b.store.Lookup(ctx, scope, kOK)
	require.NoError(t, err, "Lookup shows a record awaiting the reaper")
	require.False(t, rec.ExpiresAt.After(clk.Now()))
}

func testOpsLookupDigestEveryWritePath[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{Now: clk.Now})
	type named struct{ scope, key string }
	var all []named
	var calls counter

	// Do: deferred on PostgreSQL and SQLite (the completion inserts).
	n := named{"acme POST /orders", newKey("do")}
	_, err := b.store.Do(ctx, n.scope, n.key, fp("do"), orderFn(b.ns, n.key, &calls))
	require.NoError(t, err)
	all = append(all, n)
	// Claim on the pool, then complete.
	n = named{"acme POST /payments", newKey("claim")}
	c, err := b.store.Claim(ctx, n.scope, n.key, fp("claim"))
	require.NoError(t, err)
	require.NoError(t, b.store.Complete(ctx, c, orderResponse("x")))
	all = append(all, n)
	// ClaimTx in a caller's transaction, completed there (deferred on
	// PostgreSQL and SQLite: the completion inserts).
	n = named{"globex POST /orders", newKey("claimtx")}
	tx := b.begin(ctx, t)
	c, err = b.store.ClaimTx(ctx, tx, n.scope, n.key, fp("tx"))
	require.NoError(t, err)
	require.NoError(t, b.store.CompleteTx(ctx, tx, c, orderResponse("tx")))
	require.NoError(t, b.ns.Dialect.Commit(ctx, tx))
	all = append(all, n)
	// Acquire on the pool, left processing.
	n = named{"globex POST /refunds", newKey("acquire")}
	_, err = b.store.Acquire(ctx, n.scope, n.key, fp("acquire"))
	require.NoError(t, err)
	all = append(all, n)
	// The same key in another scope is another record with another digest.
	n = named{"globex POST /payments", all[0].key}
	_, err = b.store.Claim(ctx, n.scope, n.key, fp("other"))
	require.NoError(t, err)
	all = append(all, n)
	// Rows bulk-inserted without idem's claim statements (as by an older idem).
	require.NoError(t, b.ns.SeedExpired(ctx, 3, clk.Now().Add(time.Hour)))
	all = append(all, named{"seed", "seed-1"})

	for _, n := range all {
		d := idem.KeyDigest(n.scope, n.key)
		for _, form := range []string{d, strings.ToUpper(d)} {
			recs, err := b.store.LookupDigest(ctx, form)
			require.NoError(t, err, "digest of %q", n.key)
			require.Len(t, recs, 1)
			require.Equal(t, n.scope, recs[0].Scope)
			require.Equal(t, n.key, recs[0].Key)
		}
	}

	_, err = b.store.LookupDigest(ctx, "0123456789abcdef")
	require.ErrorIs(t, err, idem.ErrNotFound)
	for _, bad := range []string{"", "0123", "0123456789abcdeg", "0123456789abcdef0", " 123456789abcdef"} {
		_, err = b.store.LookupDigest(ctx, bad)
		require.ErrorIs(t, err, idem.ErrInvalidDigest, "%q", bad)
	}
}

func testOpsDeleteRefusesLiveLease[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 10 * time.Second, Now: clk.Now})
	scope := "ops/delete"
	var calls counter

	done := newKey("done")
	_, err := b.store.Do(ctx, scope, done, fp("a"), orderFn(b.ns, done, &calls))
	require.NoError(t, err)
	require.NoError(t, b.store.Delete(ctx, scope, done, nil))
	_, err = b.store.Lookup(ctx, scope, done)
	require.ErrorIs(t, err, idem.ErrNotFound)
	require.ErrorIs(t, b.store.Delete(ctx, scope, done, nil), idem.ErrNotFound)

	live := newKey("live")
	held, err := b.store.Claim(ctx, scope, live, fp("b"))
	require.NoError(t, err)
	err = b.store.Delete(ctx, scope, live, nil)
	require.ErrorIs(t, err, idem.ErrLeaseLive)
	require.NotContains(t, err.Error(), live, "errors carry the digest, not the key")
	require.Contains(t, err.Error(), idem.KeyDigest(scope, live))
	rec, err := b.store.Lookup(ctx, scope, live)
	require.NoError(t, err, "a refused delete deletes nothing")
	require.Equal(t, held.Token, rec.Token)

	require.ErrorIs(t, b.store.Delete(ctx, scope, live, &idem.DeleteOptions{Force: true, Token: held.Token + 1}), idem.ErrFenced)
	require.NoError(t, b.store.Delete(ctx, scope, live, &idem.DeleteOptions{Force: true, Token: held.Token}))
	require.ErrorIs(t, b.store.Complete(ctx, held, orderResponse("late")), idem.ErrFenced,
		"the holder of a force-deleted record cannot complete it")
	require.Equal(t, 0, b.records(ctx, t))

	stale := newKey("stale")
	_, err = b.store.Claim(ctx, scope, stale, fp("c"))
	require.NoError(t, err)
	clk.advance(11 * time.Second)
	require.NoError(t, b.store.Delete(ctx, scope, stale, nil), "a lease that ran out needs no force")
	require.Equal(t, 0, b.records(ctx, t))
}

func testOpsPurgeScope[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 10 * time.Second, Now: clk.Now})
	var calls counter
	for range 2 {
		k := newKey("a")
		_, err := b.store.Do(ctx, "ops/a", k, fp(k), orderFn(b.ns, k, &calls))
		require.NoError(t, err)
	}
	_, err := b.store.Claim(ctx, "ops/a", newKey("live"), fp("live"))
	require.NoError(t, err)
	other := newKey("b")
	_, err = b.store.Do(ctx, "ops/b", other, fp(other), orderFn(b.ns, other, &calls))
	require.NoError(t, err)

	n, err := b.store.PurgeScope(ctx, "ops/a", nil)
	require.NoError(t, err)
	require.Equal(t, 2, n, "the live lease is kept without force")
	require.Equal(t, 2, b.records(ctx, t))
	n, err = b.store.PurgeScope(ctx, "ops/a", &idem.DeleteOptions{Force: true})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	_, err = b.store.Lookup(ctx, "ops/b", other)
	require.NoError(t, err, "another scope is untouched")

	// More than one batch.
	require.NoError(t, b.ns.SeedExpired(ctx, 1234, clk.Now().Add(time.Hour)))
	n, err = b.store.PurgeScope(ctx, "seed", nil)
	require.NoError(t, err)
	require.Equal(t, 1234, n)
	require.Equal(t, 1, b.records(ctx, t))
	_, err = b.store.PurgeScope(ctx, "", nil)
	require.ErrorIs(t, err, idem.ErrInvalidScope)
}

func testOpsReleaseLeaseFenced[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: time.Hour})
	scope, key := "ops/release", newKey("stuck")
	held, err := b.store.Claim(ctx, scope, key, fp("pay"))
	require.NoError(t, err)

	// Still in progress for everyone else: the holder is stuck.
	_, err = b.store.Claim(ctx, scope, key, fp("pay"))
	require.ErrorIs(t, err, idem.ErrInProgress)

	require.ErrorIs(t, b.store.ReleaseLease(ctx, scope, key, held.Token+1), idem.ErrFenced)
	_, err = b.store.Lookup(ctx, scope, key)
	require.NoError(t, err, "a fenced release deletes nothing")
	require.NoError(t, b.store.ReleaseLease(ctx, scope, key, held.Token))

	var calls counter
	res, err := b.store.Do(ctx, scope, key, fp("pay"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.False(t, res.Replayed)
	require.Equal(t, 1, calls.get(), "the next retry runs")
	require.ErrorIs(t, b.store.Complete(ctx, held, orderResponse("late")), idem.ErrFenced)

	rec, err := b.store.Lookup(ctx, scope, key)
	require.NoError(t, err)
	require.ErrorIs(t, b.store.ReleaseLease(ctx, scope, key, rec.Token), idem.ErrFenced, "a completed record is never released")
	require.ErrorIs(t, b.store.ReleaseLease(ctx, scope, newKey("absent"), 1), idem.ErrFenced)
}

func testOpsStatsCountsTable[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 10 * time.Second, Retention: time.Hour, Now: clk.Now})
	empty, err := b.store.Stats(ctx)
	require.NoError(t, err)
	require.Equal(t, idem.Stats{Now: clk.Now()}, *empty)

	var calls counter
	start := clk.Now()
	_, err = b.store.Claim(ctx, "ops/stats", newKey("stale"), fp("s"))
	require.NoError(t, err)
	clk.advance(20 * time.Second)
	for range 2 {
		k := newKey("ok")
		_, err = b.store.Do(ctx, "ops/stats", k, fp(k), orderFn(b.ns, k, &calls))
		require.NoError(t, err)
	}
	_, err = b.store.Do(ctx, "ops/stats", newKey("fail"), fp("f"), func(context.Context, TTx) (*idem.Response, error) {
		return nil, idem.FinalFailure(&idem.Response{StatusCode: http.StatusConflict})
	})
	require.NoError(t, err)
	_, err = b.store.Claim(ctx, "ops/stats", newKey("live"), fp("l"))
	require.NoError(t, err)
	require.NoError(t, b.ns.SeedExpired(ctx, 5, clk.Now().Add(-time.Minute)))

	st, err := b.store.Stats(ctx)
	require.NoError(t, err)
	require.Equal(t, idem.Stats{
		Now:              clk.Now(),
		Total:            10,
		Processing:       2,
		Succeeded:        7,
		Failed:           1,
		LiveLeases:       1,
		StaleLeases:      1,
		Expired:          5,
		OldestProcessing: start,
	}, *st)
	n, err := b.ns.CountRecords(ctx)
	require.NoError(t, err)
	require.EqualValues(t, n, st.Total)

	rep, err := mustReaper(t, b.store).RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 5, rep.Deleted)
	st, err = b.store.Stats(ctx)
	require.NoError(t, err)
	require.Zero(t, st.Expired, "the reaper cleared its backlog")
	require.EqualValues(t, 5, st.Total)
}

func mustReaper[TTx any](t *testing.T, s *idem.Store[TTx]) *idem.Reaper[TTx] {
	t.Helper()
	r, err := idem.NewReaper(s, nil)
	require.NoError(t, err)
	return r
}
