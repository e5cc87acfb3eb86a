package conformance

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// The executor cases call idem.Executor directly, one clause of its
// contract (see dialect.go) at a time, below the Store's decisions: what
// every dialect must do for the Store to be right. They run on the
// database's clock only where that clock is the point; elsewhere on
// exClock, a pinned instant years away from the server's, so that only the
// pinned times decide.
func executorCases[TTx any]() []testCase[TTx] {
	var all []testCase[TTx]
	all = append(all, []testCase[TTx]{
		{name: "ExecutorClaimInsertsOrReturns", run: testExecutorClaimInsertsOrReturns[TTx]},
		{name: "ExecutorClaimDatabaseClock", run: testExecutorClaimDatabaseClock[TTx]},
		{name: "ExecutorClaimWaitsForHolder", run: testExecutorClaimWaitsForHolder[TTx]},
		{name: "ExecutorGet", run: testExecutorGet[TTx]},
		{name: "ExecutorComplete", run: testExecutorComplete[TTx]},
		{name: "ExecutorEmptyBodies", run: testExecutorEmptyBodies[TTx]},
		{name: "ExecutorCallerTransaction", run: testExecutorCallerTransaction[TTx]},
	}...)
	all = append(all, executorLeaseCases[TTx]()...)
	all = append(all, executorReaperCases[TTx]()...)
	all = append(all, executorErrorCases[TTx]()...)
	all = append(all, executorMigrateCases[TTx]()...)
	all = append(all, executorDeferredCases[TTx]()...)
	all = append(all, executorOptimisticCases[TTx]()...)
	return all
}

// exBundle is a fresh namespace and its dialect's pool executor.
type exBundle[TTx any] struct {
	ns   *Namespace[TTx]
	d    idem.Dialect[TTx]
	ex   idem.Executor
	feat Features
}

func exSetup[TTx any](t *testing.T, h Harness[TTx]) (context.Context, *exBundle[TTx]) {
	t.Helper()
	ctx := t.Context()
	ns := h.Open(ctx, t)
	return ctx, &exBundle[TTx]{ns: ns, d: ns.Dialect, ex: ns.Dialect.DB(), feat: h.Features()}
}

// begin starts a transaction through the dialect, rolled back when t ends
// if the case did not finish it.
func (b *exBundle[TTx]) begin(ctx context.Context, t *testing.T) TTx {
	t.Helper()
	tx, err := b.d.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.d.Rollback(context.WithoutCancel(ctx), tx) })
	return tx
}

// exClock is the pinned clock of the executor cases.
var exClock = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// longAgo is a pinned clock before every stored deadline: Get with it finds
// a record whatever its retention.
var longAgo = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// at returns exClock moved by d.
func at(d time.Duration) *time.Time { return new(exClock.Add(d)) }

const exScope = "ex/create"

var exTokens atomic.Int64

// claimArgs are claim arguments for key with a fresh token, a 30s lease and
// an hour's retention, on the database's clock.
func claimArgs(key string) *idem.ClaimParams {
	return &idem.ClaimParams{
		Scope: exScope, Key: key, Fingerprint: fp(key), Token: exTokens.Add(1),
		LeaseDuration: 30 * time.Second, Retention: time.Hour, WaitTimeout: 10 * time.Second,
	}
}

// seed claims key at claimedAt with lease and retention and returns the
// claim's arguments.
func (b *exBundle[TTx]) seed(ctx context.Context, t *testing.T, key string, claimedAt time.Time, lease, retention time.Duration) *idem.ClaimParams {
	t.Helper()
	p := claimArgs(key)
	p.LeaseDuration, p.Retention, p.Now = lease, retention, &claimedAt
	res, err := b.ex.Claim(ctx, p)
	require.NoError(t, err)
	require.True(t, res.Created, key)
	return p
}

