package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	msqlite "modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/migrations"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// testBundle is what most tests need: a migrated database and a store on it.
type testBundle struct {
	db      *sql.DB
	dialect *idemsqlite.Dialect
	store   *idem.Store[*sql.Tx]
}

func setup(t *testing.T, cfg *idem.Config) (context.Context, *testBundle) {
	t.Helper()
	ctx := t.Context()
	db := openDB(ctx, t)
	d := idemsqlite.New(db)
	store, err := idem.New(d, cfg)
	require.NoError(t, err)
	return ctx, &testBundle{db: db, dialect: d, store: store}
}

// begin starts a transaction through the dialect, rolled back at the end of
// the test if the test did not finish it.
func (b *testBundle) begin(ctx context.Context, t *testing.T) *sql.Tx {
	t.Helper()
	tx, err := b.dialect.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.dialect.Rollback(context.WithoutCancel(ctx), tx) })
	return tx
}

// sqliteCode returns the extended result code of the SQLite error in err's
// chain, or 0 if there is none.
func sqliteCode(err error) int {
	var serr *msqlite.Error
	if errors.As(err, &serr) {
		return serr.Code()
	}
	return 0
}

func fp(s string) idem.Fingerprint { return idem.NewFingerprint([]byte(s)) }

func TestMigrate(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })

	objects := func() []string {
		t.Helper()
		rows, err := db.QueryContext(ctx,
			`SELECT name FROM sqlite_master WHERE tbl_name = 'idempotency_keys' AND name NOT LIKE 'sqlite_%'`)
		require.NoError(t, err)
		var names []string
		for rows.Next() {
			var name string
			require.NoError(t, rows.Scan(&name))
			names = append(names, name)
		}
		require.NoError(t, rows.Err())
		return names
	}
	schema := []string{"idempotency_keys", "idempotency_keys_expires_at_idx", "idempotency_keys_stale_lease_idx"}

	require.NoError(t, idemsqlite.Migrate(ctx, db))
	require.ElementsMatch(t, schema, objects())
	require.NoError(t, idemsqlite.Migrate(ctx, db), "a second run is a no-op")

	p, err := migrations.NewProvider(migrations.SQLite, db)
	require.NoError(t, err)
	_, err = p.DownTo(ctx, 0)
	require.NoError(t, err)
	require.Empty(t, objects())

	require.NoError(t, idemsqlite.Migrate(ctx, db), "up again after down")
	require.ElementsMatch(t, schema, objects())
}

func TestOpen(t *testing.T) {
	t.Parallel()

	t.Run("Settings", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })

		var journal string
		require.NoError(t, db.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&journal))
		require.Equal(t, "wal", journal)
		for pragma, want := range map[string]int{"busy_timeout": 5000, "synchronous": 2, "foreign_keys": 1} {
			var got int
			require.NoError(t, db.QueryRowContext(ctx, `PRAGMA `+pragma).Scan(&got))
			require.Equal(t, want, got, pragma)
		}
	})

	t.Run("PathTakenLiterally", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		dir := t.TempDir()
		path := filepath.Join(dir, "a?mode=ro#x%41 b.db")
		db, err := idemsqlite.Open(path)
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		require.NoError(t, idemsqlite.Migrate(ctx, db))
		_, err = os.Stat(path)
		require.NoError(t, err, "the file has exactly the given name")
	})

	t.Run("RelativePath", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		dir := t.TempDir()
		rel, err := filepath.Rel(mustGetwd(t), filepath.Join(dir, "rel.db"))
		require.NoError(t, err)
		db, err := idemsqlite.Open(rel)
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		require.NoError(t, db.PingContext(ctx))
		_, err = os.Stat(filepath.Join(dir, "rel.db"))
		require.NoError(t, err)
	})

	t.Run("RejectsNonFiles", func(t *testing.T) {
		t.Parallel()
		for _, path := range []string{"", ":memory:", "file:idem.db", "file::memory:?cache=shared"} {
			_, err := idemsqlite.Open(path)
			require.Error(t, err, "%q", path)
		}
	})
}

