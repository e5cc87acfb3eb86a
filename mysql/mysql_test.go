package mysql_test

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/migrations"
	idemmysql "github.com/idemstore/idem/mysql"
)

// claimPaths are the two ways Claim bounds its lock wait: the one New picks
// for the server (SET STATEMENT on MariaDB) and the session variable set and
// restored around the claim, written for MySQL 8 and accepted by MariaDB.
var claimPaths = []struct {
	name string
	new  func(*sql.DB) *idemmysql.Dialect
}{
	{"Detected", idemmysql.New},
	{"SessionVariable", idemmysql.NewSessionVariablePath},
}

// bundle is a fresh namespace and a dialect over its pool.
type bundle struct {
	*namespace
	d *idemmysql.Dialect
}

func setup(t *testing.T, newDialect func(*sql.DB) *idemmysql.Dialect, interpolate bool) (context.Context, *bundle) {
	t.Helper()
	ctx := t.Context()
	ns := testServer(t).open(ctx, t, interpolate)
	return ctx, &bundle{namespace: ns, d: newDialect(ns.db)}
}

func (b *bundle) store(t *testing.T, cfg *idem.Config) *idem.Store[*sql.Tx] {
	t.Helper()
	s, err := idem.New(b.d, cfg)
	require.NoError(t, err)
	return s
}

// begin starts a transaction rolled back when t ends, if still open.
func (b *bundle) begin(ctx context.Context, t *testing.T) *sql.Tx {
	t.Helper()
	tx, err := b.d.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.d.Rollback(context.WithoutCancel(ctx), tx) })
	return tx
}

var lastToken atomic.Int64

// claimParams are executor-level claim arguments with a fresh token.
func claimParams(key string) *idem.ClaimParams {
	return &idem.ClaimParams{
		Scope:         "t1/create",
		Key:           key,
		Fingerprint:   idem.NewFingerprint([]byte(key)),
		Token:         lastToken.Add(1),
		LeaseDuration: time.Minute,
		Retention:     time.Hour,
		WaitTimeout:   10 * time.Second,
	}
}

func TestMigrate(t *testing.T) {
	t.Parallel()
	srv := testServer(t)

	t.Run("RerunIsNoop", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		ns := srv.open(ctx, t, true) // migrated once
		require.NoError(t, idemmysql.Migrate(ctx, ns.db))
		require.NoError(t, idemmysql.Migrate(ctx, ns.db))
		requireFullyMigrated(ctx, t, ns.db)
	})

	t.Run("ConcurrentCallersTakeTurns", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		name := srv.createDatabase(ctx, t)
		// One pool per caller, like separate processes starting at once.
		const callers = 6
		pools := make([]*sql.DB, callers)
		for i := range pools {
			pools[i] = srv.connect(t, name, true)
			pools[i].SetMaxOpenConns(2)
		}
		errs := make([]error, callers)
		var wg sync.WaitGroup
		for i, db := range pools {
			wg.Go(func() { errs[i] = idemmysql.Migrate(ctx, db) })
		}
		wg.Wait()
		for i, err := range errs {
			require.NoError(t, err, "caller %d", i)
		}
		requireFullyMigrated(ctx, t, pools[0])
	})

	t.Run("DownRemovesTable", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		ns := srv.open(ctx, t, true)
		require.True(t, tableExists(ctx, t, ns.db, "idempotency_keys"))
		p, err := migrations.NewProvider(migrations.MySQL, ns.db)
		require.NoError(t, err)
		_, err = p.DownTo(ctx, 0)
		require.NoError(t, err)
		require.False(t, tableExists(ctx, t, ns.db, "idempotency_keys"))
		require.NoError(t, idemmysql.Migrate(ctx, ns.db))
		require.True(t, tableExists(ctx, t, ns.db, "idempotency_keys"))
	})
}

func requireFullyMigrated(ctx context.Context, t *testing.T, db *sql.DB) {
	t.Helper()
	p, err := migrations.NewProvider(migrations.MySQL, db)
	require.NoError(t, err)
	var applied int
	require.NoError(t, db.QueryRowContext(ctx,
		"SELECT COUNT(*) FROM "+migrations.VersionTable+" WHERE version_id > 0 AND is_applied").Scan(&applied))
	require.Equal(t, len(p.ListSources()), applied, "each migration recorded exactly once")
	require.True(t, tableExists(ctx, t, db, "idempotency_keys"))
}