// seedCompleted claims key a minute before completedAt and completes it at
// completedAt with retention.
func (b *exBundle[TTx]) seedCompleted(ctx context.Context, t *testing.T, key string, completedAt time.Time, retention time.Duration) *idem.ClaimParams {
	t.Helper()
	p := b.seed(ctx, t, key, completedAt.Add(-time.Minute), time.Second, retention)
	c := completeOf(p, &completedAt)
	c.Retention = retention
	require.NoError(t, b.ex.Complete(ctx, c))
	return p
}

// record reads the record claimed with p, live or not.
func (b *exBundle[TTx]) record(ctx context.Context, t *testing.T, p *idem.ClaimParams) *idem.Record {
	t.Helper()
	rec, err := b.ex.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: &longAgo})
	require.NoError(t, err)
	return rec
}

// exists reports whether a record for key is stored, live or not.
func (b *exBundle[TTx]) exists(ctx context.Context, t *testing.T, key string) bool {
	t.Helper()
	_, err := b.ex.Get(ctx, &idem.GetParams{Scope: exScope, Key: key, Now: &longAgo})
	if errors.Is(err, idem.ErrNotFound) {
		return false
	}
	require.NoError(t, err)
	return true
}

// stored returns which of keys have a stored record, in the order given.
func (b *exBundle[TTx]) stored(ctx context.Context, t *testing.T, keys ...string) []string {
	t.Helper()
	var out []string
	for _, k := range keys {
		if b.exists(ctx, t, k) {
			out = append(out, k)
		}
	}
	return out
}

// afterHolder runs op while holder, which changed or locked the record, is
// open, and returns op's result after holder ended (committed when commit,
// else rolled back). op has time to start waiting for holder first; were it
// late, it would read the committed outcome, so a case's assertions hold
// either way and can only fail when the dialect is wrong.
func (b *exBundle[TTx]) afterHolder(ctx context.Context, t *testing.T, holder TTx, commit bool, op func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- op() }()
	select {
	case err := <-done:
		// Finished without waiting: the holder's row lock did not hold it.
		t.Errorf("the operation returned before the holder ended (%v)", err)
	case <-time.After(300 * time.Millisecond):
	}
	if commit {
		require.NoError(t, b.d.Commit(ctx, holder))
	} else {
		require.NoError(t, b.d.Rollback(ctx, holder))
	}
	return <-done
}

// heldClaim claims a fresh key in a transaction left open, and returns it
// with the claim's arguments and those of a waiter for the same key.
func (b *exBundle[TTx]) heldClaim(ctx context.Context, t *testing.T, prefix string) (holder TTx, p, waiter *idem.ClaimParams) {
	t.Helper()
	p = claimArgs(newKey(prefix))
	holder = b.begin(ctx, t)
	_, err := b.d.Tx(holder).Claim(ctx, p)
	require.NoError(t, err)
	w := *p
	w.Token = exTokens.Add(1)
	return holder, p, &w
}

func takeoverOf(p *idem.ClaimParams, token int64, cond idem.TakeoverCondition, now *time.Time) *idem.TakeoverParams {
	return &idem.TakeoverParams{
		Scope: p.Scope, Key: p.Key, Token: token, NewToken: exTokens.Add(1), Fingerprint: fp("takeover"),
		Attempt: 2, LeaseDuration: time.Minute, Retention: time.Hour, Condition: cond,
		WaitTimeout: 10 * time.Second, Now: now,
	}
}

func renewOf(p *idem.ClaimParams, newToken int64, d time.Duration, onlyIfExpired bool, now *time.Time) *idem.RenewLeaseParams {
	return &idem.RenewLeaseParams{
		Scope: p.Scope, Key: p.Key, Token: p.Token, NewToken: newToken, Duration: d,
		OnlyIfExpired: onlyIfExpired, WaitTimeout: 10 * time.Second, Now: now,
	}
}

