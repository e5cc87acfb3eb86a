package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	msqlite "modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/idemstore/idem"
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
// once. The package documents this; Open avoids it. The claim is deferred
// and only reads, so it acquires; the first write, the completion here (or
// the caller's own first write), fails, and nothing can commit on a stale
// snapshot.
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

		c, err := store.ClaimTx(ctx, tx, "orders", "k1", fp("a"))
		require.NoError(t, err)
		require.True(t, c.Acquired())
		start := time.Now()
		err = store.CompleteTx(ctx, tx, c, &idem.Response{StatusCode: 200})
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

		c, err := store.ClaimTx(ctx, tx, "orders", "k1", fp("a"))
		require.NoError(t, err)
		require.True(t, c.Acquired())
		err = store.CompleteTx(ctx, tx, c, &idem.Response{StatusCode: 200})
		require.ErrorIs(t, err, idem.ErrRetryable, "the snapshot is stale: run the transaction again")
		require.Equal(t, sqlite3.SQLITE_BUSY_SNAPSHOT, sqliteCode(err))
	})
}

func TestErrors(t *testing.T) {
	t.Parallel()

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

// seedClaim inserts a processing record for (scope, key) through ex, claimed
// at claimedAt: its lease runs out at claimedAt+lease and its retention at
// claimedAt+retention.
func seedClaim(ctx context.Context, t *testing.T, ex idem.Executor, scope, key string, token int64, claimedAt time.Time, lease, retention time.Duration) {
	t.Helper()
	res, err := ex.Claim(ctx, &idem.ClaimParams{
		Scope: scope, Key: key, Fingerprint: fp(key), Token: token,
		LeaseDuration: lease, Retention: retention, WaitTimeout: time.Second, Now: &claimedAt,
	})
	require.NoError(t, err)
	require.True(t, res.Created)
}

// seedCompleted inserts a record completed with status at completedAt,
// whose lease ran out long before and whose retention runs out at
// completedAt+retention.
func seedCompleted(ctx context.Context, t *testing.T, ex idem.Executor, scope, key string, status idem.Status, completedAt time.Time, retention time.Duration) {
	t.Helper()
	seedClaim(ctx, t, ex, scope, key, 1, completedAt.Add(-time.Minute), time.Second, retention)
	require.NoError(t, ex.Complete(ctx, &idem.CompleteParams{
		Scope: scope, Key: key, Token: 1, Status: status,
		Response: &idem.Response{StatusCode: 200}, Retention: retention, Now: &completedAt,
	}))
}

// recordKeys returns the keys of every stored record, expired or not, sorted.
func recordKeys(ctx context.Context, t *testing.T, db *sql.DB) []string {
	t.Helper()
	rows, err := db.QueryContext(ctx, `SELECT idempotency_key FROM idempotency_keys ORDER BY idempotency_key`)
	require.NoError(t, err)
	defer func() { _ = rows.Close() }()
	keys := []string{}
	for rows.Next() {
		var k string
		require.NoError(t, rows.Scan(&k))
		keys = append(keys, k)
	}
	require.NoError(t, rows.Err())
	return keys
}

// On the pool, RenewLease and Takeover wait for the write lock up to their
// WaitTimeout, not the DSN's 5s busy timeout, and restore the connection's
// busy timeout afterwards.
func TestLeaseWritesWaitBoundedByWaitTimeout(t *testing.T) {
	t.Parallel()
	const wait = 150 * time.Millisecond
	ctx, b := setup(t, nil)
	b.db.SetMaxOpenConns(2)
	ex := b.dialect.DB()
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	seedClaim(ctx, t, ex, "orders", "k1", 1, now.Add(-2*time.Hour), time.Minute, time.Hour)

	holder := b.begin(ctx, t)
	_, err := holder.ExecContext(ctx, `INSERT INTO orders (ref) VALUES ('held')`)
	require.NoError(t, err)

	for name, call := range map[string]func() error{
		"RenewLease": func() error {
			_, err := ex.RenewLease(ctx, &idem.RenewLeaseParams{
				Scope: "orders", Key: "k1", Token: 1, NewToken: 2, Duration: time.Minute, WaitTimeout: wait, Now: &now,
			})
			return err
		},
		"Takeover": func() error {
			return ex.Takeover(ctx, &idem.TakeoverParams{
				Scope: "orders", Key: "k1", Token: 1, NewToken: 2, Fingerprint: fp("b"), Attempt: 2,
				LeaseDuration: time.Minute, Retention: time.Hour, Condition: idem.TakeoverRetentionExpired,
				WaitTimeout: wait, Now: &now,
			})
		},
	} {
		start := time.Now()
		err := call()
		elapsed := time.Since(start)
		require.ErrorIs(t, err, idem.ErrStoreUnavailable, name)
		require.Equal(t, sqlite3.SQLITE_BUSY, sqliteCode(err)&0xff, name)
		require.GreaterOrEqual(t, elapsed, wait-10*time.Millisecond, name)
		require.Less(t, elapsed, 3*time.Second, "%s: bounded by WaitTimeout, not busy_timeout(5000)", name)
	}
	require.NoError(t, b.dialect.Rollback(ctx, holder))

	var busy int
	require.NoError(t, b.db.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy))
	require.Equal(t, 5000, busy, "the connection's busy timeout is restored")
	_, err = ex.RenewLease(ctx, &idem.RenewLeaseParams{
		Scope: "orders", Key: "k1", Token: 1, NewToken: 2, Duration: time.Minute, WaitTimeout: wait, Now: &now,
	})
	require.NoError(t, err)
}

