package conformance

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func executorReaperCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "ExecutorListStaleLeases", run: testExecutorListStaleLeases[TTx]},
		{name: "ExecutorListStaleLeasesDatabaseClock", run: testExecutorListStaleLeasesDatabaseClock[TTx]},
		{name: "ExecutorDeleteExpired", run: testExecutorDeleteExpired[TTx]},
		{name: "ExecutorDeleteExpiredDatabaseClock", run: testExecutorDeleteExpiredDatabaseClock[TTx]},
		{name: "ExecutorDeleteExpiredSkipsHeldRows", run: testExecutorDeleteExpiredSkipsHeldRows[TTx], applies: concurrentWriters},
		{name: "ExecutorLimitBelowOne", run: testExecutorLimitBelowOne[TTx]},
	}
}

func recordKeys(recs []*idem.Record) []string {
	keys := []string{}
	for _, r := range recs {
		keys = append(keys, r.Key)
	}
	return keys
}

// testExecutorListStaleLeases: only processing records whose lease has run
// out (at its deadline included) and whose retention has not, oldest lease
// first, up to Limit, whole, with the time used as now; without waiting for
// a transaction that holds one of them.
func testExecutorListStaleLeases[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	now := exClock
	// Seeded out of lease order.
	b.seed(ctx, t, "stale-2", now.Add(-5*time.Minute), time.Minute, time.Hour)
	b.seed(ctx, t, "stale-3", now.Add(-time.Minute), time.Minute, time.Hour) // lease ends at now
	b.seed(ctx, t, "stale-1", now.Add(-10*time.Minute), time.Minute, time.Hour)
	b.seed(ctx, t, "live-lease", now.Add(-time.Minute), time.Minute+time.Microsecond, time.Hour)
	b.seed(ctx, t, "retention-over", now.Add(-2*time.Hour), time.Minute, time.Hour)
	b.seed(ctx, t, "retention-ends-now", now.Add(-time.Hour), time.Minute, time.Hour)
	b.seedCompleted(ctx, t, "succeeded", now.Add(-20*time.Minute), time.Hour)
	failed := b.seed(ctx, t, "failed", now.Add(-20*time.Minute), time.Minute, time.Hour)
	fc := completeOf(failed, new(now.Add(-19*time.Minute)))
	fc.Status = idem.StatusFailed
	require.NoError(t, b.ex.Complete(ctx, fc))
	// Another scope is listed too.
	other := claimArgs("stale-0")
	other.Scope, other.Now, other.LeaseDuration = "ex/other", new(now.Add(-30*time.Minute)), time.Minute
	_, err := b.ex.Claim(ctx, other)
	require.NoError(t, err)

	list := func(ex idem.Executor, limit int, now *time.Time) ([]*idem.Record, time.Time) {
		t.Helper()
		recs, used, err := ex.ListStaleLeases(ctx, &idem.ListStaleLeasesParams{Limit: limit, Now: now})
		require.NoError(t, err)
		for _, rec := range recs {
			get, err := b.ex.Get(ctx, &idem.GetParams{Scope: rec.Scope, Key: rec.Key, Now: now})
			require.NoError(t, err)
			require.Equal(t, get, rec, "the whole record is read")
		}
		return recs, used
	}

	pinned := now.Add(123 * time.Nanosecond) // truncated to now
	recs, used := list(b.ex, 10, &pinned)
	require.Equal(t, []string{"stale-0", "stale-1", "stale-2", "stale-3"}, recordKeys(recs), "oldest lease first")
	require.Equal(t, now, used)
	require.Equal(t, "ex/other", recs[0].Scope)
	recs, _ = list(b.ex, 2, &now)
	require.Equal(t, []string{"stale-0", "stale-1"}, recordKeys(recs))
	recs, _ = list(b.ex, 1, &now)
	require.Equal(t, []string{"stale-0"}, recordKeys(recs))

	// Nothing stale: the time used is still returned.
	early := now.Add(-3 * time.Hour)
	recs, used = list(b.ex, 10, &early)
	require.Empty(t, recs)
	require.Equal(t, early, used)

	// A holder renews stale-2, uncommitted: the list reads the committed
	// records at once, in a caller's transaction too.
	p := &idem.ClaimParams{Scope: exScope, Key: "stale-2", Token: b.record(ctx, t, &idem.ClaimParams{Scope: exScope, Key: "stale-2"}).Token}
	holder := b.begin(ctx, t)
	_, err = b.d.Tx(holder).RenewLease(ctx, renewOf(p, p.Token, time.Hour, false, &now))
	require.NoError(t, err)
	quick, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	recs, _, err = b.ex.ListStaleLeases(quick, &idem.ListStaleLeasesParams{Limit: 10, Now: &now})
	require.NoError(t, err)
	require.Equal(t, []string{"stale-0", "stale-1", "stale-2", "stale-3"}, recordKeys(recs))
	require.NoError(t, b.d.Rollback(ctx, holder))

	tx := b.begin(ctx, t)
	recs, _ = list(b.d.Tx(tx), 3, &now)
	require.Equal(t, []string{"stale-0", "stale-1", "stale-2"}, recordKeys(recs))
	require.NoError(t, b.d.Rollback(ctx, tx))
}