func completeOf(p *idem.ClaimParams, now *time.Time) *idem.CompleteParams {
	return &idem.CompleteParams{
		Scope: p.Scope, Key: p.Key, Token: p.Token, Status: idem.StatusSucceeded,
		Response: &idem.Response{StatusCode: http.StatusCreated, Body: []byte("done")}, Retention: time.Hour, Now: now,
	}
}

func releaseOf(p *idem.ClaimParams, onlyIfLeaseExpired bool, now *time.Time) *idem.ReleaseParams {
	return &idem.ReleaseParams{Scope: p.Scope, Key: p.Key, Token: p.Token, OnlyIfLeaseExpired: onlyIfLeaseExpired, Now: now}
}

// testExecutorClaimInsertsOrReturns: Claim inserts a processing record with
// the pinned times (at the stored precision, in UTC), and otherwise returns
// the record as it is, expired or not, without changing it.
func testExecutorClaimInsertsOrReturns[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	// Finer than the columns and not in UTC.
	pinned := time.Date(2031, 5, 6, 7, 8, 9, 123456789, time.FixedZone("X", 5*3600))
	want := pinned.UTC().Truncate(b.feat.TimePrecision)
	p := claimArgs(newKey("claim"))
	p.Now = &pinned
	res, err := b.ex.Claim(ctx, p)
	require.NoError(t, err)
	require.True(t, res.Created)
	require.Equal(t, want, res.Now)
	rec := res.Record
	require.Equal(t, p.Scope, rec.Scope)
	require.Equal(t, p.Key, rec.Key)
	require.True(t, rec.Fingerprint.Equal(p.Fingerprint))
	require.Equal(t, p.Token, rec.Token)
	require.Equal(t, idem.StatusProcessing, rec.Status)
	require.Equal(t, 1, rec.Attempt)
	require.Equal(t, want, rec.CreatedAt)
	require.Equal(t, want, rec.UpdatedAt)
	require.Equal(t, want.Add(p.LeaseDuration), rec.LeaseExpiresAt)
	require.Equal(t, want.Add(p.Retention), rec.ExpiresAt)
	require.Nil(t, rec.Response)
	require.True(t, rec.CompletedAt.IsZero())
	require.Equal(t, time.UTC, rec.CreatedAt.Location())
	require.Equal(t, rec, b.record(ctx, t, p), "the returned record is the stored one")

	// A second claim finds the record and changes nothing.
	again := *p
	again.Token, again.Fingerprint = exTokens.Add(1), fp("other")
	again.Now = new(pinned.Add(time.Second))
	res, err = b.ex.Claim(ctx, &again)
	require.NoError(t, err)
	require.False(t, res.Created)
	require.Equal(t, rec, res.Record)
	require.Equal(t, want.Add(time.Second), res.Now)

	// Past its retention, the record is still returned as it is: the Store
	// decides what an expired record means.
	late := *p
	late.Token = exTokens.Add(1)
	late.Now = new(pinned.Add(2 * p.Retention))
	res, err = b.ex.Claim(ctx, &late)
	require.NoError(t, err)
	require.False(t, res.Created)
	require.Equal(t, rec, res.Record)
	require.Equal(t, rec, b.record(ctx, t, p))

	// The same key in another scope is another record.
	other := *p
	other.Scope, other.Token = "ex/other", exTokens.Add(1)
	res, err = b.ex.Claim(ctx, &other)
	require.NoError(t, err)
	require.True(t, res.Created)
	require.Equal(t, other.Token, res.Record.Token)
}