func tableExists(ctx context.Context, t *testing.T, db *sql.DB, table string) bool {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRowContext(ctx,
		"SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?", table).Scan(&n))
	return n == 1
}

// TestClaimWaitRoundsUpToWholeSeconds: innodb_lock_wait_timeout counts whole
// seconds, so a 1.5s WaitTimeout waits 2s.
func TestClaimWaitRoundsUpToWholeSeconds(t *testing.T) {
	t.Parallel()
	for _, path := range claimPaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, path.new, true)
			const wait = 1500 * time.Millisecond
			store := b.store(t, &idem.Config{WaitTimeout: wait})
			holder := b.begin(ctx, t)
			_, err := store.ClaimTx(ctx, holder, "t1/create", "k", idem.NewFingerprint())
			require.NoError(t, err)

			waiter := b.begin(ctx, t)
			start := time.Now()
			_, err = store.ClaimTx(ctx, waiter, "t1/create", "k", idem.NewFingerprint())
			elapsed := time.Since(start)
			var ip *idem.InProgressError
			require.ErrorAs(t, err, &ip)
			require.Equal(t, wait, ip.RetryAfter)
			require.False(t, ip.TxAborted, "InnoDB rolls back only the statement")
			require.GreaterOrEqual(t, elapsed, 2*time.Second-50*time.Millisecond)
			require.Less(t, elapsed, 4*time.Second)
			// The waiter's transaction is alive.
			require.NoError(t, b.insertOrder(ctx, waiter, "after-timeout"))
			require.NoError(t, b.d.Commit(ctx, waiter))
			n, err := b.countOrders(ctx, "after-timeout")
			require.NoError(t, err)
			require.Equal(t, 1, n)
		})
	}
}

// TestWaiterWithOldSnapshotSeesHolderCommit: a caller's REPEATABLE READ
// transaction that has read before claiming still sees the record committed
// by the holder it waited for, because the claim's read locks.
func TestWaiterWithOldSnapshotSeesHolderCommit(t *testing.T) {
	t.Parallel()
	for _, path := range claimPaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, path.new, true)
			store := b.store(t, &idem.Config{WaitTimeout: 10 * time.Second})
			holder := b.begin(ctx, t)
			c, err := store.ClaimTx(ctx, holder, "t1/create", "k", idem.NewFingerprint())
			require.NoError(t, err)
			require.NoError(t, store.CompleteTx(ctx, holder, c, &idem.Response{StatusCode: http.StatusCreated, Body: []byte("done")}))

			waiter := b.begin(ctx, t)
			var n int // this read fixes the waiter's snapshot: no record yet
			require.NoError(t, waiter.QueryRowContext(ctx, "SELECT COUNT(*) FROM idempotency_keys").Scan(&n))
			require.Zero(t, n)

			type result struct {
				c   *idem.Claim
				err error
			}
			done := make(chan result, 1)
			go func() {
				c, err := store.ClaimTx(ctx, waiter, "t1/create", "k", idem.NewFingerprint())
				done <- result{c, err}
			}()
			time.Sleep(300 * time.Millisecond)
			require.NoError(t, b.d.Commit(ctx, holder))
			r := <-done
			require.NoError(t, r.err)
			require.False(t, r.c.Acquired())
			require.Equal(t, http.StatusCreated, r.c.Replay.Response.StatusCode)
			require.Equal(t, []byte("done"), r.c.Replay.Response.Body)
		})
	}
}

