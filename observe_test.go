package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/digest"
	"github.com/idemstore/idem/sqlite"
)

// recorder collects an Observer's events.
type recorder struct {
	mu       sync.Mutex
	claims   []idem.ClaimEvent
	complete []idem.CompleteEvent
	leases   []idem.LeaseEvent
	checks   []idem.StatusCheckEvent
	reaps    []idem.ReapEvent
}

func (r *recorder) observer() *idem.Observer {
	lock := func(f func()) { r.mu.Lock(); defer r.mu.Unlock(); f() }
	return &idem.Observer{
		Operation: func(scope string) string {
			op, _, _ := strings.Cut(scope, ":")
			return op
		},
		Claim:       func(_ context.Context, e idem.ClaimEvent) { lock(func() { r.claims = append(r.claims, e) }) },
		Complete:    func(_ context.Context, e idem.CompleteEvent) { lock(func() { r.complete = append(r.complete, e) }) },
		Lease:       func(_ context.Context, e idem.LeaseEvent) { lock(func() { r.leases = append(r.leases, e) }) },
		StatusCheck: func(_ context.Context, e idem.StatusCheckEvent) { lock(func() { r.checks = append(r.checks, e) }) },
		Reap:        func(_ context.Context, e idem.ReapEvent) { lock(func() { r.reaps = append(r.reaps, e) }) },
	}
}

func (r *recorder) claimOutcomes() []idem.ClaimOutcome {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []idem.ClaimOutcome
	for _, e := range r.claims {
		out = append(out, e.Outcome)
	}
	return out
}

// TestObserverClaims runs the scripted sequence through Claim, Do and
// Acquire and checks each event's outcome, operation and digest.
func TestObserverClaims(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	d := newSQLiteDialect(t)
	rec := &recorder{}
	store, err := idem.New(d, &idem.Config{Observer: rec.observer(), WaitTimeout: 10 * time.Millisecond})
	require.NoError(t, err)
	quiet, err := idem.New(d, nil) // a holder that is not observed
	require.NoError(t, err)

	fp, other := idem.NewFingerprint([]byte("a")), idem.NewFingerprint([]byte("b"))
	resp := &idem.Response{StatusCode: 201, Body: []byte(`{"id":1}`)}

	c, err := store.Claim(ctx, "orders:acme", "k1", fp)
	require.NoError(t, err)
	require.NoError(t, store.Complete(ctx, c, resp))
	for range 2 {
		_, err = store.Claim(ctx, "orders:acme", "k1", fp)
		require.NoError(t, err)
	}
	_, err = store.Claim(ctx, "orders:acme", "k1", other)
	require.ErrorIs(t, err, idem.ErrFingerprint)
	_, err = quiet.Claim(ctx, "orders:acme", "k2", fp)
	require.NoError(t, err)
	_, err = store.Claim(ctx, "orders:acme", "k2", fp)
	require.ErrorIs(t, err, idem.ErrInProgress)

	// Do: one acquired claim and one stored completion, then a replay.
	do := func() (*idem.Result, error) {
		return store.Do(ctx, "pay:acme", "k3", fp, func(context.Context, *sql.Tx) (*idem.Response, error) { return resp, nil })
	}
	_, err = do()
	require.NoError(t, err)
	res, err := do()
	require.NoError(t, err)
	require.True(t, res.Replayed)

	// An unreachable store sharing the observer.
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "missing", "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	down, err := idem.New(sqlite.New(db), &idem.Config{Observer: rec.observer()})
	require.NoError(t, err)
	_, err = down.Claim(ctx, "orders:acme", "k4", fp)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	_, err = down.Do(ctx, "pay:acme", "k4", fp, func(context.Context, *sql.Tx) (*idem.Response, error) { return resp, nil })
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)

	require.Equal(t, []idem.ClaimOutcome{
		idem.ClaimAcquired, idem.ClaimReplayed, idem.ClaimReplayed, idem.ClaimMismatch, idem.ClaimInProgress,
		idem.ClaimAcquired, idem.ClaimReplayed,
		idem.ClaimStoreUnavailable, idem.ClaimStoreUnavailable,
	}, rec.claimOutcomes())
	for i, e := range rec.claims {
		require.Equal(t, "sqlite", e.Dialect, i)
		require.Len(t, e.KeyDigest, 16, i)
		require.NotContains(t, e.KeyDigest, "acme", i)
		require.GreaterOrEqual(t, e.Latency, time.Duration(0), i)
	}
	require.Equal(t, digest.Key("orders:acme", "k1"), rec.claims[0].KeyDigest)
	require.Equal(t, "orders", rec.claims[0].Operation)
	require.Equal(t, "pay", rec.claims[5].Operation)
	require.Equal(t, 1, rec.claims[0].Attempt)
	require.Zero(t, rec.claims[1].Attempt)

	require.Len(t, rec.complete, 2)
	for _, e := range rec.complete {
		require.Equal(t, idem.CompleteStored, e.Outcome)
		require.Equal(t, idem.StatusSucceeded, e.Status)
		require.Equal(t, len(resp.Body), e.ResponseBytes)
	}
	require.Equal(t, "orders", rec.complete[0].Operation)
	require.Equal(t, "pay", rec.complete[1].Operation)

	// A completion of a claim that lost its key is reported as fenced.
	require.ErrorIs(t, store.Complete(ctx, c, resp), idem.ErrFenced)
	require.Equal(t, idem.CompleteFenced, rec.complete[2].Outcome)
}