func mustGetwd(t *testing.T) string {
	t.Helper()
	wd, err := os.Getwd()
	require.NoError(t, err)
	return wd
}

// Writers through Open's DB queue on the database lock instead of failing,
// even when each transaction reads before it writes (which a DEFERRED
// transaction could not do under contention).
func TestOpenConcurrentWritersQueue(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, nil)

	const writers = 20
	errs := make(chan error, writers)
	var wg sync.WaitGroup
	for range writers {
		wg.Go(func() {
			errs <- func() error {
				tx, err := b.db.BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				defer func() { _ = tx.Rollback() }()
				var n int
				if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil {
					return err
				}
				if _, err := tx.ExecContext(ctx, `INSERT INTO orders (ref) VALUES (?)`, "w"); err != nil {
					return err
				}
				return tx.Commit()
			}()
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	var n int
	require.NoError(t, b.db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n))
	require.Equal(t, writers, n)
}

// The pool-level Claim waits for the write lock up to WaitTimeout, not the
// DSN's 5s busy timeout, then reports the database as busy.
func TestClaimWaitBoundedByWaitTimeout(t *testing.T) {
	t.Parallel()
	const wait = 150 * time.Millisecond
	ctx, b := setup(t, &idem.Config{WaitTimeout: wait})
	// One connection for the holder, one for the claim: the claim's
	// connection is the one checked afterwards.
	b.db.SetMaxOpenConns(2)

	holder := b.begin(ctx, t)
	_, err := holder.ExecContext(ctx, `INSERT INTO orders (ref) VALUES ('held')`)
	require.NoError(t, err)

	start := time.Now()
	_, err = b.store.Claim(ctx, "orders", "k1", fp("a"))
	elapsed := time.Since(start)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	require.NotErrorIs(t, err, idem.ErrInProgress)
	require.Equal(t, sqlite3.SQLITE_BUSY, sqliteCode(err)&0xff)
	require.GreaterOrEqual(t, elapsed, wait-10*time.Millisecond)
	require.Less(t, elapsed, 3*time.Second, "bounded by WaitTimeout, not busy_timeout(5000)")

	var busy int
	require.NoError(t, b.db.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy))
	require.Equal(t, 5000, busy, "the claim restores the connection's busy timeout")

	require.NoError(t, b.dialect.Rollback(ctx, holder))
	c, err := b.store.Claim(ctx, "orders", "k1", fp("a"))
	require.NoError(t, err)
	require.True(t, c.Acquired())
}

func TestClaimContextEndsWait(t *testing.T) {
	t.Parallel()

	for _, tc := range []struct {
		name        string
		ctx         func(context.Context) (context.Context, context.CancelFunc)
		want        error
		unavailable bool
	}{
		{
			name: "Canceled",
			ctx: func(ctx context.Context) (context.Context, context.CancelFunc) {
				ctx, cancel := context.WithCancel(ctx)
				time.AfterFunc(100*time.Millisecond, cancel)
				return ctx, cancel
			},
			want: context.Canceled,
		},
		{
			name: "DeadlineExceeded",
			ctx: func(ctx context.Context) (context.Context, context.CancelFunc) {
				return context.WithTimeout(ctx, 100*time.Millisecond)
			},
			want:        context.DeadlineExceeded,
			unavailable: true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, &idem.Config{WaitTimeout: 10 * time.Second})
			b.db.SetMaxOpenConns(2)
			holder := b.begin(ctx, t)
			_, err := holder.ExecContext(ctx, `INSERT INTO orders (ref) VALUES ('held')`)
			require.NoError(t, err)

			cctx, cancel := tc.ctx(ctx)
			defer cancel()
			start := time.Now()
			_, err = b.store.Claim(cctx, "orders", "k1", fp("a"))
			require.ErrorIs(t, err, tc.want)
			require.Equal(t, tc.unavailable, errors.Is(err, idem.ErrStoreUnavailable))
			require.Less(t, time.Since(start), 3*time.Second)

			// The pool is healthy afterwards: no connection was left inside
			// a transaction or with the claim's busy timeout.
			require.NoError(t, b.dialect.Rollback(ctx, holder))
			conns := make([]*sql.Conn, 2)
			for i := range conns {
				conns[i], err = b.db.Conn(ctx)
				require.NoError(t, err)
				t.Cleanup(func() { _ = conns[i].Close() })
				var busy int
				require.NoError(t, conns[i].QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy))
				require.Equal(t, 5000, busy)
			}
			for _, conn := range conns {
				require.NoError(t, conn.Close())
			}
			c, err := b.store.Claim(ctx, "orders", "k1", fp("a"))
			require.NoError(t, err)
			require.True(t, c.Acquired())
		})
	}
}

