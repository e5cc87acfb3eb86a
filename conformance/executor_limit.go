package conformance

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// testExecutorLimitBelowOne: a Limit below 1 is refused with an error by
// DeleteExpired and ListStaleLeases on every dialect, and deletes nothing.
// Before this case MySQL without interpolateParams read LIMIT -1 as no
// limit and deleted every expired record, and SQLite took LIMIT 0 as zero
// rows while PostgreSQL refused it.
func testExecutorLimitBelowOne[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := exSetup(t, h)
	now := exClock
	keys := []string{"lim-1", "lim-2", "lim-3"}
	for i, k := range keys {
		b.seed(ctx, t, k, now.Add(-time.Duration(i+2)*time.Hour), time.Minute, time.Hour)
	}
	for _, limit := range []int{0, -1, -1 << 31} {
		n, err := b.ex.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: limit, Now: &now})
		require.Error(t, err, "DeleteExpired Limit %d", limit)
		require.Contains(t, err.Error(), "limit", "the error names the limit")
		require.Zero(t, n)
		recs, _, err := b.ex.ListStaleLeases(ctx, &idem.ListStaleLeasesParams{Limit: limit, Now: &now})
		require.Error(t, err, "ListStaleLeases Limit %d", limit)
		require.Contains(t, err.Error(), "limit", "the error names the limit")
		require.Empty(t, recs)
	}
	require.Equal(t, keys, b.stored(ctx, t, keys...), "nothing was deleted")
}
