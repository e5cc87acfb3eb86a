package idemotel_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemotel"
	"github.com/idemstore/idem/internal/digest"
)

func TestLeasesChecksAndReaper(t *testing.T) {
	dialects(t, testLeasesChecksAndReaper[*sql.Tx], testLeasesChecksAndReaper[pgx.Tx])
}

// testLeasesChecksAndReaper renews a lease, loses it to a takeover after a
// not-committed verdict, and runs a reaper pass that is cut short and
// leaves one stale lease unknown: the lease, check and reaper metrics and
// the two gauges show exactly that.
func testLeasesChecksAndReaper[TTx any](t *testing.T, h harness[TTx]) {
	ctx := t.Context()
	ns := h.Open(t)
	x := newTelemetry(t)
	var mu sync.Mutex
	now := time.Now().UTC().Truncate(time.Second)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); defer mu.Unlock(); now = now.Add(d) }
	store, err := idem.New(ns.Dialect, &idem.Config{
		Observer: x.tel.Observer(), Now: clock, LeaseDuration: time.Minute,
		StatusCheck: func(_ context.Context, rec idem.Record) (idem.Verdict, error) {
			if rec.Key == "stale-key" {
				return idem.Unknown(), nil
			}
			return idem.NotCommitted(), nil
		},
	})
	require.NoError(t, err)
	fp := idem.NewFingerprint([]byte("a"))
	const scope = "payments"

	l, err := store.Acquire(ctx, scope, "pay-key", fp)
	require.NoError(t, err)
	require.NoError(t, l.Renew(ctx))
	advance(2 * time.Minute)
	l2, err := store.Acquire(ctx, scope, "pay-key", fp)
	require.NoError(t, err)
	require.Equal(t, 2, l2.Attempt())
	require.ErrorIs(t, l.Renew(ctx), idem.ErrFenced)

	for _, k := range []string{"old-1", "old-2", "old-3"} {
		c, err := store.Claim(ctx, scope, k, fp)
		require.NoError(t, err)
		require.NoError(t, store.Complete(ctx, c, &idem.Response{StatusCode: 200}))
	}
	advance(48 * time.Hour) // old-*, and pay-key, are past retention
	_, err = store.Acquire(ctx, scope, "stale-key", fp)
	require.NoError(t, err)
	advance(2 * time.Minute)
	reaper, err := idem.NewReaper(store, &idem.ReaperConfig{BatchSize: 1, MaxBatches: 2})
	require.NoError(t, err)
	rep, err := reaper.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, rep.Deleted)
	require.Equal(t, 1, rep.Unknown)

	// The same figures from the store's Stats: the two expired records
	// the pass left, and no stale lease (the unknown verdict pushed
	// stale-key's lease out).
	exact := newTelemetry(t, idemotel.WithStats(func(ctx context.Context) (*idem.Stats, error) { return store.Stats(ctx) }))
	rmExact := exact.collect(t)
	require.Equal(t, int64(2), gauge(t, rmExact, "idem.reaper.backlog"))
	require.Equal(t, int64(0), gauge(t, rmExact, "idem.leases.stale"))

	dialect := idemotel.AttrDialect.String(ns.Dialect.Name())
	rm := x.collect(t)
	require.Equal(t, map[string]int64{"renewed": 1, "taken_over": 1, "lost": 1},
		sums(t, rm, "idem.lease.events", idemotel.AttrLeaseEvent, dialect))
	require.Equal(t, map[string]int64{"not_committed": 1, "unknown": 1},
		sums(t, rm, "idem.status_checks", idemotel.AttrVerdict, dialect, idemotel.AttrFailed.Bool(false)))
	require.Equal(t, map[string]uint64{"not_committed": 1, "unknown": 1},
		counts(t, rm, "idem.status_check.duration", idemotel.AttrVerdict))
	require.Equal(t, map[string]int64{"": 2}, sums(t, rm, "idem.reaper.deleted", idemotel.AttrResolution, dialect))
	require.Equal(t, map[string]int64{"unknown": 1}, sums(t, rm, "idem.reaper.resolved", idemotel.AttrResolution, dialect))
	require.Equal(t, int64(1), gauge(t, rm, "idem.reaper.backlog"))
	require.Equal(t, int64(1), gauge(t, rm, "idem.leases.stale"))

	var checks []string
	for _, s := range x.spans.Ended() {
		if s.Name() == "idem.status_check" {
			checks = append(checks, attr(s, idemotel.AttrKeyDigest))
		}
	}
	require.Equal(t, []string{digest.Key(scope, "pay-key"), digest.Key(scope, "stale-key")}, checks)
}

func gauge(t *testing.T, rm metricdata.ResourceMetrics, name string) int64 {
	t.Helper()
	m := find(rm, name)
	require.NotNil(t, m, name)
	g, ok := m.Data.(metricdata.Gauge[int64])
	require.True(t, ok, "%s is %T", name, m.Data)
	require.Len(t, g.DataPoints, 1, name)
	return g.DataPoints[0].Value
}

// TestWithGauges: exact counts supplied by the caller replace the reaper's
// figures.
func TestWithGauges(t *testing.T) {
	t.Parallel()
	x := newTelemetry(t, idemotel.WithGauges(func(context.Context) (idemotel.Gauges, error) {
		return idemotel.Gauges{Backlog: 7, StaleLeases: 3}, nil
	}))
	rm := x.collect(t)
	require.Equal(t, int64(7), gauge(t, rm, "idem.reaper.backlog"))
	require.Equal(t, int64(3), gauge(t, rm, "idem.leases.stale"))
}
