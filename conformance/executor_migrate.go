package conformance

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func executorMigrateCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "ExecutorMigrate", run: testExecutorMigrate[TTx]},
		{name: "ExecutorMigrateClosedPool", run: testExecutorMigrateClosedPool[TTx]},
	}
}

// testExecutorMigrate: Migrate again is a no-op that keeps the records, also
// when callers run it at once; after every down migration the table is gone
// (statements fail, and not as a missing record) and Migrate brings it back.
func testExecutorMigrate[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	p := b.seed(ctx, t, newKey("kept"), exClock, time.Minute, time.Hour)
	require.NoError(t, b.ns.Migrate(ctx))
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Go(func() { errs[i] = b.ns.Migrate(ctx) })
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "concurrent caller %d", i)
	}
	require.Equal(t, p.Token, b.record(ctx, t, p).Token, "migrating again keeps the records")

	require.NoError(t, b.ns.Unmigrate(ctx))
	_, err := b.ex.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: &longAgo})
	require.Error(t, err, "the table is gone")
	require.NotErrorIs(t, err, idem.ErrNotFound)
	require.NotErrorIs(t, err, idem.ErrStoreUnavailable)

	require.NoError(t, b.ns.Migrate(ctx), "up again after a full down")
	require.False(t, b.exists(ctx, t, p.Key))
	b.seed(ctx, t, p.Key, exClock, time.Minute, time.Hour)
}

// testExecutorMigrateClosedPool: Migrate on a closed pool is an unavailable
// store on every dialect, like every other statement on it, so a start-up
// that retries on ErrStoreUnavailable treats it alike everywhere.
func testExecutorMigrateClosedPool[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	b.ns.Close()
	err := b.ns.Migrate(ctx)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	require.NotErrorIs(t, err, idem.ErrMisconfigured)
}