// TestClaimLeavesSessionLockWaitAlone checks that the claim's bound on the
// lock wait does not leak into the caller's session or the pool.
func TestClaimLeavesSessionLockWaitAlone(t *testing.T) {
	t.Parallel()
	for _, path := range claimPaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, path.new, true)
			store := b.store(t, &idem.Config{WaitTimeout: time.Second})

			tx := b.begin(ctx, t)
			_, err := tx.ExecContext(ctx, "SET SESSION innodb_lock_wait_timeout = 7")
			require.NoError(t, err)
			_, err = store.ClaimTx(ctx, tx, "t1/create", "a", idem.NewFingerprint())
			require.NoError(t, err)
			require.Equal(t, 7, lockWait(ctx, t, tx))

			// Also after a claim that timed out.
			holder := b.begin(ctx, t)
			_, err = store.ClaimTx(ctx, holder, "t1/create", "b", idem.NewFingerprint())
			require.NoError(t, err)
			_, err = store.ClaimTx(ctx, tx, "t1/create", "b", idem.NewFingerprint())
			require.ErrorIs(t, err, idem.ErrInProgress)
			require.Equal(t, 7, lockWait(ctx, t, tx))
			require.NoError(t, b.d.Rollback(ctx, holder))
			require.NoError(t, b.d.Rollback(ctx, tx))

			// On the pool: a pool of one connection, so the claim and the
			// checks share it; a fresh one, so no session value set above
			// is on it.
			pool := testServer(t).connect(t, b.name, true)
			pool.SetMaxOpenConns(1)
			poolStore, err := idem.New(path.new(pool), &idem.Config{WaitTimeout: time.Second})
			require.NoError(t, err)
			before := lockWait(ctx, t, pool)
			_, err = poolStore.Claim(ctx, "t1/create", "c", idem.NewFingerprint())
			require.NoError(t, err)
			require.Equal(t, before, lockWait(ctx, t, pool))
		})
	}
}

func lockWait(ctx context.Context, t *testing.T, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}) int {
	t.Helper()
	var n int
	require.NoError(t, q.QueryRowContext(ctx, "SELECT @@SESSION.innodb_lock_wait_timeout").Scan(&n))
	return n
}

// TestStatementsInBothExecModes runs every statement as a server-side
// prepared statement (interpolateParams=false) and interpolated, on both
// claim paths, with a pinned clock finer than the columns.
func TestStatementsInBothExecModes(t *testing.T) {
	t.Parallel()
	for _, path := range claimPaths {
		for _, interpolate := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/interpolateParams=%v", path.name, interpolate), func(t *testing.T) {
				t.Parallel()
				ctx, b := setup(t, path.new, interpolate)
				// Nanoseconds and a non-UTC zone: stored at µs, in UTC.
				now := time.Date(2031, 5, 6, 7, 8, 9, 123456789, time.FixedZone("X", 5*3600))
				clock := now
				store := b.store(t, &idem.Config{
					LeaseDuration: time.Minute,
					Retention:     time.Hour,
					Now:           func() time.Time { return clock },
				})
				want := now.UTC().Truncate(time.Microsecond)

				c, err := store.Claim(ctx, "t1/create", "k", idem.NewFingerprint([]byte("a")))
				require.NoError(t, err)
				require.True(t, c.Acquired())
				rec, err := store.Get(ctx, "t1/create", "k")
				require.NoError(t, err)
				require.Equal(t, want, rec.CreatedAt)
				require.Equal(t, want.Add(time.Minute), rec.LeaseExpiresAt)
				require.Equal(t, want.Add(time.Hour), rec.ExpiresAt)
				require.Equal(t, time.UTC, rec.CreatedAt.Location())

				// Empty body: replayed as empty, not nil; no header: nil.
				require.NoError(t, store.Complete(ctx, c, &idem.Response{StatusCode: http.StatusNoContent}))
				replay, err := store.Claim(ctx, "t1/create", "k", idem.NewFingerprint([]byte("a")))
				require.NoError(t, err)
				require.False(t, replay.Acquired())
				require.Equal(t, http.StatusNoContent, replay.Replay.Response.StatusCode)
				require.NotNil(t, replay.Replay.Response.Body)
				require.Empty(t, replay.Replay.Response.Body)
				require.Nil(t, replay.Replay.Response.Header)

				// Past retention the key is taken over.
				clock = now.Add(2 * time.Hour)
				_, err = store.Get(ctx, "t1/create", "k")
				require.ErrorIs(t, err, idem.ErrNotFound)
				again, err := store.Claim(ctx, "t1/create", "k", idem.NewFingerprint([]byte("b")))
				require.NoError(t, err)
				require.True(t, again.Acquired())
				require.Greater(t, again.Token, c.Token)

				// Release frees it; a stale token is fenced.
				require.ErrorIs(t, store.Release(ctx, c), idem.ErrFenced)
				require.NoError(t, store.Release(ctx, again))
				_, err = store.Get(ctx, "t1/create", "k")
				require.ErrorIs(t, err, idem.ErrNotFound)
			})
		}
	}
}