// testExecutorListStaleLeasesDatabaseClock: without a pinned clock the
// database's clock decides, and is returned in UTC.
func testExecutorListStaleLeasesDatabaseClock[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	b.seed(ctx, t, "future", exClock, time.Minute, time.Hour) // years ahead: live
	live := claimArgs("live")
	_, err := b.ex.Claim(ctx, live)
	require.NoError(t, err)
	stale := claimArgs("stale")
	stale.LeaseDuration = time.Millisecond
	_, err = b.ex.Claim(ctx, stale)
	require.NoError(t, err)
	time.Sleep(10 * time.Millisecond)

	before := time.Now().Add(-time.Second)
	recs, used, err := b.ex.ListStaleLeases(ctx, &idem.ListStaleLeasesParams{Limit: 10})
	require.NoError(t, err)
	require.Equal(t, []string{"stale"}, recordKeys(recs))
	require.Equal(t, time.UTC, used.Location())
	require.True(t, used.After(before))
	require.WithinDuration(t, time.Now(), used, time.Minute)
}

// testExecutorDeleteExpired: up to Limit records whose ExpiresAt <= now,
// processing or final, in any scope, earliest deadline first; a caller's
// transaction can roll the deletion back.
func testExecutorDeleteExpired[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	now := exClock
	seed := func() {
		b.seed(ctx, t, "e2", now.Add(-5*time.Hour), time.Minute, time.Hour) // expired 4h ago
		b.seed(ctx, t, "e1", now.Add(-6*time.Hour), time.Minute, time.Hour) // expired 5h ago
		b.seedCompleted(ctx, t, "e3", now.Add(-4*time.Hour), time.Hour)     // expired 3h ago
		other := claimArgs("e4")
		other.Scope, other.Now = "ex/other", new(now.Add(-3*time.Hour)) // expired 2h ago
		_, err := b.ex.Claim(ctx, other)
		require.NoError(t, err)
		b.seed(ctx, t, "e5", now.Add(-time.Hour), time.Minute, time.Hour)                      // expires at now
		b.seed(ctx, t, "live-1", now.Add(-time.Hour+time.Microsecond), time.Minute, time.Hour) // 1µs left
		b.seedCompleted(ctx, t, "live-2", now, time.Hour)
	}
	del := func(ex idem.Executor, limit int) int {
		t.Helper()
		pinned := now.Add(999 * time.Nanosecond) // truncated to now
		n, err := ex.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: limit, Now: &pinned})
		require.NoError(t, err)
		return n
	}
	all := []string{"e1", "e2", "e3", "e5", "live-1", "live-2"}
	seed()

	tx := b.begin(ctx, t)
	require.Equal(t, 5, del(b.d.Tx(tx), 10))
	require.NoError(t, b.d.Rollback(ctx, tx))
	require.Equal(t, all, b.stored(ctx, t, all...), "the deletion rolled back with the caller's transaction")

	// Limits below 1 are refused: see testExecutorLimitBelowOne.
	require.Equal(t, 2, del(b.ex, 2))
	require.Equal(t, []string{"e3", "e5", "live-1", "live-2"}, b.stored(ctx, t, all...), "earliest deadline first")
	require.Equal(t, 1, del(b.ex, 1))
	require.Equal(t, []string{"e5", "live-1", "live-2"}, b.stored(ctx, t, all...))
	e4 := &idem.GetParams{Scope: "ex/other", Key: "e4", Now: &longAgo}
	_, err := b.ex.Get(ctx, e4)
	require.NoError(t, err)
	require.Equal(t, 1, del(b.ex, 1))
	_, err = b.ex.Get(ctx, e4)
	require.ErrorIs(t, err, idem.ErrNotFound, "the other scope's record is reaped in its turn")
	require.Equal(t, 1, del(b.ex, 10), "ExpiresAt = now has expired")
	require.Zero(t, del(b.ex, 10))
	require.Equal(t, []string{"live-1", "live-2"}, b.stored(ctx, t, all...))
}