// TestObserverLeases covers renewals, a lost lease, a status check that
// hands a stale key over, and a reaper pass.
func TestObserverLeases(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	d := newSQLiteDialect(t)
	rec := &recorder{}
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(dt time.Duration) { mu.Lock(); defer mu.Unlock(); now = now.Add(dt) }
	checkErr := errors.New("provider down")
	verdicts := []func() (idem.Verdict, error){
		func() (idem.Verdict, error) { return idem.Unknown(), checkErr },
		func() (idem.Verdict, error) { return idem.NotCommitted(), nil },
	}
	var calls int
	store, err := idem.New(d, &idem.Config{
		Observer: rec.observer(), Now: clock, LeaseDuration: time.Minute,
		StatusCheck: func(context.Context, idem.Record) (idem.Verdict, error) {
			mu.Lock()
			f := verdicts[min(calls, len(verdicts)-1)]
			calls++
			mu.Unlock()
			return f()
		},
	})
	require.NoError(t, err)
	fp := idem.NewFingerprint([]byte("a"))

	l, err := store.Acquire(ctx, "pay:acme", "k1", fp)
	require.NoError(t, err)
	require.NoError(t, l.Renew(ctx))
	advance(2 * time.Minute) // the lease runs out
	// The first check fails (unknown); the claimer is told to wait.
	_, err = store.Acquire(ctx, "pay:acme", "k1", fp)
	require.ErrorIs(t, err, idem.ErrInProgress)
	advance(time.Hour)
	// The second says not committed: the key is taken over.
	l2, err := store.Acquire(ctx, "pay:acme", "k1", fp)
	require.NoError(t, err)
	require.Equal(t, 2, l2.Attempt())
	require.ErrorIs(t, l.Renew(ctx), idem.ErrFenced)

	require.Equal(t, []idem.LeaseEventKind{idem.LeaseRenewed, idem.LeaseTakenOver, idem.LeaseLost}, leaseKinds(rec))
	require.Equal(t, 2, rec.leases[1].Attempt)
	require.Equal(t, "pay", rec.leases[1].Operation)
	require.Len(t, rec.checks, 2)
	require.Equal(t, idem.VerdictUnknown, rec.checks[0].Verdict)
	require.True(t, rec.checks[0].Failed)
	require.Equal(t, idem.VerdictNotCommitted, rec.checks[1].Verdict)
	require.False(t, rec.checks[1].Failed)
	require.Equal(t, 1, rec.checks[1].Attempt)

	// A reaper pass over four expired records and one stale lease, in
	// batches of one with at most two batches: behind.
	for _, k := range []string{"k2", "k3", "k4"} {
		c, err := store.Claim(ctx, "orders:acme", k, fp)
		require.NoError(t, err)
		require.NoError(t, store.Complete(ctx, c, &idem.Response{StatusCode: 200}))
	}
	advance(48 * time.Hour)
	_, err = store.Acquire(ctx, "pay:acme", "k5", fp)
	require.NoError(t, err)
	advance(2 * time.Minute)
	reaper, err := idem.NewReaper(store, &idem.ReaperConfig{BatchSize: 1, MaxBatches: 2})
	require.NoError(t, err)
	_, err = reaper.RunOnce(ctx)
	require.NoError(t, err)
	require.Len(t, rec.reaps, 1)
	e := rec.reaps[0]
	require.Equal(t, 2, e.Report.Deleted)
	require.Equal(t, 2, e.Batches)
	require.True(t, e.Behind)
	require.Equal(t, 1, e.StaleFound)
	require.Equal(t, 1, e.Report.HandedOver)
	require.Zero(t, e.StaleLeft)
	require.Equal(t, "sqlite", e.Dialect)
}

func leaseKinds(r *recorder) []idem.LeaseEventKind {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []idem.LeaseEventKind
	for _, e := range r.leases {
		out = append(out, e.Kind)
	}
	return out
}

// BenchmarkObserver compares a replayed Claim on SQLite without an Observer
// and with one whose hooks do nothing: what the hooks themselves cost when
// set (the key digest and the event). BenchmarkIdem in each dialect's
// package measures the unset path against the bare transaction.
func BenchmarkObserver(b *testing.B) {
	ctx := context.Background()
	db, err := sqlite.Open(filepath.Join(b.TempDir(), "idem.db"))
	require.NoError(b, err)
	b.Cleanup(func() { _ = db.Close() })
	require.NoError(b, sqlite.Migrate(ctx, db))
	fp := idem.NewFingerprint([]byte("a"))
	noop := &idem.Observer{
		Claim:    func(context.Context, idem.ClaimEvent) {},
		Complete: func(context.Context, idem.CompleteEvent) {},
	}
	for _, bc := range []struct {
		name string
		obs  *idem.Observer
	}{{"unset", nil}, {"noop", noop}} {
		b.Run(bc.name, func(b *testing.B) {
			store, err := idem.New(sqlite.New(db), &idem.Config{Observer: bc.obs})
			require.NoError(b, err)
			c, err := store.Claim(ctx, "bench", bc.name, fp)
			require.NoError(b, err)
			require.NoError(b, store.Complete(ctx, c, &idem.Response{StatusCode: 200}))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := store.Claim(ctx, "bench", bc.name, fp); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
