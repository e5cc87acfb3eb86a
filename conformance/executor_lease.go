package conformance

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func executorLeaseCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "ExecutorTakeoverConditions", run: testExecutorTakeoverConditions[TTx]},
		{name: "ExecutorTakeoverRecheckedAfterWait", run: testExecutorTakeoverRecheckedAfterWait[TTx]},
		{name: "ExecutorRelease", run: testExecutorRelease[TTx]},
		{name: "ExecutorReleaseOnlyIfLeaseExpired", run: testExecutorReleaseOnlyIfLeaseExpired[TTx]},
		{name: "ExecutorRenewLease", run: testExecutorRenewLease[TTx]},
		{name: "ExecutorRenewLeaseRetentionCoversLease", run: testExecutorRenewLeaseRetentionCoversLease[TTx]},
		{name: "ExecutorRenewLeaseOnlyIfExpired", run: testExecutorRenewLeaseOnlyIfExpired[TTx]},
		{name: "ExecutorRenewLeaseDatabaseClock", run: testExecutorRenewLeaseDatabaseClock[TTx]},
	}
}

// testExecutorTakeoverConditions: besides the token, a takeover requires
// what its condition says (deadlines included: a deadline equal to now has
// passed), replaces the record with a fresh processing one, and changes
// nothing when the condition does not hold.
func testExecutorTakeoverConditions[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	const (
		processing = "processing"
		completed  = "completed"
	)
	for i, tc := range []struct {
		cond   idem.TakeoverCondition
		state  string
		after  time.Duration // since the claim at exClock: lease 1m, retention 1h
		wrong  bool          // with a token the record does not carry
		fenced bool
	}{
		{idem.TakeoverRetentionExpired, completed, 30 * time.Minute, false, true},
		{idem.TakeoverRetentionExpired, completed, time.Hour, false, false},
		{idem.TakeoverRetentionExpired, processing, time.Hour - time.Microsecond, false, true},
		{idem.TakeoverRetentionExpired, processing, 2 * time.Hour, false, false},
		{idem.TakeoverRetentionExpired, completed, 2 * time.Hour, true, true},
		{idem.TakeoverLeaseExpired, processing, time.Minute - time.Microsecond, false, true},
		{idem.TakeoverLeaseExpired, processing, time.Minute, false, false},
		{idem.TakeoverLeaseExpired, completed, 2 * time.Hour, false, true}, // no lease to run out
		{idem.TakeoverLeaseExpired, processing, 2 * time.Minute, true, true},
		{idem.TakeoverReserved, processing, 0, false, false}, // the token is enough
		{idem.TakeoverReserved, processing, 0, true, true},
	} {
		name := fmt.Sprintf("case %d (condition %d, %s, +%v, wrong token %v)", i, tc.cond, tc.state, tc.after, tc.wrong)
		p := b.seed(ctx, t, newKey("takeover"), exClock, time.Minute, time.Hour)
		if tc.state == completed {
			c := completeOf(p, at(0))
			require.NoError(t, b.ex.Complete(ctx, c), name)
		}
		before := b.record(ctx, t, p)
		token := p.Token
		if tc.wrong {
			token = exTokens.Add(1)
		}
		tp := takeoverOf(p, token, tc.cond, at(tc.after))
		err := b.ex.Takeover(ctx, tp)
		rec := b.record(ctx, t, p)
		if tc.fenced {
			require.ErrorIs(t, err, idem.ErrFenced, name)
			require.Equal(t, before, rec, "%s: a fenced takeover changes nothing", name)
			continue
		}
		require.NoError(t, err, name)
		when := exClock.Add(tc.after)
		require.Equal(t, tp.NewToken, rec.Token, name)
		require.Equal(t, idem.StatusProcessing, rec.Status, name)
		require.Equal(t, 2, rec.Attempt, name)
		require.True(t, rec.Fingerprint.Equal(tp.Fingerprint), name)
		require.Nil(t, rec.Response, name)
		require.True(t, rec.CompletedAt.IsZero(), name)
		require.Equal(t, when, rec.CreatedAt, name)
		require.Equal(t, when, rec.UpdatedAt, name)
		require.Equal(t, when.Add(tp.LeaseDuration), rec.LeaseExpiresAt, name)
		require.Equal(t, when.Add(tp.Retention), rec.ExpiresAt, name)
		require.ErrorIs(t, b.ex.Takeover(ctx, takeoverOf(p, token, tc.cond, at(tc.after))), idem.ErrFenced,
			"%s: the token moved on", name)
	}
	missing := claimArgs(newKey("missing"))
	require.ErrorIs(t, b.ex.Takeover(ctx, takeoverOf(missing, missing.Token, idem.TakeoverReserved, at(0))), idem.ErrFenced)
	require.False(t, b.exists(ctx, t, missing.Key), "a takeover never inserts")
}