// TestDatabaseClockIsUTC: with no pinned clock, times come from
// UTC_TIMESTAMP(6), whatever the session's time_zone.
func TestDatabaseClockIsUTC(t *testing.T) {
	t.Parallel()
	srv := testServer(t)
	ctx := t.Context()
	ns := srv.open(ctx, t, true)
	cfg := srv.cfg.Clone()
	cfg.DBName = ns.name
	cfg.ParseTime = true
	cfg.InterpolateParams = true
	cfg.Params = map[string]string{"time_zone": "'+05:00'"}
	db := openDB(t, cfg)
	var offset int
	require.NoError(t, db.QueryRowContext(ctx, "SELECT TIMESTAMPDIFF(HOUR, UTC_TIMESTAMP(), NOW())").Scan(&offset))
	require.Equal(t, 5, offset, "the session must really be in another zone")

	store, err := idem.New(idemmysql.New(db), &idem.Config{LeaseDuration: time.Minute})
	require.NoError(t, err)
	_, err = store.Claim(ctx, "t1/create", "k", idem.NewFingerprint())
	require.NoError(t, err)
	rec, err := store.Get(ctx, "t1/create", "k")
	require.NoError(t, err)
	// Client and server clocks may differ a little, not by hours.
	require.WithinDuration(t, time.Now().UTC(), rec.CreatedAt, time.Minute)
	require.Equal(t, rec.CreatedAt.Add(time.Minute), rec.LeaseExpiresAt)
}

// TestKeysAreByteExact: keys and scopes are VARBINARY, so no collation folds
// case, accents or trailing spaces, even with a case- and
// accent-insensitive database default.
func TestKeysAreByteExact(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, idemmysql.New, true)
	_, err := b.db.ExecContext(ctx, "ALTER DATABASE "+b.name+" COLLATE utf8mb4_general_ci")
	require.NoError(t, err)
	store := b.store(t, nil)
	keys := []string{"Key", "key", "KEY", "key ", "caf\u00e9", "cafe\u0301", "cafe"}
	for _, scope := range []string{"Scope", "scope"} {
		for _, key := range keys {
			c, err := store.Claim(ctx, scope, key, idem.NewFingerprint())
			require.NoError(t, err)
			require.True(t, c.Acquired(), "%q/%q collided with another key", scope, key)
		}
	}
	for _, scope := range []string{"Scope", "scope"} {
		for _, key := range keys {
			rec, err := store.Get(ctx, scope, key)
			require.NoError(t, err)
			require.Equal(t, scope, rec.Scope)
			require.Equal(t, key, rec.Key)
		}
	}
	n, err := b.countRecords(ctx)
	require.NoError(t, err)
	require.Equal(t, 2*len(keys), n)
}