// testExecutorClaimDatabaseClock: without a pinned clock the times come
// from the database's current clock, one reading per statement, even in a
// transaction that began earlier.
func testExecutorClaimDatabaseClock[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	tx := b.begin(ctx, t)
	_, txStart, err := b.d.Tx(tx).ListStaleLeases(ctx, &idem.ListStaleLeasesParams{Limit: 1})
	require.NoError(t, err)
	require.Equal(t, time.UTC, txStart.Location())
	time.Sleep(50 * time.Millisecond)

	p := claimArgs(newKey("clock"))
	res, err := b.d.Tx(tx).Claim(ctx, p)
	require.NoError(t, err)
	require.True(t, res.Created)
	rec := res.Record
	require.GreaterOrEqual(t, rec.CreatedAt.Sub(txStart), 50*time.Millisecond, "the current clock, not the transaction's start")
	require.Equal(t, rec.CreatedAt, rec.UpdatedAt, "one clock reading per statement")
	require.Equal(t, rec.CreatedAt.Add(p.LeaseDuration), rec.LeaseExpiresAt)
	require.Equal(t, rec.CreatedAt.Add(p.Retention), rec.ExpiresAt)
	require.False(t, res.Now.Before(rec.CreatedAt))
	require.Equal(t, time.UTC, rec.CreatedAt.Location())
	require.Equal(t, time.UTC, res.Now.Location())
	require.WithinDuration(t, time.Now(), rec.CreatedAt, time.Minute)
}

// testExecutorClaimWaitsForHolder: a claim of a key whose record another
// transaction holds uncommitted waits for it: it inserts when the holder
// rolls back, returns the holder's record when it commits, and reports a
// wait past WaitTimeout.
func testExecutorClaimWaitsForHolder[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	for _, commit := range []bool{false, true} {
		holder, p, waiter := b.heldClaim(ctx, t, "wait")
		var res *idem.ClaimResult
		err := b.afterHolder(ctx, t, holder, commit, func() error {
			var err error
			res, err = b.ex.Claim(ctx, waiter)
			return err
		})
		require.NoError(t, err, "commit=%v", commit)
		if commit {
			require.False(t, res.Created, "the holder's record committed")
			require.Equal(t, p.Token, res.Record.Token)
		} else {
			require.True(t, res.Created, "the holder rolled back: the waiter inserts")
			require.Equal(t, waiter.Token, res.Record.Token)
		}
		require.Equal(t, res.Record.Token, b.record(ctx, t, p).Token)
	}

	// A wait that runs out, on the pool and in a caller's transaction.
	holder, p, _ := b.heldClaim(ctx, t, "timeout")
	for _, inTx := range []bool{false, true} {
		waiter := *p
		waiter.Token = exTokens.Add(1)
		waiter.WaitTimeout = b.feat.WaitGranularity
		ex := b.ex
		if inTx {
			if b.feat.SingleWriter {
				continue // Begin itself waits for the holder's write lock
			}
			ex = b.d.Tx(b.begin(ctx, t))
		}
		start := time.Now()
		_, err := ex.Claim(ctx, &waiter)
		elapsed := time.Since(start)
		if b.feat.SingleWriter {
			require.ErrorIs(t, err, idem.ErrStoreUnavailable, "the database is busy")
		} else {
			var ip *idem.InProgressError
			require.ErrorAs(t, err, &ip, "inTx=%v", inTx)
			require.Equal(t, inTx && b.feat.WaitAbortsTx, ip.TxAborted, "inTx=%v", inTx)
		}
		require.GreaterOrEqual(t, elapsed, waiter.WaitTimeout-50*time.Millisecond)
		require.Less(t, elapsed, waiter.WaitTimeout+3*time.Second)
	}
	require.NoError(t, b.d.Rollback(ctx, holder))
	require.False(t, b.exists(ctx, t, p.Key), "no waiter inserted while the holder could still commit")
}