// Begin waits for the write lock up to the DSN's busy timeout, then reports
// the database as busy.
func TestBeginBusy(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=journal_mode(WAL)&_pragma=busy_timeout(50)&_txlock=immediate")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemsqlite.Migrate(ctx, db))
	d := idemsqlite.New(db)

	holder, err := d.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = d.Rollback(context.WithoutCancel(ctx), holder) })

	_, err = d.Begin(ctx)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	require.Equal(t, sqlite3.SQLITE_BUSY, sqliteCode(err)&0xff)
}

// A DEFERRED transaction (a DSN without _txlock=immediate) that read before
// claiming cannot wait for the write lock: SQLite fails its first write at
// once. The package documents this; Open avoids it.
func TestDeferredTransactionThatRead(t *testing.T) {
	t.Parallel()

	openDeferred := func(t *testing.T, b *testBundle) (*sql.Tx, *idem.Store[*sql.Tx]) {
		t.Helper()
		ctx := t.Context()
		var path string
		require.NoError(t, b.db.QueryRowContext(ctx, `SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&path))
		db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)")
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		d := idemsqlite.New(db)
		store, err := idem.New(d, nil)
		require.NoError(t, err)
		tx, err := db.BeginTx(ctx, nil) // DEFERRED
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback() })
		var n int
		require.NoError(t, tx.QueryRowContext(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&n))
		return tx, store
	}

	t.Run("WriterHoldsLock", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, nil)
		tx, store := openDeferred(t, b)
		holder := b.begin(ctx, t)
		_, err := b.store.ClaimTx(ctx, holder, "orders", "other", fp("a"))
		require.NoError(t, err)

		start := time.Now()
		_, err = store.ClaimTx(ctx, tx, "orders", "k1", fp("a"))
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		require.Equal(t, sqlite3.SQLITE_BUSY, sqliteCode(err)&0xff)
		require.Less(t, time.Since(start), 3*time.Second, "fails at once, not after busy_timeout(5000)")
	})

	t.Run("WriterCommitted", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, nil)
		tx, store := openDeferred(t, b)
		_, err := b.store.Claim(ctx, "orders", "other", fp("a"))
		require.NoError(t, err)

		_, err = store.ClaimTx(ctx, tx, "orders", "k1", fp("a"))
		require.ErrorIs(t, err, idem.ErrRetryable, "the snapshot is stale: run the transaction again")
		require.Equal(t, sqlite3.SQLITE_BUSY_SNAPSHOT, sqliteCode(err))
	})
}

func TestErrors(t *testing.T) {
	t.Parallel()

	t.Run("ClosedDB", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, nil)
		require.NoError(t, b.db.Close())
		_, err := b.store.Get(ctx, "orders", "k1")
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		_, err = b.store.Claim(ctx, "orders", "k1", fp("a"))
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		_, err = b.dialect.Begin(ctx)
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	})

	t.Run("CannotOpen", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "missing", "idem.db"))
		require.NoError(t, err, "Open is lazy")
		t.Cleanup(func() { _ = db.Close() })
		store, err := idem.New(idemsqlite.New(db), nil)
		require.NoError(t, err)
		_, err = store.Claim(ctx, "orders", "k1", fp("a"))
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		require.Equal(t, sqlite3.SQLITE_CANTOPEN, sqliteCode(err)&0xff)
	})

	t.Run("SQLError", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, nil)
		_, err := b.db.ExecContext(ctx, `DROP TABLE idempotency_keys`)
		require.NoError(t, err)
		_, err = b.store.Get(ctx, "orders", "k1")
		require.Error(t, err)
		require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
		require.NotErrorIs(t, err, idem.ErrNotFound)
		require.Equal(t, sqlite3.SQLITE_ERROR, sqliteCode(err))
	})

	t.Run("FinishedTx", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, nil)
		tx := b.begin(ctx, t)
		require.NoError(t, b.dialect.Rollback(ctx, tx))
		require.NoError(t, b.dialect.Rollback(ctx, tx), "rolling back twice is not an error")
		err := b.dialect.Commit(ctx, tx)
		require.ErrorIs(t, err, sql.ErrTxDone)
		require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
	})

	t.Run("NilTx", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, nil)
		_, err := b.store.GetTx(ctx, nil, "orders", "k1")
		require.Error(t, err)
		require.Error(t, b.dialect.Commit(ctx, nil))
		require.Error(t, b.dialect.Rollback(ctx, nil))
	})
}

// Times are INTEGER microseconds since the epoch, and come back in UTC.
func TestTimesStoredAsMicroseconds(t *testing.T) {
	t.Parallel()
	now := time.Date(2030, 1, 2, 3, 4, 5, 678901234, time.FixedZone("X", 3*3600))
	ctx, b := setup(t, &idem.Config{
		LeaseDuration: time.Minute,
		Retention:     time.Hour,
		Now:           func() time.Time { return now },
	})
	_, err := b.store.Claim(ctx, "orders", "k1", fp("a"))
	require.NoError(t, err)

	var created, updated, lease, expires int64
	require.NoError(t, b.db.QueryRowContext(ctx,
		`SELECT created_at, updated_at, lease_expires_at, expires_at FROM idempotency_keys`).
		Scan(&created, &updated, &lease, &expires))
	require.Equal(t, now.UnixMicro(), created)
	require.Equal(t, now.UnixMicro(), updated)
	require.Equal(t, now.Add(time.Minute).UnixMicro(), lease)
	require.Equal(t, now.Add(time.Hour).UnixMicro(), expires)

	rec, err := b.store.Get(ctx, "orders", "k1")
	require.NoError(t, err)
	require.Equal(t, time.UTC, rec.CreatedAt.Location())
	require.Equal(t, now.Truncate(time.Microsecond).UTC(), rec.CreatedAt)
	require.Equal(t, time.UTC, rec.ExpiresAt.Location())
}

// A nil body is stored as an empty BLOB and replayed as an empty, non-nil
// body; a response without headers stores no header bytes.
func TestEmptyResponse(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, nil)
	c, err := b.store.Claim(ctx, "orders", "k1", fp("a"))
	require.NoError(t, err)
	require.NoError(t, b.store.Complete(ctx, c, &idem.Response{StatusCode: 204}))

	var bodyType, headerType string
	require.NoError(t, b.db.QueryRowContext(ctx,
		`SELECT typeof(response_body), typeof(response_headers) FROM idempotency_keys`).Scan(&bodyType, &headerType))
	require.Equal(t, "blob", bodyType)
	require.Equal(t, "null", headerType)

	replay, err := b.store.Claim(ctx, "orders", "k1", fp("a"))
	require.NoError(t, err)
	require.False(t, replay.Acquired())
	require.Equal(t, 204, replay.Replay.Response.StatusCode)
	require.NotNil(t, replay.Replay.Response.Body)
	require.Empty(t, replay.Replay.Response.Body)
	require.Nil(t, replay.Replay.Response.Header)
}