// TestErrorClassification provokes real server and connection errors.
func TestErrorClassification(t *testing.T) {
	t.Parallel()

	t.Run("DeadlockIsRetryable", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, idemmysql.New, true)
		tx1, tx2 := b.begin(ctx, t), b.begin(ctx, t)
		e1, e2 := b.d.Tx(tx1), b.d.Tx(tx2)
		_, err := e1.Claim(ctx, claimParams("a"))
		require.NoError(t, err)
		_, err = e2.Claim(ctx, claimParams("b"))
		require.NoError(t, err)

		errc := make(chan error, 1)
		go func() {
			_, err := e1.Claim(ctx, claimParams("b"))
			errc <- err
		}()
		time.Sleep(300 * time.Millisecond) // let tx1 start waiting for b
		_, err2 := e2.Claim(ctx, claimParams("a"))
		err1 := <-errc

		// InnoDB rolls one transaction back; the other proceeds.
		victim, survivor := err1, err2
		if err2 != nil {
			victim, survivor = err2, err1
		}
		require.NoError(t, survivor)
		require.ErrorIs(t, victim, idem.ErrRetryable)
		require.NotErrorIs(t, victim, idem.ErrStoreUnavailable)
		var myErr *gomysql.MySQLError
		require.ErrorAs(t, victim, &myErr)
		require.EqualValues(t, 1213, myErr.Number)
	})

	t.Run("LockWaitTimeoutOutsideClaimIsRetryable", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, idemmysql.New, true)
		holder := b.begin(ctx, t)
		p := claimParams("k")
		_, err := b.d.Tx(holder).Claim(ctx, p)
		require.NoError(t, err)

		tx := b.begin(ctx, t)
		_, err = tx.ExecContext(ctx, "SET SESSION innodb_lock_wait_timeout = 1")
		require.NoError(t, err)
		err = b.d.Tx(tx).Complete(ctx, &idem.CompleteParams{
			Scope: p.Scope, Key: p.Key, Token: p.Token,
			Status: idem.StatusSucceeded, Response: &idem.Response{StatusCode: 200}, Retention: time.Hour,
		})
		require.ErrorIs(t, err, idem.ErrRetryable)
		require.NotErrorIs(t, err, idem.ErrInProgress)
		var myErr *gomysql.MySQLError
		require.ErrorAs(t, err, &myErr)
		require.EqualValues(t, 1205, myErr.Number)
	})

	t.Run("KilledConnectionIsUnavailable", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, idemmysql.New, true)
		tx := b.begin(ctx, t)
		var id int64
		require.NoError(t, tx.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&id))
		_, err := b.admin.ExecContext(ctx, fmt.Sprintf("KILL %d", id))
		require.NoError(t, err)
		_, err = b.d.Tx(tx).Get(ctx, &idem.GetParams{Scope: "t1/create", Key: "k"})
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		require.ErrorIs(t, b.d.Commit(ctx, tx), idem.ErrStoreUnavailable)
	})

	t.Run("ClosedPoolIsUnavailable", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, idemmysql.New, true)
		require.NoError(t, b.db.Close())
		_, err := b.d.Begin(ctx)
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		_, err = b.d.DB().Claim(ctx, claimParams("k"))
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		_, err = b.d.DB().Get(ctx, &idem.GetParams{Scope: "t1/create", Key: "k"})
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		err = b.d.DB().Release(ctx, &idem.ReleaseParams{Scope: "t1/create", Key: "k", Token: 1})
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	})

	t.Run("CanceledIsNotUnavailable", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, idemmysql.New, true)
		canceled, cancel := context.WithCancel(ctx)
		cancel()
		_, err := b.d.DB().Claim(canceled, claimParams("k"))
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
	})

	t.Run("RollbackAfterEndIsNoError", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, idemmysql.New, true)
		tx := b.begin(ctx, t)
		require.NoError(t, b.d.Commit(ctx, tx))
		require.NoError(t, b.d.Rollback(ctx, tx))
	})
}

// TestDSNWithoutParseTimeOrUTC: idem refuses, before writing anything, a
// pool whose DATETIME values arrive as text or in another zone, and does
// not blame the server for it.
func TestDSNWithoutParseTimeOrUTC(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		edit func(*gomysql.Config)
	}{
		{"NoParseTime", func(c *gomysql.Config) { c.ParseTime = false }},
		{"LocNotUTC", func(c *gomysql.Config) { c.Loc = time.FixedZone("X", 3600) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := testServer(t)
			ctx := t.Context()
			ns := srv.open(ctx, t, true)
			cfg := srv.cfg.Clone()
			cfg.DBName = ns.name
			cfg.ParseTime = true
			tc.edit(cfg)
			store, err := idem.New(idemmysql.New(openDB(t, cfg)), nil)
			require.NoError(t, err)
			for _, claim := range []func() error{
				func() error { _, err := store.Claim(ctx, "t1/create", "k", idem.NewFingerprint()); return err },
				func() error {
					_, err := store.Do(ctx, "t1/create", "k", idem.NewFingerprint(), func(context.Context, *sql.Tx) (*idem.Response, error) {
						return &idem.Response{StatusCode: 200}, nil
					})
					return err
				},
			} {
				err := claim()
				require.Error(t, err)
				require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
				require.NotErrorIs(t, err, idem.ErrRetryable)
			}
			n, err := ns.countRecords(ctx)
			require.NoError(t, err)
			require.Zero(t, n, "nothing may be written through a misconfigured pool")
		})
	}
}