// testExecutorGet: Get finds a record until its ExpiresAt and not at it,
// only in its scope, and reads without waiting for a transaction that holds
// the record.
func testExecutorGet[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	p := b.seed(ctx, t, newKey("get"), exClock, 30*time.Second, time.Hour)
	get := func(scope string, now *time.Time) (*idem.Record, error) {
		return b.ex.Get(ctx, &idem.GetParams{Scope: scope, Key: p.Key, Now: now})
	}
	rec, err := get(p.Scope, at(time.Hour-time.Microsecond))
	require.NoError(t, err)
	require.Equal(t, p.Token, rec.Token)
	_, err = get(p.Scope, at(time.Hour))
	require.ErrorIs(t, err, idem.ErrNotFound, "a record is gone at its ExpiresAt")
	_, err = get("ex/other", at(0))
	require.ErrorIs(t, err, idem.ErrNotFound)
	_, err = b.ex.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: newKey("missing")})
	require.ErrorIs(t, err, idem.ErrNotFound)
	// On the database's clock (years before exClock) the record is live.
	_, err = get(p.Scope, nil)
	require.NoError(t, err)

	// A holder renews the lease, uncommitted: Get reads the committed record
	// at once.
	holder := b.begin(ctx, t)
	_, err = b.d.Tx(holder).RenewLease(ctx, renewOf(p, p.Token, time.Hour, false, at(time.Second)))
	require.NoError(t, err)
	quick, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	got, err := b.ex.Get(quick, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: at(0)})
	require.NoError(t, err)
	require.Equal(t, rec, got)
}

// testExecutorComplete: Complete stores the response and final status,
// only on a processing record carrying Token; ExpiresAt becomes now +
// Retention.
func testExecutorComplete[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	for _, status := range []idem.Status{idem.StatusSucceeded, idem.StatusFailed} {
		p := b.seed(ctx, t, newKey("complete"), exClock, 30*time.Second, time.Hour)
		before := b.record(ctx, t, p)
		c := completeOf(p, at(10*time.Second+123456789))
		c.Status, c.Response, c.Retention = status, orderResponse(p.Key), 3*time.Hour

		wrong := *c
		wrong.Token = exTokens.Add(1)
		require.ErrorIs(t, b.ex.Complete(ctx, &wrong), idem.ErrFenced, "wrong token")
		require.Equal(t, before, b.record(ctx, t, p), "a fenced completion changes nothing")

		require.NoError(t, b.ex.Complete(ctx, c))
		done := c.Now.Truncate(b.feat.TimePrecision)
		rec := b.record(ctx, t, p)
		require.Equal(t, status, rec.Status)
		require.Equal(t, p.Token, rec.Token, "the token stays")
		require.Equal(t, before.CreatedAt, rec.CreatedAt)
		require.Equal(t, done, rec.UpdatedAt)
		require.Equal(t, done, rec.CompletedAt)
		require.Equal(t, done.Add(c.Retention), rec.ExpiresAt)
		requireSameResponse(t, c.Response, rec.Response)

		// A completed record is fenced even with its token.
		second := *c
		second.Response = &idem.Response{StatusCode: http.StatusTeapot}
		second.Now = at(time.Minute)
		require.ErrorIs(t, b.ex.Complete(ctx, &second), idem.ErrFenced)
		require.Equal(t, rec, b.record(ctx, t, p))
	}
	missing := completeOf(claimArgs(newKey("missing")), at(0))
	require.ErrorIs(t, b.ex.Complete(ctx, missing), idem.ErrFenced, "no record")
	require.False(t, b.exists(ctx, t, missing.Key), "a completion never inserts")
}

// testExecutorEmptyBodies: an empty or nil body comes back empty and not
// nil, and no headers come back as nil headers.
func testExecutorEmptyBodies[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	for _, resp := range []*idem.Response{
		{StatusCode: http.StatusNoContent},
		{StatusCode: http.StatusOK, Body: []byte{}},
		{StatusCode: http.StatusAccepted, Header: http.Header{"X-Empty": {""}}},
	} {
		p := b.seed(ctx, t, newKey("empty"), exClock, 30*time.Second, time.Hour)
		c := completeOf(p, at(time.Second))
		c.Response = resp
		require.NoError(t, b.ex.Complete(ctx, c))
		for _, rec := range []*idem.Record{b.record(ctx, t, p), claimFound(ctx, t, b, p)} {
			require.Equal(t, resp.StatusCode, rec.Response.StatusCode)
			require.NotNil(t, rec.Response.Body, "an empty body is replayed as empty, not nil")
			require.Empty(t, rec.Response.Body)
			if resp.Header == nil {
				require.Nil(t, rec.Response.Header)
			} else {
				require.Equal(t, resp.Header, rec.Response.Header)
			}
		}
	}
}

