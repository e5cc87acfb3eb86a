package conformance

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// Decisions the rest of the suite left unpinned, found by mutation testing
// (internal/cmd/mutate, docs/reliability.md "Mutation testing"): each case
// fails on a mutant of the decision code that every other case let through.
func decisionCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "DecisionUnknownDelayGrowsWithAge", run: testDecisionUnknownDelayGrowsWithAge[TTx]},
		{name: "DecisionReaperStaleLimitOne", run: testDecisionReaperStaleLimitOne[TTx]},
		{name: "DecisionClaimDoesNotRetryFinalErrors", run: testDecisionClaimDoesNotRetryFinalErrors[TTx]},
		{name: "DecisionDoFailedCompletionCommitsNothing", run: testDecisionDoFailedCompletionCommitsNothing[TTx]},
	}
}

// testDecisionUnknownDelayGrowsWithAge: an unknown verdict pushes the lease
// out by an eighth of the record's age (at least one lease duration, at
// most 15 minutes), so a check that keeps failing on an old record is asked
// less and less often. The exact deadlines are what a retry's RetryAfter
// and the next check depend on.
func testDecisionUnknownDelayGrowsWithAge[TTx any](t *testing.T, h Harness[TTx]) {
	var checks counter
	check := func(context.Context, idem.Record) (idem.Verdict, error) {
		checks.inc()
		return idem.Unknown(), nil
	}
	ctx, b, clk := leaseSetup(t, h, check)
	key := newKey("unknown-delay")
	created := clk.Now()
	_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)

	for i, step := range []struct {
		age   time.Duration // of the record when a claimer finds it stale
		delay time.Duration // the lease pushed out from then
	}{
		{age: 31 * time.Second, delay: 30 * time.Second}, // young: one lease duration
		{age: 80 * time.Minute, delay: 10 * time.Minute},
		{age: 280 * time.Minute, delay: 15 * time.Minute}, // 35m, capped
	} {
		clk.advance(created.Add(step.age).Sub(clk.Now()))
		_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		var ip *idem.InProgressError
		require.ErrorAs(t, err, &ip, "step %d", i)
		require.Equal(t, i+1, checks.get(), "step %d: the stale lease is checked once", i)
		rec, err := b.store.Get(ctx, "t1/pay", key)
		require.NoError(t, err)
		require.WithinDuration(t, clk.Now().Add(step.delay), rec.LeaseExpiresAt, b.feat.TimePrecision,
			"step %d: the unknown verdict's lease", i)
		// Just before the pushed-out lease ends, no new check; just after, one.
		clk.advance(step.delay - time.Millisecond)
		_, err = b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		require.ErrorIs(t, err, idem.ErrInProgress)
		require.Equal(t, i+1, checks.get(), "step %d: checked again before the lease ran out", i)
		clk.advance(time.Millisecond)
	}
}

// testDecisionReaperStaleLimitOne: the smallest StaleLimit still resolves a
// stale lease (a dialect's listing must accept a limit of one).
func testDecisionReaperStaleLimitOne[TTx any](t *testing.T, h Harness[TTx]) {
	check := func(_ context.Context, rec idem.Record) (idem.Verdict, error) {
		return idem.Committed(chargedResponse(rec.Key)), nil
	}
	ctx, b, clk := leaseSetup(t, h, check)
	keys := []string{newKey("limit-one-a"), newKey("limit-one-b")}
	for _, key := range keys {
		_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		require.NoError(t, err)
		clk.advance(time.Second) // distinct lease deadlines: a oldest
	}
	clk.advance(31 * time.Second)
	r, err := idem.NewReaper(b.store, &idem.ReaperConfig{StaleLimit: 1})
	require.NoError(t, err)
	rep, err := r.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, idem.ReapReport{Finalised: 1}, rep)

	// The oldest lease went first; the other waits for the next pass.
	rec, err := b.store.Get(ctx, "t1/pay", keys[0])
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
	rec, err = b.store.Get(ctx, "t1/pay", keys[1])
	require.NoError(t, err)
	require.Equal(t, idem.StatusProcessing, rec.Status)
}

// testDecisionClaimDoesNotRetryFinalErrors: a pool-level Claim retries only
// ErrRetryable (a deadlock victim). A fingerprint mismatch or a live holder
// is the answer, given after one claim statement: retrying it would only
// add round trips and backoff sleeps to every conflicting request.
func testDecisionClaimDoesNotRetryFinalErrors[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: time.Minute, MaxTxRetries: 5})
	key := newKey("no-retry")
	_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)

	counted := &claimCounter[TTx]{Dialect: b.ns.Dialect}
	store, err := idem.New[TTx](counted, &idem.Config{LeaseDuration: time.Minute, MaxTxRetries: 5})
	require.NoError(t, err)
	for _, body := range []string{"x", "y"} { // live holder; then another fingerprint as well
		counted.claims.Store(0)
		_, err = store.Claim(ctx, "t1/pay", key, fp(body))
		require.Error(t, err, "body %q", body)
		require.NotErrorIs(t, err, idem.ErrRetryable, "body %q", body)
		require.Equal(t, int64(1), counted.claims.Load(), "body %q: claim statements for one Claim", body)
	}
}

// claimCounter is a Dialect whose pool executor counts Executor.Claim calls.
type claimCounter[TTx any] struct {
	idem.Dialect[TTx]
	claims atomic.Int64
}

func (c *claimCounter[TTx]) DB() idem.Executor {
	return countingExecutor{Executor: c.Dialect.DB(), claims: &c.claims}
}

type countingExecutor struct {
	idem.Executor
	claims *atomic.Int64
}

func (e countingExecutor) Claim(ctx context.Context, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	e.claims.Add(1)
	return e.Executor.Claim(ctx, p)
}

// testDecisionDoFailedCompletionCommitsNothing: when Do cannot store the
// response (the completion statement fails), it must not commit the
// callback's effect either: the effect without its record would run again
// on the client's retry. The failure is injected by a Dialect whose
// transaction executor refuses Complete; Do then takes its plain path
// (Begin, Claim, callback, Complete, Commit) on every dialect.
func testDecisionDoFailedCompletionCommitsNothing[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	injected := errors.New("injected completion failure")
	store, err := idem.New[TTx](&failingComplete[TTx]{Dialect: b.ns.Dialect, err: injected}, nil)
	require.NoError(t, err)
	key := newKey("failed-completion")
	var calls counter
	_, err = store.Do(ctx, "t1/orders", key, fp("x"), orderFn(b.ns, key, &calls))
	require.ErrorIs(t, err, injected)
	require.Equal(t, 1, calls.get())
	require.Zero(t, b.orders(ctx, t, key), "the effect was committed without its record")
	require.Zero(t, b.records(ctx, t))

	// The retry, on a store that can complete, runs the effect once.
	res, err := b.store.Do(ctx, "t1/orders", key, fp("x"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.False(t, res.Replayed)
	require.Equal(t, 1, b.orders(ctx, t, key))
}

// failingComplete is a Dialect whose transaction executors fail Complete.
type failingComplete[TTx any] struct {
	idem.Dialect[TTx]
	err error
}

func (d *failingComplete[TTx]) Tx(tx TTx) idem.Executor {
	return failingCompleteExecutor{Executor: d.Dialect.Tx(tx), err: d.err}
}

type failingCompleteExecutor struct {
	idem.Executor
	err error
}

func (e failingCompleteExecutor) Complete(context.Context, *idem.CompleteParams) error { return e.err }