// TestDeleteExpiredWriteLock: the reaper's delete and SQLite's single write
// lock, which has no queue. (What it deletes is a conformance case.)
func TestDeleteExpiredWriteLock(t *testing.T) {
	t.Parallel()
	now := time.Date(2030, 1, 2, 3, 4, 5, 678901000, time.UTC)

	// seed stores five expired records (the last expiring exactly at now)
	// and two live ones, inserted out of expiry order.
	seed := func(ctx context.Context, t *testing.T, ex idem.Executor) {
		t.Helper()
		seedClaim(ctx, t, ex, "orders", "e2", 2, now.Add(-5*time.Hour), time.Minute, time.Hour)                   // expired 4h ago
		seedClaim(ctx, t, ex, "orders", "e1", 1, now.Add(-6*time.Hour), time.Minute, time.Hour)                   // expired 5h ago
		seedClaim(ctx, t, ex, "orders", "e3", 3, now.Add(-4*time.Hour), time.Minute, time.Hour)                   // processing, expired 3h ago
		seedCompleted(ctx, t, ex, "t2", "e4", idem.StatusSucceeded, now.Add(-3*time.Hour), time.Hour)             // expired 2h ago
		seedClaim(ctx, t, ex, "orders", "e5", 5, now.Add(-time.Hour), time.Minute, time.Hour)                     // expires at now
		seedClaim(ctx, t, ex, "orders", "live1", 6, now.Add(-time.Hour+time.Microsecond), time.Minute, time.Hour) // 1µs left
		seedCompleted(ctx, t, ex, "orders", "live2", idem.StatusSucceeded, now, time.Hour)
	}
	// SQLite has no row locks: while another transaction holds the write
	// lock, the pool's delete queues for it (up to the DSN's busy timeout)
	// instead of failing at once, then runs.
	t.Run("QueuesForWriteLock", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, nil)
		ex := b.dialect.DB()
		seed(ctx, t, ex)

		holder := b.begin(ctx, t)
		seedClaim(ctx, t, b.dialect.Tx(holder), "orders", "held", 9, now, time.Minute, time.Hour)
		done := make(chan int, 1)
		go func() {
			pinned := now
			n, err := ex.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: 10, Now: &pinned})
			if err != nil {
				n = -1
			}
			done <- n
		}()
		select {
		case n := <-done:
			require.Failf(t, "delete did not wait for the write lock", "returned %d", n)
		case <-time.After(200 * time.Millisecond):
		}
		require.NoError(t, b.dialect.Commit(ctx, holder))
		select {
		case n := <-done:
			require.Equal(t, 5, n)
		case <-time.After(3 * time.Second):
			require.Fail(t, "delete still waiting after the holder committed")
		}
		require.Equal(t, []string{"held", "live1", "live2"}, recordKeys(ctx, t, b.db))
	})

	// Past the DSN's busy timeout the delete reports the database as busy,
	// and leaves its connection with the DSN's busy timeout.
	t.Run("BusyPastTimeout", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		db, err := sql.Open("sqlite", "file:"+filepath.Join(t.TempDir(), "idem.db")+
			"?_pragma=journal_mode(WAL)&_pragma=busy_timeout(200)&_txlock=immediate")
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		require.NoError(t, idemsqlite.Migrate(ctx, db))
		db.SetMaxOpenConns(2)
		d := idemsqlite.New(db)
		seed(ctx, t, d.DB())

		holder, err := d.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = d.Rollback(context.WithoutCancel(ctx), holder) })
		start := time.Now()
		_, err = d.DB().DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: 10, Now: &now})
		elapsed := time.Since(start)
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		require.Equal(t, sqlite3.SQLITE_BUSY, sqliteCode(err)&0xff)
		require.GreaterOrEqual(t, elapsed, 190*time.Millisecond)
		require.Less(t, elapsed, 3*time.Second)
		require.NoError(t, d.Rollback(ctx, holder))

		for range 2 {
			conn, err := db.Conn(ctx)
			require.NoError(t, err)
			defer func() { _ = conn.Close() }()
			var busy int
			require.NoError(t, conn.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy))
			require.Equal(t, 200, busy)
		}
	})

	// SQLite's lock has no queue and its busy handler sleeps up to 100ms
	// between tries: the delete polls more often, so that writers committing
	// back to back do not starve it.
	t.Run("NotStarvedByBackToBackWriters", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, nil)
		ex := b.dialect.DB()
		seed(ctx, t, ex)

		stop := make(chan struct{})
		var wg sync.WaitGroup
		var writes int
		wg.Go(func() {
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
				select {
				case <-stop:
					return
				default:
				}
				tx, err := b.db.BeginTx(ctx, nil)
				if err != nil {
					return
				}
				_, _ = tx.ExecContext(ctx, `INSERT INTO orders (ref) VALUES ('busy')`)
				if tx.Commit() == nil {
					writes++
				}
			}
		})
		time.Sleep(50 * time.Millisecond) // let the writer loop start
		start := time.Now()
		n, err := ex.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: 10, Now: &now})
		elapsed := time.Since(start)
		close(stop)
		wg.Wait()
		require.NoError(t, err)
		require.Equal(t, 5, n)
		require.Less(t, elapsed, 2*time.Second)
		require.Positive(t, writes)
		t.Logf("deleted after %v, %d writes meanwhile", elapsed, writes)
	})
}

