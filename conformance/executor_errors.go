package conformance

import (
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func executorErrorCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "ExecutorNilTx", run: testExecutorNilTx[TTx]},
		{name: "ExecutorClosedPoolIsUnavailable", run: testExecutorClosedPoolIsUnavailable[TTx]},
		{name: "ExecutorUnreachableIsUnavailable", run: testExecutorUnreachableIsUnavailable[TTx]},
		{name: "ExecutorUnknownTakeoverCondition", run: testExecutorUnknownTakeoverCondition[TTx]},
		{name: "ExecutorCanceledContext", run: testExecutorCanceledContext[TTx]},
		{name: "ExecutorContextEndsWait", run: testExecutorContextEndsWait[TTx], applies: concurrentWriters},
		{name: "ExecutorDeadlockIsRetryable", run: testExecutorDeadlockIsRetryable[TTx], applies: concurrentWriters},
		{name: "ExecutorRollbackFinishedTx", run: testExecutorRollbackFinishedTx[TTx]},
	}
}

// everyMethod calls each Executor method once on ex, for key, and returns
// the errors by method name.
func everyMethod(ctx context.Context, ex idem.Executor, key string) map[string]error {
	p := claimArgs(key)
	p.Now = at(0)
	errs := map[string]error{}
	_, errs["Claim"] = ex.Claim(ctx, p)
	errs["Takeover"] = ex.Takeover(ctx, takeoverOf(p, p.Token, idem.TakeoverReserved, at(0)))
	_, errs["Get"] = ex.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: at(0)})
	errs["Complete"] = ex.Complete(ctx, completeOf(p, at(0)))
	errs["Release"] = ex.Release(ctx, releaseOf(p, false, at(0)))
	_, errs["RenewLease"] = ex.RenewLease(ctx, renewOf(p, p.Token, time.Minute, false, at(0)))
	_, _, errs["ListStaleLeases"] = ex.ListStaleLeases(ctx, &idem.ListStaleLeasesParams{Limit: 1, Now: at(0)})
	_, errs["DeleteExpired"] = ex.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: 1, Now: at(0)})
	return errs
}

// testExecutorNilTx: a nil (zero) transaction gives errors, not panics, and
// not ones the Store would take for an answer of the database.
func testExecutorNilTx[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	var zero TTx
	errs := everyMethod(ctx, b.d.Tx(zero), newKey("nil"))
	errs["Commit"] = b.d.Commit(ctx, zero)
	errs["Rollback"] = b.d.Rollback(ctx, zero)
	for name, err := range errs {
		require.Error(t, err, name)
		require.NotErrorIs(t, err, idem.ErrStoreUnavailable, name)
		require.NotErrorIs(t, err, idem.ErrNotFound, name)
		require.NotErrorIs(t, err, idem.ErrFenced, name)
	}
	n, err := b.ns.CountRecords(ctx)
	require.NoError(t, err)
	require.Zero(t, n)
}

// testExecutorClosedPoolIsUnavailable: after the pool is closed every
// method, and Begin, report idem.ErrStoreUnavailable.
func testExecutorClosedPoolIsUnavailable[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	b.seed(ctx, t, "k", exClock, time.Minute, time.Hour)
	b.ns.Close()
	for name, err := range everyMethod(ctx, b.ex, "k") {
		require.ErrorIs(t, err, idem.ErrStoreUnavailable, name)
	}
	_, err := b.d.Begin(ctx)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
}

// testExecutorUnreachableIsUnavailable: a server that cannot be reached is
// reported as idem.ErrStoreUnavailable by every method, and by Begin.
func testExecutorUnreachableIsUnavailable[TTx any](t *testing.T, h Harness[TTx]) {
	ctx := t.Context()
	d := h.Unreachable(ctx, t)
	for name, err := range everyMethod(ctx, d.DB(), "k") {
		require.ErrorIs(t, err, idem.ErrStoreUnavailable, name)
	}
	_, err := d.Begin(ctx)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
}

