package idem_test

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/sqlite"
)

// cacheFixture is a migrated SQLite database, its handle kept so that a
// test can close it and see which answers still come without it.
type cacheFixture struct {
	db    *sql.DB
	calls atomic.Int64
}

func newCacheFixture(t *testing.T) *cacheFixture {
	t.Helper()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, sqlite.Migrate(t.Context(), db))
	return &cacheFixture{db: db}
}

func (f *cacheFixture) store(t *testing.T, cfg *idem.Config) *idem.Store[*sql.Tx] {
	t.Helper()
	s, err := idem.New(sqlite.New(f.db), cfg)
	require.NoError(t, err)
	return s
}

// do runs Do on key with a callback that counts its runs and answers the
// run's number.
func (f *cacheFixture) do(ctx context.Context, s *idem.Store[*sql.Tx], scope, key, body string) (*idem.Result, error) {
	return s.Do(ctx, scope, key, idem.NewFingerprint([]byte(body)), func(context.Context, *sql.Tx) (*idem.Response, error) {
		n := f.calls.Add(1)
		return &idem.Response{StatusCode: 201, Header: map[string][]string{"X-Run": {fmt.Sprint(n)}}, Body: fmt.Appendf(nil, "run %d", n)}, nil
	})
}

func TestReplayCacheAnswersWithoutTheDatabase(t *testing.T) {
	f := newCacheFixture(t)
	cached := f.store(t, &idem.Config{ReplayCache: &idem.ReplayCacheConfig{}})
	plain := f.store(t, nil)
	ctx := t.Context()

	_, err := f.do(ctx, cached, "s", "k1", "a")
	require.NoError(t, err)
	_, err = f.do(ctx, plain, "s", "k2", "a")
	require.NoError(t, err)
	require.NoError(t, f.db.Close())

	res, err := f.do(ctx, cached, "s", "k1", "a")
	require.NoError(t, err)
	require.True(t, res.Replayed)
	require.Equal(t, "run 1", string(res.Response.Body))
	require.Equal(t, "1", res.Response.Header.Get("X-Run"))
	require.EqualValues(t, 2, f.calls.Load())

	// Without the cache the same replay needs the database, now closed.
	_, err = f.do(ctx, plain, "s", "k2", "a")
	require.Error(t, err)
	// Another fingerprint is never answered from the cache: the database
	// decides, and it is gone.
	_, err = f.do(ctx, cached, "s", "k1", "b")
	require.Error(t, err)
	require.NotErrorIs(t, err, idem.ErrFingerprint)
	require.EqualValues(t, 2, f.calls.Load())
}

func TestReplayCacheFillsFromReplays(t *testing.T) {
	for name, read := range map[string]idem.ReplayRead{"claim": idem.ReplayReadNever, "read first": idem.ReplayReadAlways} {
		t.Run(name, func(t *testing.T) {
			f := newCacheFixture(t)
			writer := f.store(t, nil)
			reader := f.store(t, &idem.Config{ReplayRead: read, ReplayCache: &idem.ReplayCacheConfig{}})
			ctx := t.Context()
			_, err := f.do(ctx, writer, "s", "k", "a")
			require.NoError(t, err)
			res, err := f.do(ctx, reader, "s", "k", "a") // from the database, then cached
			require.NoError(t, err)
			require.True(t, res.Replayed)
			require.NoError(t, f.db.Close())
			res, err = f.do(ctx, reader, "s", "k", "a")
			require.NoError(t, err)
			require.True(t, res.Replayed)
			require.Equal(t, "run 1", string(res.Response.Body))
		})
	}
}

func TestReplayCacheForgetsWhatThisStoreDeletes(t *testing.T) {
	f := newCacheFixture(t)
	s := f.store(t, &idem.Config{ReplayCache: &idem.ReplayCacheConfig{}})
	ctx := t.Context()
	for _, k := range []string{"k1", "k2", "k3"} {
		_, err := f.do(ctx, s, "s", k, "a")
		require.NoError(t, err)
	}
	_, err := f.do(ctx, s, "other", "k1", "a")
	require.NoError(t, err)

	require.NoError(t, s.Delete(ctx, "s", "k1", &idem.DeleteOptions{Force: true}))
	res, err := f.do(ctx, s, "s", "k1", "a")
	require.NoError(t, err)
	require.False(t, res.Replayed, "a deleted key runs again")

	n, err := s.PurgeScope(ctx, "s", &idem.DeleteOptions{Force: true})
	require.NoError(t, err)
	require.Equal(t, 3, n)
	for _, k := range []string{"k2", "k3"} {
		res, err := f.do(ctx, s, "s", k, "a")
		require.NoError(t, err)
		require.False(t, res.Replayed, "a purged key runs again")
	}
	res, err = f.do(ctx, s, "other", "k1", "a")
	require.NoError(t, err)
	require.True(t, res.Replayed, "another scope keeps its records")
	require.EqualValues(t, 7, f.calls.Load())
}