// The reaper's statements walk their indexes, with no table scan and no
// sort, before and after ANALYZE has given the planner statistics.
func TestReaperQueryPlans(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, nil)
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

	// 300 records, most of them expired and a tenth processing, in one
	// transaction.
	tx := b.begin(ctx, t)
	ex := b.dialect.Tx(tx)
	for i := range 300 {
		key := "k" + strconv.Itoa(i)
		claimedAt := now.Add(-time.Duration(i) * time.Minute)
		if i%10 == 0 {
			seedClaim(ctx, t, ex, "orders", key, int64(i), claimedAt, time.Minute, time.Hour)
			continue
		}
		seedCompleted(ctx, t, ex, "orders", key, idem.StatusSucceeded, claimedAt, time.Hour)
	}
	require.NoError(t, b.dialect.Commit(ctx, tx))

	plan := func(query string, args ...any) []string {
		t.Helper()
		rows, err := b.db.QueryContext(ctx, `EXPLAIN QUERY PLAN `+query, args...)
		require.NoError(t, err)
		defer func() { _ = rows.Close() }()
		var details []string
		for rows.Next() {
			var id, parent, unused int
			var detail string
			require.NoError(t, rows.Scan(&id, &parent, &unused, &detail))
			details = append(details, detail)
		}
		require.NoError(t, rows.Err())
		return details
	}
	check := func(details []string, want ...string) {
		t.Helper()
		for _, w := range want {
			require.Contains(t, details, w)
		}
		for _, d := range details {
			require.NotContains(t, d, "SCAN", "a table scan: %v", details)
			require.NotContains(t, d, "TEMP B-TREE", "a sort: %v", details)
		}
	}
	nowUs := now.UnixMicro()
	for _, analyzed := range []bool{false, true} {
		if analyzed {
			_, err := b.db.ExecContext(ctx, `ANALYZE`)
			require.NoError(t, err)
		}
		check(plan(idemsqlite.StaleLeasesSelect, nowUs, nowUs, 100),
			"SEARCH idempotency_keys USING INDEX idempotency_keys_stale_lease_idx (lease_expires_at<?)")
		check(plan(idemsqlite.ExpiredDelete, nowUs, 100),
			"SEARCH idempotency_keys USING INTEGER PRIMARY KEY (rowid=?)",
			"SEARCH idempotency_keys USING COVERING INDEX idempotency_keys_expires_at_idx (expires_at<?)")
	}
}