// testExecutorTakeoverRecheckedAfterWait: a takeover that waits for a
// transaction holding the record evaluates its condition on what that
// transaction committed, so a holder that completed or renewed (keeping its
// token) keeps its record; had the holder rolled back, the takeover goes
// ahead.
func testExecutorTakeoverRecheckedAfterWait[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	for _, tc := range []struct {
		name  string
		cond  idem.TakeoverCondition
		after time.Duration
		// hold writes, in the holder's transaction, what keeps the record.
		hold  func(ex idem.Executor, p *idem.ClaimParams) error
		check func(t *testing.T, rec *idem.Record)
	}{
		{
			name: "Completed", cond: idem.TakeoverRetentionExpired, after: 2 * time.Hour,
			hold: func(ex idem.Executor, p *idem.ClaimParams) error {
				return ex.Complete(ctx, completeOf(p, at(2*time.Hour)))
			},
			check: func(t *testing.T, rec *idem.Record) {
				t.Helper()
				require.Equal(t, idem.StatusSucceeded, rec.Status)
				require.Equal(t, []byte("done"), rec.Response.Body)
			},
		},
		{
			name: "Renewed", cond: idem.TakeoverLeaseExpired, after: 2 * time.Minute,
			hold: func(ex idem.Executor, p *idem.ClaimParams) error {
				_, err := ex.RenewLease(ctx, renewOf(p, p.Token, time.Minute, false, at(2*time.Minute)))
				return err
			},
			check: func(t *testing.T, rec *idem.Record) {
				t.Helper()
				require.Equal(t, idem.StatusProcessing, rec.Status)
				require.Equal(t, exClock.Add(3*time.Minute), rec.LeaseExpiresAt)
			},
		},
	} {
		for _, commit := range []bool{true, false} {
			p := b.seed(ctx, t, newKey("recheck"), exClock, time.Minute, time.Hour)
			holder := b.begin(ctx, t)
			require.NoError(t, tc.hold(b.d.Tx(holder), p), tc.name)
			tp := takeoverOf(p, p.Token, tc.cond, at(tc.after))
			err := b.afterHolder(ctx, t, holder, commit, func() error { return b.ex.Takeover(ctx, tp) })
			rec := b.record(ctx, t, p)
			if commit {
				require.ErrorIs(t, err, idem.ErrFenced, "%s: the holder's commit must not be overwritten", tc.name)
				require.Equal(t, p.Token, rec.Token)
				tc.check(t, rec)
				continue
			}
			require.NoError(t, err, "%s: the holder rolled back", tc.name)
			require.Equal(t, tp.NewToken, rec.Token)
		}
	}
}

// testExecutorRelease: Release deletes a processing record carrying Token,
// whatever its lease, and nothing else.
func testExecutorRelease[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	p := b.seed(ctx, t, newKey("release"), exClock, 30*time.Second, time.Hour)
	wrong := *p
	wrong.Token = exTokens.Add(1)
	require.ErrorIs(t, b.ex.Release(ctx, releaseOf(&wrong, false, at(time.Second))), idem.ErrFenced, "wrong token")
	require.True(t, b.exists(ctx, t, p.Key))
	require.NoError(t, b.ex.Release(ctx, releaseOf(p, false, at(time.Second))), "a live lease does not matter")
	require.False(t, b.exists(ctx, t, p.Key))
	require.ErrorIs(t, b.ex.Release(ctx, releaseOf(p, false, at(time.Second))), idem.ErrFenced, "no record")

	done := b.seedCompleted(ctx, t, newKey("completed"), exClock, time.Hour)
	before := b.record(ctx, t, done)
	require.ErrorIs(t, b.ex.Release(ctx, releaseOf(done, false, at(time.Second))), idem.ErrFenced,
		"the token matches but the record is final")
	require.Equal(t, before, b.record(ctx, t, done))
}