// testExecutorDeleteExpiredDatabaseClock: without a pinned clock the
// database's clock decides.
func testExecutorDeleteExpiredDatabaseClock[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	b.seed(ctx, t, "expired", time.Now().Add(-2*time.Hour), time.Minute, time.Hour)
	b.seed(ctx, t, "future", exClock.Add(-2*time.Hour), time.Minute, time.Hour) // expired at exClock, years ahead
	_, err := b.ex.Claim(ctx, claimArgs("live"))
	require.NoError(t, err)
	n, err := b.ex.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: 10})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, []string{"future", "live"}, b.stored(ctx, t, "expired", "future", "live"))
}

// testExecutorDeleteExpiredSkipsHeldRows: rows another transaction holds
// are skipped, not waited for, so a reaper never queues behind a claim and
// two reapers take disjoint batches.
func testExecutorDeleteExpiredSkipsHeldRows[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	now := exClock
	var keys []string
	for i := range 6 {
		key := fmt.Sprintf("e%d", i)
		b.seed(ctx, t, key, now.Add(-2*time.Hour-time.Duration(6-i)*time.Minute), time.Minute, time.Hour)
		keys = append(keys, key)
	}
	promptly := func(ex idem.Executor, limit int) int {
		t.Helper()
		// A statement that waited for a lock would run into this deadline.
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		n, err := ex.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: limit, Now: &now})
		require.NoError(t, err)
		return n
	}

	// An open claim transaction takes the oldest expired record over.
	holder := b.begin(ctx, t)
	e0 := b.record(ctx, t, &idem.ClaimParams{Scope: exScope, Key: "e0"})
	require.NoError(t, b.d.Tx(holder).Takeover(ctx, takeoverOf(&idem.ClaimParams{Scope: exScope, Key: "e0"},
		e0.Token, idem.TakeoverRetentionExpired, &now)))

	// Two reapers in open transactions take disjoint batches.
	first := b.begin(ctx, t)
	require.Equal(t, 3, promptly(b.d.Tx(first), 3))
	require.Equal(t, 2, promptly(b.ex, 10), "the held rows are skipped, not waited for")
	require.Zero(t, promptly(b.ex, 10))
	require.NoError(t, b.d.Commit(ctx, first))
	require.Equal(t, []string{"e0"}, b.stored(ctx, t, keys...))

	// Committed, the takeover has a new retention deadline.
	require.NoError(t, b.d.Commit(ctx, holder))
	require.Zero(t, promptly(b.ex, 10))
	require.Equal(t, []string{"e0"}, b.stored(ctx, t, keys...))
}