// A transaction of another *sql.DB on the same file works with ClaimTx and
// CompleteTx, as it did before the Dialect prepared its statements: they
// are prepared on the Dialect's DB, which such a transaction cannot use, so
// the executor runs them as text there.
func TestTxOfAnotherDB(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	path := filepath.Join(t.TempDir(), "idem.db")
	idemDB, err := idemsqlite.Open(path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = idemDB.Close() })
	require.NoError(t, idemsqlite.Migrate(ctx, idemDB))
	appDB, err := idemsqlite.Open(path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = appDB.Close() })

	d := idemsqlite.New(idemDB)
	store, err := idem.New(d, nil)
	require.NoError(t, err)
	// The Dialect's own Begin prepares its statements.
	own, err := d.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, d.Rollback(ctx, own))

	fp := idem.NewFingerprint([]byte("x"))
	for _, key := range []string{"k1", "k2"} {
		tx, err := appDB.BeginTx(ctx, nil)
		require.NoError(t, err)
		c, err := store.ClaimTx(ctx, tx, "s", key, fp)
		require.NoError(t, err)
		require.True(t, c.Acquired())
		require.NoError(t, store.CompleteTx(ctx, tx, c, &idem.Response{StatusCode: 201, Body: []byte(key)}))
		require.NoError(t, tx.Commit())

		rec, err := store.Get(ctx, "s", key)
		require.NoError(t, err)
		require.Equal(t, idem.StatusSucceeded, rec.Status)
		require.Equal(t, key, string(rec.Response.Body))
	}
}

// TestCallerTxPreparesStatements: a transaction the caller began with
// db.BeginTx (README's path), not Dialect.Begin, gets the prepared claim and
// completion statements too: the first one runs them unprepared and has them
// prepared in the background, without a deadlock on a one-connection pool
// whose only connection it holds.
func TestCallerTxPreparesStatements(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(1)
	require.NoError(t, idemsqlite.Migrate(ctx, db))
	d := idemsqlite.New(db)
	store, err := idem.New(d, nil)
	require.NoError(t, err)
	require.False(t, idemsqlite.Prepared(d), "New prepares nothing")

	fp := idem.NewFingerprint([]byte("x"))
	for _, key := range []string{"k1", "k2"} {
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		c, err := store.ClaimTx(ctx, tx, "s", key, fp)
		require.NoError(t, err)
		require.True(t, c.Acquired())
		require.NoError(t, store.CompleteTx(ctx, tx, c, &idem.Response{StatusCode: 201, Body: []byte(key)}))
		require.NoError(t, tx.Commit())
		rec, err := store.Get(ctx, "s", key)
		require.NoError(t, err)
		require.Equal(t, key, string(rec.Response.Body))
	}
	require.Eventually(t, func() bool { return idemsqlite.Prepared(d) }, 5*time.Second, 10*time.Millisecond,
		"the statements are prepared once the pool's connection is free")
}

// TestNegativeLimitRefused: SQLite reads LIMIT -1 as no limit at all; the
// dialect refuses a negative limit rather than reap or list everything.
func TestNegativeLimitRefused(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, nil)
	ex := b.dialect.DB()
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	seedClaim(ctx, t, ex, "orders", "expired", 1, now.Add(-2*time.Hour), time.Minute, time.Hour)
	_, err := ex.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: -1, Now: &now})
	require.Error(t, err)
	_, _, err = ex.ListStaleLeases(ctx, &idem.ListStaleLeasesParams{Limit: -1, Now: &now})
	require.Error(t, err)
	require.Equal(t, []string{"expired"}, recordKeys(ctx, t, b.db))
}