// testExecutorReleaseOnlyIfLeaseExpired: with OnlyIfLeaseExpired a live
// lease keeps its record, by the pinned clock and by the database's, and a
// lease renewed while the release waited is live.
func testExecutorReleaseOnlyIfLeaseExpired[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	p := b.seed(ctx, t, newKey("pinned"), exClock, 30*time.Second, time.Hour)
	require.ErrorIs(t, b.ex.Release(ctx, releaseOf(p, true, at(30*time.Second-time.Microsecond))), idem.ErrFenced, "the lease is live")
	require.True(t, b.exists(ctx, t, p.Key))
	require.NoError(t, b.ex.Release(ctx, releaseOf(p, true, at(30*time.Second))), "the lease runs out at its deadline")
	require.False(t, b.exists(ctx, t, p.Key))

	// The database's clock: a lease claimed on it is live, and so is one
	// claimed at exClock, years ahead.
	db := claimArgs(newKey("db"))
	_, err := b.ex.Claim(ctx, db)
	require.NoError(t, err)
	future := b.seed(ctx, t, newKey("future"), exClock, 30*time.Second, time.Hour)
	require.ErrorIs(t, b.ex.Release(ctx, releaseOf(db, true, nil)), idem.ErrFenced)
	require.ErrorIs(t, b.ex.Release(ctx, releaseOf(future, true, nil)), idem.ErrFenced)
	require.Equal(t, []string{db.Key, future.Key}, b.stored(ctx, t, db.Key, future.Key))

	// Renewed by its holder while the release waits.
	q := b.seed(ctx, t, newKey("renewed"), exClock, 30*time.Second, time.Hour)
	holder := b.begin(ctx, t)
	_, err = b.d.Tx(holder).RenewLease(ctx, renewOf(q, q.Token, 30*time.Second, false, at(40*time.Second)))
	require.NoError(t, err)
	err = b.afterHolder(ctx, t, holder, true, func() error {
		return b.ex.Release(ctx, releaseOf(q, true, at(40*time.Second)))
	})
	require.ErrorIs(t, err, idem.ErrFenced, "a renewed lease must not be released")
	require.True(t, b.exists(ctx, t, q.Key))
}

// testExecutorRenewLease: RenewLease moves the lease to now + Duration (at
// the stored precision), sets the new token, returns the expiry exactly as
// stored, and is fenced by token and status.
func testExecutorRenewLease[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	prec := b.feat.TimePrecision
	p := b.seed(ctx, t, newKey("renew"), exClock, 30*time.Second, time.Hour)
	now := exClock.Add(20*time.Second + 123456789)
	renew := renewOf(p, exTokens.Add(1), 45*time.Second, false, &now)
	got, err := b.ex.RenewLease(ctx, renew)
	require.NoError(t, err)
	require.Equal(t, now.Truncate(prec).Add(renew.Duration), got)
	require.Equal(t, time.UTC, got.Location())
	rec := b.record(ctx, t, p)
	require.Equal(t, got, rec.LeaseExpiresAt, "the returned expiry is the stored one")
	require.Equal(t, renew.NewToken, rec.Token)
	require.Equal(t, now.Truncate(prec), rec.UpdatedAt)
	require.Equal(t, exClock, rec.CreatedAt, "a renewal is not a new claim")
	require.Equal(t, exClock.Add(p.Retention), rec.ExpiresAt, "retention already covers the lease")
	require.Equal(t, idem.StatusProcessing, rec.Status)
	require.Equal(t, 1, rec.Attempt)

	// The old token is fenced and changes nothing.
	_, err = b.ex.RenewLease(ctx, renewOf(p, p.Token, time.Hour, false, at(21*time.Second)))
	require.ErrorIs(t, err, idem.ErrFenced)
	require.Equal(t, rec, b.record(ctx, t, p))

	// A plain renewal keeps the token; the same one again, which writes
	// what is already stored, still succeeds.
	cur := *p
	cur.Token = renew.NewToken
	plain := renewOf(&cur, cur.Token, time.Minute, false, at(21*time.Second))
	for range 2 {
		got, err = b.ex.RenewLease(ctx, plain)
		require.NoError(t, err)
		require.Equal(t, exClock.Add(81*time.Second), got)
		require.Equal(t, cur.Token, b.record(ctx, t, p).Token)
	}

	// A completed record is fenced even with its token; so is a missing one.
	require.NoError(t, b.ex.Complete(ctx, completeOf(&cur, at(22*time.Second))))
	done := b.record(ctx, t, p)
	_, err = b.ex.RenewLease(ctx, renewOf(&cur, cur.Token, time.Hour, false, at(23*time.Second)))
	require.ErrorIs(t, err, idem.ErrFenced)
	require.Equal(t, done, b.record(ctx, t, p))
	missing := claimArgs(newKey("missing"))
	_, err = b.ex.RenewLease(ctx, renewOf(missing, missing.Token, time.Hour, false, at(0)))
	require.ErrorIs(t, err, idem.ErrFenced)
	require.False(t, b.exists(ctx, t, missing.Key))
}