// claimFound returns the record a new claim of p's key finds.
func claimFound[TTx any](ctx context.Context, t *testing.T, b *exBundle[TTx], p *idem.ClaimParams) *idem.Record {
	t.Helper()
	again := *p
	again.Token, again.Now = exTokens.Add(1), at(time.Second)
	res, err := b.ex.Claim(ctx, &again)
	require.NoError(t, err)
	require.False(t, res.Created)
	return res.Record
}

// testExecutorCallerTransaction: through Dialect.Tx every write joins the
// caller's transaction and none commits or rolls it back: a rollback undoes
// them all, and the transaction stays usable and commits afterwards.
func testExecutorCallerTransaction[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	lease := b.seed(ctx, t, newKey("renewed"), exClock, 30*time.Second, time.Hour)
	expired := b.seed(ctx, t, newKey("expired"), exClock.Add(-2*time.Hour), 30*time.Second, time.Hour)
	released := b.seed(ctx, t, newKey("released"), exClock, 30*time.Second, time.Hour)
	completed := b.seed(ctx, t, newKey("completed"), exClock, 30*time.Second, time.Hour)
	taken := b.seed(ctx, t, newKey("taken"), exClock, 30*time.Second, time.Hour)
	records := func() []*idem.Record {
		var out []*idem.Record
		for _, p := range []*idem.ClaimParams{lease, expired, released, completed, taken} {
			out = append(out, b.record(ctx, t, p))
		}
		return out
	}
	before := records()

	fresh := claimArgs(newKey("fresh"))
	fresh.Now = at(0)
	for _, commit := range []bool{false, true} {
		tx := b.begin(ctx, t)
		ex := b.d.Tx(tx)
		_, err := ex.Claim(ctx, fresh)
		require.NoError(t, err)
		_, err = ex.RenewLease(ctx, renewOf(lease, lease.Token, time.Hour, false, at(time.Second)))
		require.NoError(t, err)
		require.NoError(t, ex.Release(ctx, releaseOf(released, false, at(time.Second))))
		require.NoError(t, ex.Complete(ctx, completeOf(completed, at(time.Second))))
		require.NoError(t, ex.Takeover(ctx, takeoverOf(taken, taken.Token, idem.TakeoverReserved, at(time.Second))))
		n, err := ex.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: 10, Now: at(0)})
		require.NoError(t, err)
		require.Equal(t, 1, n)
		rec, err := ex.Get(ctx, &idem.GetParams{Scope: fresh.Scope, Key: fresh.Key, Now: at(0)})
		require.NoError(t, err, "the transaction sees its own writes")
		require.Equal(t, fresh.Token, rec.Token)
		if !commit {
			require.NoError(t, b.d.Rollback(ctx, tx))
			require.Equal(t, before, records(), "every write rolled back with the caller's transaction")
			require.False(t, b.exists(ctx, t, fresh.Key))
			continue
		}
		require.NoError(t, b.ns.InsertOrder(ctx, tx, fresh.Key), "the transaction is still open")
		require.NoError(t, b.d.Commit(ctx, tx))
	}
	require.Equal(t, []string{lease.Key, completed.Key, taken.Key, fresh.Key},
		b.stored(ctx, t, lease.Key, expired.Key, released.Key, completed.Key, taken.Key, fresh.Key))
	require.Equal(t, idem.StatusSucceeded, b.record(ctx, t, completed).Status)
	require.NotEqual(t, taken.Token, b.record(ctx, t, taken).Token)
	n, err := b.ns.CountOrders(ctx, fresh.Key)
	require.NoError(t, err)
	require.Equal(t, 1, n)
}