// A replay's read gives the record's deadline on the database's clock,
// which may run ahead of the process's: a record with less than two MaxAge
// left is not cached from a replay, so that no entry outlives its record
// while the clocks differ by less than MaxAge.
func TestReplayCacheLeavesRecordsNearTheirDeadline(t *testing.T) {
	for _, tc := range []struct {
		maxAge time.Duration
		cached bool
	}{
		{maxAge: 20 * time.Minute, cached: true},  // an hour left, 40 minutes needed
		{maxAge: 40 * time.Minute, cached: false}, // an hour left, 80 minutes needed
	} {
		t.Run(tc.maxAge.String(), func(t *testing.T) {
			f := newCacheFixture(t)
			writer := f.store(t, &idem.Config{Retention: time.Hour})
			reader := f.store(t, &idem.Config{Retention: time.Hour, ReplayRead: idem.ReplayReadAlways,
				ReplayCache: &idem.ReplayCacheConfig{MaxAge: tc.maxAge}})
			ctx := t.Context()
			_, err := f.do(ctx, writer, "s", "k", "a")
			require.NoError(t, err)
			res, err := f.do(ctx, reader, "s", "k", "a")
			require.NoError(t, err)
			require.True(t, res.Replayed)
			require.NoError(t, f.db.Close())
			res, err = f.do(ctx, reader, "s", "k", "a")
			if !tc.cached {
				require.Error(t, err, "not cached: the closed database is asked")
				return
			}
			require.NoError(t, err)
			require.True(t, res.Replayed)
		})
	}
}

func TestReplayCacheEntriesEnd(t *testing.T) {
	f := newCacheFixture(t)
	s := f.store(t, &idem.Config{ReplayCache: &idem.ReplayCacheConfig{MaxEntries: 2, MaxAge: time.Hour}})
	aged := f.store(t, &idem.Config{ReplayCache: &idem.ReplayCacheConfig{MaxAge: 30 * time.Millisecond}})
	ctx := t.Context()
	for _, k := range []string{"k1", "k2", "k3"} {
		_, err := f.do(ctx, s, "s", k, "a")
		require.NoError(t, err)
	}
	_, err := f.do(ctx, aged, "s", "aged", "a")
	require.NoError(t, err)
	time.Sleep(60 * time.Millisecond)
	require.NoError(t, f.db.Close())

	_, err = f.do(ctx, s, "s", "k1", "a")
	require.Error(t, err, "the least recently used entry was evicted past MaxEntries")
	for _, k := range []string{"k2", "k3"} {
		res, err := f.do(ctx, s, "s", k, "a")
		require.NoError(t, err)
		require.True(t, res.Replayed)
	}
	_, err = f.do(ctx, aged, "s", "aged", "a")
	require.Error(t, err, "an entry past MaxAge is not answered")
}

// With Config.Now pinned, the cache keeps the pinned clock, the one the
// records' deadlines are on: moved past MaxAge, the entry no longer
// answers, and moved past the record's retention, the key runs again.
func TestReplayCacheKeepsThePinnedClock(t *testing.T) {
	f := newCacheFixture(t)
	var mu sync.Mutex
	clock := time.Date(2026, 12, 7, 10, 0, 0, 0, time.UTC)
	now := func() time.Time { mu.Lock(); defer mu.Unlock(); return clock }
	advance := func(d time.Duration) { mu.Lock(); clock = clock.Add(d); mu.Unlock() }
	s := f.store(t, &idem.Config{
		LeaseDuration: time.Minute, Retention: time.Hour, Now: now,
		ReplayCache: &idem.ReplayCacheConfig{MaxAge: time.Hour},
	})
	ctx := t.Context()
	_, err := f.do(ctx, s, "s", "k", "a")
	require.NoError(t, err)
	res, err := f.do(ctx, s, "s", "k", "a")
	require.NoError(t, err)
	require.True(t, res.Replayed)

	advance(time.Hour + time.Second)
	res, err = f.do(ctx, s, "s", "k", "a")
	require.NoError(t, err)
	require.False(t, res.Replayed, "past its retention on the pinned clock, the key runs again")
	require.Equal(t, "run 2", string(res.Response.Body))
	require.EqualValues(t, 2, f.calls.Load())
}

func TestReplayCacheHandsOutCopies(t *testing.T) {
	f := newCacheFixture(t)
	s := f.store(t, &idem.Config{ReplayCache: &idem.ReplayCacheConfig{}})
	ctx := t.Context()
	first, err := f.do(ctx, s, "s", "k", "a")
	require.NoError(t, err)
	first.Response.Body[0] = 'X'
	first.Response.Header.Set("X-Run", "changed")
	res, err := f.do(ctx, s, "s", "k", "a")
	require.NoError(t, err)
	res.Response.Body[0] = 'Y'
	res, err = f.do(ctx, s, "s", "k", "a")
	require.NoError(t, err)
	require.Equal(t, "run 1", string(res.Response.Body))
	require.Equal(t, "1", res.Response.Header.Get("X-Run"))
}

func TestReplayCacheConfig(t *testing.T) {
	d := newSQLiteDialect(t)
	for name, c := range map[string]*idem.Config{
		"MaxAge beyond Retention": {Retention: time.Hour, ReplayCache: &idem.ReplayCacheConfig{MaxAge: 2 * time.Hour}},
		"negative MaxEntries":     {ReplayCache: &idem.ReplayCacheConfig{MaxEntries: -1}},
		"negative MaxBytes":       {ReplayCache: &idem.ReplayCacheConfig{MaxBytes: -1}},
		"negative MaxAge":         {ReplayCache: &idem.ReplayCacheConfig{MaxAge: -time.Second}},
	} {
		_, err := idem.New(d, c)
		require.Error(t, err, name)
	}
	// A Retention shorter than the default MaxAge bounds it.
	_, err := idem.New(d, &idem.Config{LeaseDuration: time.Second, Retention: 10 * time.Second, ReplayCache: &idem.ReplayCacheConfig{}})
	require.NoError(t, err)
}