// testExecutorRenewLeaseRetentionCoversLease: a renewal moves ExpiresAt out
// to a lease that would outlive it, and never brings it forward.
func testExecutorRenewLeaseRetentionCoversLease[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	p := b.seed(ctx, t, newKey("long"), exClock, 30*time.Minute, time.Hour)
	renew := func(now, d time.Duration) *idem.Record {
		t.Helper()
		got, err := b.ex.RenewLease(ctx, renewOf(p, p.Token, d, false, at(now)))
		require.NoError(t, err)
		rec := b.record(ctx, t, p)
		require.Equal(t, got, rec.LeaseExpiresAt)
		return rec
	}
	rec := renew(50*time.Minute, 30*time.Minute)
	require.Equal(t, exClock.Add(80*time.Minute), rec.ExpiresAt, "retention moved out to the lease")
	rec = renew(55*time.Minute, time.Minute)
	require.Equal(t, exClock.Add(56*time.Minute), rec.LeaseExpiresAt)
	require.Equal(t, exClock.Add(80*time.Minute), rec.ExpiresAt, "retention never moves in")

	// Past the original deadline the record is live: Get finds it and the
	// reaper leaves it.
	_, err := b.ex.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: at(79 * time.Minute)})
	require.NoError(t, err)
	n, err := b.ex.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: 10, Now: at(79 * time.Minute)})
	require.NoError(t, err)
	require.Zero(t, n)
}

// testExecutorRenewLeaseOnlyIfExpired: with OnlyIfExpired a renewal
// reserves only a lease that has run out (at its deadline included), and a
// lease its holder renewed while the reservation waited is live.
func testExecutorRenewLeaseOnlyIfExpired[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	p := b.seed(ctx, t, newKey("reserve"), exClock, 30*time.Second, time.Hour)
	before := b.record(ctx, t, p)
	_, err := b.ex.RenewLease(ctx, renewOf(p, exTokens.Add(1), time.Minute, true, at(30*time.Second-time.Microsecond)))
	require.ErrorIs(t, err, idem.ErrFenced, "the lease is live")
	require.Equal(t, before, b.record(ctx, t, p))

	reserve := renewOf(p, exTokens.Add(1), time.Minute, true, at(30*time.Second))
	got, err := b.ex.RenewLease(ctx, reserve)
	require.NoError(t, err)
	require.Equal(t, exClock.Add(90*time.Second), got)
	rec := b.record(ctx, t, p)
	require.Equal(t, reserve.NewToken, rec.Token)
	require.Equal(t, got, rec.LeaseExpiresAt)
	// Repeated, it finds the old token gone; with the new token it finds a
	// live lease, even though the row already holds what it would write.
	_, err = b.ex.RenewLease(ctx, reserve)
	require.ErrorIs(t, err, idem.ErrFenced)
	again := *reserve
	again.Token = reserve.NewToken
	_, err = b.ex.RenewLease(ctx, &again)
	require.ErrorIs(t, err, idem.ErrFenced)
	require.Equal(t, rec, b.record(ctx, t, p))

	// Renewed by its holder while the reservation waits.
	q := b.seed(ctx, t, newKey("renewed"), exClock, 30*time.Second, time.Hour)
	holder := b.begin(ctx, t)
	until, err := b.d.Tx(holder).RenewLease(ctx, renewOf(q, q.Token, 30*time.Second, false, at(40*time.Second)))
	require.NoError(t, err)
	err = b.afterHolder(ctx, t, holder, true, func() error {
		_, err := b.ex.RenewLease(ctx, renewOf(q, exTokens.Add(1), time.Minute, true, at(40*time.Second)))
		return err
	})
	require.ErrorIs(t, err, idem.ErrFenced, "a renewed lease must not be reserved")
	rec = b.record(ctx, t, q)
	require.Equal(t, q.Token, rec.Token)
	require.Equal(t, until, rec.LeaseExpiresAt)
}

// testExecutorRenewLeaseDatabaseClock: without a pinned clock the renewal
// uses the database's current clock, one reading for both columns, even in
// a transaction that began earlier.
func testExecutorRenewLeaseDatabaseClock[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	p := claimArgs(newKey("clock"))
	res, err := b.ex.Claim(ctx, p)
	require.NoError(t, err)
	tx := b.begin(ctx, t)
	_, txStart, err := b.d.Tx(tx).ListStaleLeases(ctx, &idem.ListStaleLeasesParams{Limit: 1})
	require.NoError(t, err)
	time.Sleep(20 * time.Millisecond)
	got, err := b.d.Tx(tx).RenewLease(ctx, renewOf(p, p.Token, time.Hour, false, nil))
	require.NoError(t, err)
	require.NoError(t, b.d.Commit(ctx, tx))

	rec := b.record(ctx, t, p)
	require.Equal(t, got, rec.LeaseExpiresAt)
	require.Equal(t, time.UTC, got.Location())
	require.Equal(t, rec.UpdatedAt.Add(time.Hour), got, "one clock reading for both columns")
	require.GreaterOrEqual(t, rec.UpdatedAt.Sub(txStart), 20*time.Millisecond, "the current clock, not the transaction's start")
	require.True(t, rec.UpdatedAt.After(res.Record.UpdatedAt))
	require.WithinDuration(t, time.Now(), rec.UpdatedAt, time.Minute)
}