// testExecutorUnknownTakeoverCondition: a condition the dialect does not
// know is refused before the database is asked, as neither a fencing nor an
// availability answer, and changes nothing.
func testExecutorUnknownTakeoverCondition[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	p := b.seed(ctx, t, newKey("cond"), exClock, time.Minute, time.Hour)
	before := b.record(ctx, t, p)
	unreachable := h.Unreachable(ctx, t).DB()
	for _, cond := range []idem.TakeoverCondition{0, -1, idem.TakeoverReserved + 1} {
		for _, ex := range []idem.Executor{b.ex, unreachable} {
			err := ex.Takeover(ctx, takeoverOf(p, p.Token, cond, at(2*time.Hour)))
			require.Error(t, err, "condition %d", cond)
			require.NotErrorIs(t, err, idem.ErrFenced)
			require.NotErrorIs(t, err, idem.ErrStoreUnavailable, "the database is not asked")
		}
	}
	require.Equal(t, before, b.record(ctx, t, p))
}

// testExecutorCanceledContext: a context that ended before the call is
// reported as such by every method, not as the store being unavailable.
func testExecutorCanceledContext[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	b.seed(ctx, t, "k", exClock, time.Minute, time.Hour)
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	for name, err := range everyMethod(canceled, b.ex, "k") {
		require.ErrorIs(t, err, context.Canceled, name)
		require.NotErrorIs(t, err, idem.ErrStoreUnavailable, name)
	}
	require.True(t, b.exists(ctx, t, "k"))
}

// testExecutorContextEndsWait: a claim waiting for a holder ends with its
// context: a deadline counts as the store being unavailable, a
// cancellation is the caller's and reported as context.Canceled.
func testExecutorContextEndsWait[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	holder, p, waiter := b.heldClaim(ctx, t, "held")

	deadline, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err := b.ex.Claim(deadline, waiter)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)

	canceled, cancel := context.WithCancel(ctx)
	time.AfterFunc(200*time.Millisecond, cancel)
	_, err = b.ex.Claim(canceled, waiter)
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, idem.ErrStoreUnavailable)

	require.NoError(t, b.d.Rollback(ctx, holder))
	require.False(t, b.exists(ctx, t, p.Key), "an ended wait inserts nothing")
}

// testExecutorDeadlockIsRetryable: two transactions each claim the key the
// other holds; the database aborts one, reported as idem.ErrRetryable, and
// the other's claim goes through.
func testExecutorDeadlockIsRetryable[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	a, c := claimArgs(newKey("a")), claimArgs(newKey("b"))
	txA, txB := b.begin(ctx, t), b.begin(ctx, t)
	_, err := b.d.Tx(txA).Claim(ctx, a)
	require.NoError(t, err)
	_, err = b.d.Tx(txB).Claim(ctx, c)
	require.NoError(t, err)

	errs := make(chan error, 2)
	go func() {
		_, err := b.d.Tx(txA).Claim(ctx, c)
		errs <- err
	}()
	time.Sleep(300 * time.Millisecond) // let A wait for B's key
	_, err = b.d.Tx(txB).Claim(ctx, a)
	errs <- err
	var victims int
	for range 2 {
		if err := <-errs; err != nil {
			require.ErrorIs(t, err, idem.ErrRetryable)
			require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
			require.NotErrorIs(t, err, idem.ErrInProgress)
			require.NotNil(t, driverError(err), "the driver's error stays reachable: %#v", err)
			victims++
		}
	}
	require.Equal(t, 1, victims)
}

// testExecutorRollbackFinishedTx: rolling back a finished transaction is
// not an error, however often.
func testExecutorRollbackFinishedTx[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	for _, commit := range []bool{true, false} {
		tx, err := b.d.Begin(ctx)
		require.NoError(t, err)
		if commit {
			require.NoError(t, b.d.Commit(ctx, tx))
		} else {
			require.NoError(t, b.d.Rollback(ctx, tx))
		}
		require.NoError(t, b.d.Rollback(ctx, tx))
		require.NoError(t, b.d.Rollback(ctx, tx))
	}
}

// driverError returns the first error in err's tree that comes from neither
// the standard library's wrapping nor idem itself: the driver's.
func driverError(err error) error {
	if err == nil {
		return nil
	}
	typ := reflect.TypeOf(err)
	if typ.Kind() == reflect.Pointer {
		typ = typ.Elem()
	}
	if pkg := typ.PkgPath(); pkg != "errors" && pkg != "fmt" && !strings.HasPrefix(pkg, "github.com/idemstore/idem") {
		return err
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return driverError(u.Unwrap())
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if d := driverError(e); d != nil {
				return d
			}
		}
	}
	return nil
}
