package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"strings"
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
	{"Detected", newPlain},
	{"SessionVariable", func(db *sql.DB) *idemmysql.Dialect { return idemmysql.NewSessionVariablePath(db) }},
}

// newPlain is New without options.
func newPlain(db *sql.DB) *idemmysql.Dialect { return idemmysql.New(db) }

// optimisticPaths are the Dialects of WithOptimisticDo, on both ways of
// bounding a lock wait; claimPath finds them too.
var optimisticPaths = []struct {
	name string
	new  func(*sql.DB) *idemmysql.Dialect
}{
	{"Optimistic", func(db *sql.DB) *idemmysql.Dialect { return idemmysql.New(db, idemmysql.WithOptimisticDo()) }},
	{"OptimisticSessionVariable", func(db *sql.DB) *idemmysql.Dialect {
		return idemmysql.NewSessionVariablePath(db, idemmysql.WithOptimisticDo())
	}},
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

// TestMigrateServerLock: Migrate serialises callers on a server-wide named
// lock, which needs a second connection of the pool. (Re-running, and down
// then up, are conformance cases.)
func TestMigrateServerLock(t *testing.T) {
	t.Parallel()
	srv := testServer(t)

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

	// The lock's connection and goose's would wait on each other until ctx
	// ended, holding the server-wide lock for every other migration.
	t.Run("SingleConnectionPoolRefused", func(t *testing.T) {
		t.Parallel()
		ctx := t.Context()
		name := srv.createDatabase(ctx, t)
		db := srv.connect(t, name, true)
		db.SetMaxOpenConns(1)
		start := time.Now()
		require.ErrorIs(t, idemmysql.Migrate(ctx, db), idemmysql.ErrMigrateSingleConn)
		require.Less(t, time.Since(start), 5*time.Second, "refused at once, not after waiting")
		require.False(t, tableExists(ctx, t, db, "idempotency_keys"))
		db.SetMaxOpenConns(2)
		require.NoError(t, idemmysql.Migrate(ctx, db))
		requireFullyMigrated(ctx, t, db)
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
			var myErr *gomysql.MySQLError
			require.ErrorAs(t, err, &myErr, "the driver's error is the Cause")
			require.EqualValues(t, 1205, myErr.Number)
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
	ctx, b := setup(t, newPlain, true)
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

	t.Run("LockWaitTimeoutOutsideClaimIsRetryable", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, newPlain, true)
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
		ctx, b := setup(t, newPlain, true)
		tx := b.begin(ctx, t)
		var id int64
		require.NoError(t, tx.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&id))
		_, err := b.admin.ExecContext(ctx, fmt.Sprintf("KILL %d", id))
		require.NoError(t, err)
		_, err = b.d.Tx(tx).Get(ctx, &idem.GetParams{Scope: "t1/create", Key: "k"})
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		require.ErrorIs(t, b.d.Commit(ctx, tx), idem.ErrStoreUnavailable)
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

// seedScope holds the records written by seed.
const seedScope = "t1/reap"

// seedRecord is a record written straight into idempotency_keys, so that a
// test controls every time the lease and reaper statements compare.
type seedRecord struct {
	key     string
	status  idem.Status
	lease   time.Time // lease_expires_at; also created_at and updated_at
	expires time.Time // expires_at
}

func completed(key string, lease, expires time.Time) seedRecord {
	return seedRecord{key: key, status: idem.StatusSucceeded, lease: lease, expires: expires}
}

// seed inserts recs in scope seedScope, a few hundred rows per statement.
func (b *bundle) seed(ctx context.Context, t *testing.T, recs ...seedRecord) {
	t.Helper()
	const batch = 200
	for start := 0; start < len(recs); start += batch {
		var q strings.Builder
		q.WriteString(`INSERT INTO idempotency_keys (scope, idempotency_key, fingerprint, status,
			token, attempt, lease_expires_at, response_status, response_body,
			created_at, updated_at, completed_at, expires_at) VALUES `)
		var args []any
		for i, r := range recs[start:min(start+batch, len(recs))] {
			if i > 0 {
				q.WriteString(", ")
			}
			q.WriteString("(?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?)")
			var respStatus, body, done any // NULL while processing
			if r.status.Final() {
				respStatus, body, done = http.StatusOK, []byte{}, r.lease
			}
			fp := idem.NewFingerprint([]byte(r.key))
			args = append(args, []byte(seedScope), []byte(r.key), fp[:], r.status,
				lastToken.Add(1), r.lease, respStatus, body, r.lease, r.lease, done, r.expires)
		}
		_, err := b.db.ExecContext(ctx, q.String(), args...)
		require.NoError(t, err)
	}
}

// keys returns the keys stored in seedScope, sorted.
func (b *bundle) keys(ctx context.Context, t *testing.T) []string {
	t.Helper()
	rows, err := b.db.QueryContext(ctx,
		"SELECT idempotency_key FROM idempotency_keys WHERE scope = ? ORDER BY idempotency_key", []byte(seedScope))
	require.NoError(t, err)
	defer func() { _ = rows.Close() }()
	var keys []string
	for rows.Next() {
		var k []byte
		require.NoError(t, rows.Scan(&k))
		keys = append(keys, string(k))
	}
	require.NoError(t, rows.Err())
	return keys
}

// pinnedNow is finer than the columns and not in UTC: statements must store
// and compare it at µs, in UTC.
var pinnedNow = time.Date(2031, 5, 6, 7, 8, 9, 123456789, time.FixedZone("X", 5*3600))

// TestRenewLeaseInOldSnapshot: a caller transaction whose snapshot predates
// a renewal committed by another connection can repeat that renewal: the
// check after an UPDATE that changed nothing reads the latest row, not the
// snapshot.
func TestRenewLeaseInOldSnapshot(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, newPlain, true)
	now := pinnedNow
	cp := claimParams("k")
	cp.Now = &now
	_, err := b.d.DB().Claim(ctx, cp)
	require.NoError(t, err)

	tx := b.begin(ctx, t)
	var n int // fixes the snapshot: the lease as claimed
	require.NoError(t, tx.QueryRowContext(ctx, "SELECT COUNT(*) FROM idempotency_keys").Scan(&n))
	later := now.Add(time.Second)
	renew := &idem.RenewLeaseParams{
		Scope: cp.Scope, Key: cp.Key, Token: cp.Token, NewToken: cp.Token, Duration: time.Hour, Now: &later,
	}
	want, err := b.d.DB().RenewLease(ctx, renew)
	require.NoError(t, err)
	got, err := b.d.Tx(tx).RenewLease(ctx, renew)
	require.NoError(t, err)
	require.Equal(t, want, got)
	require.NoError(t, b.d.Commit(ctx, tx))
}

// TestDeleteExpiredSkipsHeldRows: InnoDB's range scan also reaches the first
// live row past the expired range; a lock on it, as on an expired row, is
// skipped, not waited for. (A held takeover and two reapers are conformance
// cases.)
func TestDeleteExpiredSkipsHeldRows(t *testing.T) {
	t.Parallel()
	now := pinnedNow
	at := now.UTC().Truncate(time.Microsecond)
	// deletePromptly deletes on the pool; a statement that waited for a
	// lock would run into the context's deadline, long before the server's
	// 50 s innodb_lock_wait_timeout.
	deletePromptly := func(ctx context.Context, t *testing.T, b *bundle, limit int) int {
		t.Helper()
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		start := time.Now()
		n, err := b.d.DB().DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: limit, Now: &now})
		require.NoError(t, err)
		require.Less(t, time.Since(start), 3*time.Second)
		return n
	}

	t.Run("RowsLockedForUpdate", func(t *testing.T) {
		t.Parallel()
		ctx, b := setup(t, newPlain, true)
		b.seed(ctx, t,
			completed("e1", at, at.Add(-3*time.Minute)),
			completed("e2", at, at.Add(-2*time.Minute)),
			completed("e3", at, at.Add(-time.Minute)),
			completed("live-1", at, at.Add(time.Minute)),
			completed("live-2", at, at.Add(time.Hour)),
		)
		// The oldest expired row, and the first live row past the expired
		// range, which InnoDB's range scan reaches too.
		holder := b.begin(ctx, t)
		for _, key := range []string{"e1", "live-1"} {
			var k []byte
			require.NoError(t, holder.QueryRowContext(ctx,
				"SELECT idempotency_key FROM idempotency_keys WHERE scope = ? AND idempotency_key = ? FOR UPDATE",
				[]byte(seedScope), []byte(key)).Scan(&k))
		}
		require.Equal(t, 2, deletePromptly(ctx, t, b, 10))
		require.Equal(t, []string{"e1", "live-1", "live-2"}, b.keys(ctx, t))
		require.NoError(t, b.d.Rollback(ctx, holder))
		require.Equal(t, 1, deletePromptly(ctx, t, b, 10))
		require.Equal(t, []string{"live-1", "live-2"}, b.keys(ctx, t))
	})

}

// TestLeaseAndReaperStatementsUseTheirIndexes checks the plans on a table
// large enough for the optimizer to prefer the indexes.
func TestLeaseAndReaperStatementsUseTheirIndexes(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, newPlain, true) // interpolated: EXPLAIN gets the values
	now := pinnedNow
	at := now.UTC().Truncate(time.Microsecond)
	recs := make([]seedRecord, 0, 1200)
	for i := range cap(recs) {
		// A few stale leases and a few expired records among many live ones.
		r := seedRecord{
			key:     fmt.Sprintf("k%04d", i),
			status:  idem.Status(1 + i%3),
			lease:   at.Add(time.Duration(i-10) * time.Second),
			expires: at.Add(time.Duration(i-10) * time.Minute),
		}
		recs = append(recs, r)
	}
	b.seed(ctx, t, recs...)
	_, err := b.db.ExecContext(ctx, "ANALYZE TABLE idempotency_keys")
	require.NoError(t, err)

	plan := explain(ctx, t, b.db, idemmysql.ListStaleLeasesQuery, idem.StatusProcessing, now, now, 100)
	require.Len(t, plan, 1)
	require.Equal(t, "idempotency_keys_stale_lease_idx", plan[0]["key"])
	require.Equal(t, "range", plan[0]["type"])
	require.NotContains(t, plan[0]["extra"], "filesort")

	plan = explain(ctx, t, b.db, idemmysql.DeleteExpiredQuery, now, 100)
	var sawDerived, sawTarget bool
	for _, row := range plan {
		require.False(t, row["type"] == "ALL" && !strings.HasPrefix(row["table"], "<derived"),
			"no full scan of idempotency_keys: %v", row)
		switch row["table"] {
		case "idempotency_keys":
			sawDerived = true
			require.Equal(t, "idempotency_keys_expires_at_idx", row["key"])
			require.Equal(t, "range", row["type"])
			require.NotContains(t, row["extra"], "filesort")
		case "k":
			sawTarget = true
			require.Equal(t, "PRIMARY", row["key"])
			require.Equal(t, "eq_ref", row["type"])
		}
	}
	require.True(t, sawDerived && sawTarget, "plan: %v", plan)
}

// explain returns the rows of EXPLAIN query, each as lower-case column name
// to value (MySQL and MariaDB print different columns).
func explain(ctx context.Context, t *testing.T, db *sql.DB, query string, args ...any) []map[string]string {
	t.Helper()
	rows, err := db.QueryContext(ctx, "EXPLAIN "+query, args...)
	require.NoError(t, err)
	defer func() { _ = rows.Close() }()
	cols, err := rows.Columns()
	require.NoError(t, err)
	var plan []map[string]string
	for rows.Next() {
		vals := make([]sql.NullString, len(cols))
		dest := make([]any, len(cols))
		for i := range vals {
			dest[i] = &vals[i]
		}
		require.NoError(t, rows.Scan(dest...))
		row := make(map[string]string, len(cols))
		for i, c := range cols {
			row[strings.ToLower(c)] = vals[i].String
		}
		plan = append(plan, row)
	}
	require.NoError(t, rows.Err())
	return plan
}

// record states that the takeover and lease tests start from.
const (
	stateProcessing = "processing"
	stateCompleted  = "completed"
)

// claimAt claims key on exec with the clock pinned at now: lease until
// now+1m, retention until now+1h; completed, it is completed at now, which
// keeps the retention deadline. It returns the claim's parameters.
func claimAt(ctx context.Context, t *testing.T, exec idem.Executor, key, state string, now time.Time) *idem.ClaimParams {
	t.Helper()
	cp := claimParams(key)
	cp.Now = &now
	res, err := exec.Claim(ctx, cp)
	require.NoError(t, err)
	require.True(t, res.Created)
	if state == stateCompleted {
		require.NoError(t, exec.Complete(ctx, &idem.CompleteParams{
			Scope: cp.Scope, Key: cp.Key, Token: cp.Token, Status: idem.StatusSucceeded,
			Response: &idem.Response{StatusCode: http.StatusCreated, Body: []byte("done")}, Retention: time.Hour, Now: &now,
		}))
	}
	return cp
}

// takeoverOf returns the arguments of a takeover of the record claimed with
// cp, at now.
func takeoverOf(cp *idem.ClaimParams, cond idem.TakeoverCondition, now time.Time) *idem.TakeoverParams {
	return &idem.TakeoverParams{
		Scope: cp.Scope, Key: cp.Key, Token: cp.Token, NewToken: lastToken.Add(1),
		Fingerprint: idem.NewFingerprint([]byte("takeover")), Attempt: 2,
		LeaseDuration: time.Minute, Retention: time.Hour,
		Condition: cond, WaitTimeout: 10 * time.Second, Now: &now,
	}
}

// stored reads the record for key whatever its retention deadline.
func (b *bundle) stored(ctx context.Context, t *testing.T, key string) *idem.Record {
	t.Helper()
	past := time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	rec, err := b.d.DB().Get(ctx, &idem.GetParams{Scope: "t1/create", Key: key, Now: &past})
	require.NoError(t, err)
	return rec
}

// TestTakeoverInOldSnapshot: a caller's transaction whose REPEATABLE READ
// snapshot predates a holder's completion or renewal does not overwrite it:
// the takeover's condition is evaluated on the newest committed row, not the
// snapshot. (The wait for an uncommitted holder is a conformance case.)
func TestTakeoverInOldSnapshot(t *testing.T) {
	t.Parallel()
	at := pinnedNow.UTC().Truncate(time.Microsecond)
	for _, tc := range []struct {
		name  string
		cond  idem.TakeoverCondition
		after time.Duration
		// holder writes, in the holder's executor, what keeps the record.
		holder func(ctx context.Context, exec idem.Executor, cp *idem.ClaimParams, now time.Time) error
		check  func(t *testing.T, rec *idem.Record)
	}{
		{
			name: "CompletedKeepsRecord", cond: idem.TakeoverRetentionExpired, after: 2 * time.Hour,
			holder: func(ctx context.Context, exec idem.Executor, cp *idem.ClaimParams, now time.Time) error {
				return exec.Complete(ctx, &idem.CompleteParams{
					Scope: cp.Scope, Key: cp.Key, Token: cp.Token, Status: idem.StatusSucceeded,
					Response: &idem.Response{StatusCode: http.StatusCreated, Body: []byte("late")}, Retention: time.Hour, Now: &now,
				})
			},
			check: func(t *testing.T, rec *idem.Record) {
				t.Helper()
				require.Equal(t, idem.StatusSucceeded, rec.Status)
				require.Equal(t, []byte("late"), rec.Response.Body)
			},
		},
		{
			name: "RenewedKeepsLease", cond: idem.TakeoverLeaseExpired, after: 2 * time.Minute,
			holder: func(ctx context.Context, exec idem.Executor, cp *idem.ClaimParams, now time.Time) error {
				_, err := exec.RenewLease(ctx, &idem.RenewLeaseParams{
					Scope: cp.Scope, Key: cp.Key, Token: cp.Token, NewToken: cp.Token,
					Duration: time.Minute, WaitTimeout: time.Second, Now: &now,
				})
				return err
			},
			check: func(t *testing.T, rec *idem.Record) {
				t.Helper()
				require.Equal(t, idem.StatusProcessing, rec.Status)
				require.Equal(t, at.Add(3*time.Minute), rec.LeaseExpiresAt)
			},
		},
	} {
		for _, path := range claimPaths {
			t.Run(tc.name+"/OldSnapshot/"+path.name, func(t *testing.T) {
				t.Parallel()
				ctx, b := setup(t, path.new, true)
				cp := claimAt(ctx, t, b.d.DB(), "k", stateProcessing, pinnedNow)
				now := pinnedNow.Add(tc.after)
				tx := b.begin(ctx, t)
				var n int // fixes the snapshot: the record as claimed
				require.NoError(t, tx.QueryRowContext(ctx, "SELECT COUNT(*) FROM idempotency_keys").Scan(&n))
				require.NoError(t, tc.holder(ctx, b.d.DB(), cp, now))

				require.ErrorIs(t, b.d.Tx(tx).Takeover(ctx, takeoverOf(cp, tc.cond, now)), idem.ErrFenced)
				require.NoError(t, b.d.Commit(ctx, tx))
				rec := b.stored(ctx, t, "k")
				require.Equal(t, cp.Token, rec.Token)
				tc.check(t, rec)
			})
		}
	}
}

// TestLeaseWritesWaitIsBounded: Takeover and RenewLease wait for a
// transaction holding the record no longer than WaitTimeout (rounded up to
// whole seconds), on the pool and in a caller's transaction, and report it
// as Claim does; the caller's transaction stays usable.
func TestLeaseWritesWaitIsBounded(t *testing.T) {
	t.Parallel()
	const wait = time.Second
	for _, op := range []struct {
		name string
		run  func(ctx context.Context, exec idem.Executor, cp *idem.ClaimParams) error
	}{
		{"Takeover", func(ctx context.Context, exec idem.Executor, cp *idem.ClaimParams) error {
			p := takeoverOf(cp, idem.TakeoverReserved, pinnedNow)
			p.WaitTimeout = wait
			return exec.Takeover(ctx, p)
		}},
		{"RenewLease", func(ctx context.Context, exec idem.Executor, cp *idem.ClaimParams) error {
			_, err := exec.RenewLease(ctx, &idem.RenewLeaseParams{
				Scope: cp.Scope, Key: cp.Key, Token: cp.Token, NewToken: cp.Token,
				Duration: time.Minute, WaitTimeout: wait, Now: &pinnedNow,
			})
			return err
		}},
	} {
		for _, path := range claimPaths {
			for _, inTx := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/%s/inTx=%v", op.name, path.name, inTx), func(t *testing.T) {
					t.Parallel()
					ctx, b := setup(t, path.new, true)
					cp := claimAt(ctx, t, b.d.DB(), "k", stateProcessing, pinnedNow)
					holder := b.begin(ctx, t)
					var k []byte
					require.NoError(t, holder.QueryRowContext(ctx,
						"SELECT idempotency_key FROM idempotency_keys WHERE scope = ? AND idempotency_key = ? FOR UPDATE",
						[]byte(cp.Scope), []byte(cp.Key)).Scan(&k))

					exec := b.d.DB()
					var tx *sql.Tx
					if inTx {
						tx = b.begin(ctx, t)
						_, err := tx.ExecContext(ctx, "SET SESSION innodb_lock_wait_timeout = 7")
						require.NoError(t, err)
						exec = b.d.Tx(tx)
					}
					start := time.Now()
					err := op.run(ctx, exec, cp)
					elapsed := time.Since(start)
					var ip *idem.InProgressError
					require.ErrorAs(t, err, &ip)
					require.Equal(t, wait, ip.RetryAfter)
					require.False(t, ip.TxAborted)
					var myErr *gomysql.MySQLError
					require.ErrorAs(t, err, &myErr)
					require.EqualValues(t, 1205, myErr.Number)
					require.GreaterOrEqual(t, elapsed, wait-50*time.Millisecond)
					require.Less(t, elapsed, 3*time.Second)

					if inTx {
						require.Equal(t, 7, lockWait(ctx, t, tx), "the session's own setting is back")
						require.NoError(t, b.insertOrder(ctx, tx, "after-timeout"))
						require.NoError(t, b.d.Commit(ctx, tx))
						n, err := b.countOrders(ctx, "after-timeout")
						require.NoError(t, err)
						require.Equal(t, 1, n)
					}
					// Once the holder is gone, the same call goes through.
					require.NoError(t, b.d.Rollback(ctx, holder))
					require.NoError(t, op.run(ctx, b.d.DB(), cp))
				})
			}
		}
	}
}

// TestReplayInTwoOpenTransactions: a claim that finds a completed record
// takes a shared lock on it, so any number of open transactions replay the
// same key side by side, and so do the pool and Do.
func TestReplayInTwoOpenTransactions(t *testing.T) {
	t.Parallel()
	for _, path := range claimPaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, path.new, true)
			store := b.store(t, &idem.Config{WaitTimeout: 5 * time.Second})
			c, err := store.Claim(ctx, "t1/create", "k", idem.NewFingerprint())
			require.NoError(t, err)
			require.NoError(t, store.Complete(ctx, c, &idem.Response{StatusCode: http.StatusCreated, Body: []byte("done")}))

			replay := func(c *idem.Claim, err error) {
				t.Helper()
				require.NoError(t, err)
				require.False(t, c.Acquired())
				require.Equal(t, []byte("done"), c.Replay.Response.Body)
			}
			start := time.Now()
			tx1, tx2 := b.begin(ctx, t), b.begin(ctx, t)
			replay(store.ClaimTx(ctx, tx1, "t1/create", "k", idem.NewFingerprint()))
			replay(store.ClaimTx(ctx, tx2, "t1/create", "k", idem.NewFingerprint()))
			replay(store.Claim(ctx, "t1/create", "k", idem.NewFingerprint()))
			res, err := store.Do(ctx, "t1/create", "k", idem.NewFingerprint(), func(context.Context, *sql.Tx) (*idem.Response, error) {
				return nil, errors.New("must not run")
			})
			require.NoError(t, err)
			require.True(t, res.Replayed)
			require.Less(t, time.Since(start), time.Second, "replays must not wait for each other")
			require.NoError(t, b.d.Commit(ctx, tx1))
			require.NoError(t, b.d.Commit(ctx, tx2))
		})
	}
}

// TestClaimLocksUntilTransactionEnds: the claim's duplicate check and read
// leave a shared lock on an existing record until the transaction ends:
// other shared readers pass, writers wait. The duplicate key error rolls
// back only its statement: the transaction's earlier and later writes
// commit.
func TestClaimLocksUntilTransactionEnds(t *testing.T) {
	t.Parallel()
	for _, path := range claimPaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, path.new, true)
			store := b.store(t, &idem.Config{WaitTimeout: 5 * time.Second})
			c, err := store.Claim(ctx, "t1/create", "k", idem.NewFingerprint())
			require.NoError(t, err)
			require.NoError(t, store.Complete(ctx, c, &idem.Response{StatusCode: http.StatusCreated}))

			tx := b.begin(ctx, t)
			require.NoError(t, b.insertOrder(ctx, tx, "before"))
			replay, err := store.ClaimTx(ctx, tx, "t1/create", "k", idem.NewFingerprint())
			require.NoError(t, err)
			require.False(t, replay.Acquired())
			require.NoError(t, b.insertOrder(ctx, tx, "after"))

			other := b.begin(ctx, t)
			_, err = other.ExecContext(ctx, "SET SESSION innodb_lock_wait_timeout = 1")
			require.NoError(t, err)
			lock := func(mode string) error {
				var k []byte
				return other.QueryRowContext(ctx,
					"SELECT idempotency_key FROM idempotency_keys WHERE scope = ? AND idempotency_key = ? "+mode,
					[]byte("t1/create"), []byte("k")).Scan(&k)
			}
			require.NoError(t, lock("LOCK IN SHARE MODE"))
			require.NoError(t, b.d.Rollback(ctx, other)) // drop its shared lock
			other = b.begin(ctx, t)
			_, err = other.ExecContext(ctx, "SET SESSION innodb_lock_wait_timeout = 1")
			require.NoError(t, err)
			err = lock("FOR UPDATE")
			var myErr *gomysql.MySQLError
			require.ErrorAs(t, err, &myErr)
			require.EqualValues(t, 1205, myErr.Number)

			require.NoError(t, b.d.Commit(ctx, tx))
			require.NoError(t, lock("FOR UPDATE"), "the lock ends with the transaction")
			for _, ref := range []string{"before", "after"} {
				n, err := b.countOrders(ctx, ref)
				require.NoError(t, err)
				require.Equal(t, 1, n, ref)
			}
		})
	}
}

// TestWaitersWhenHolderRollsBack: several transactions wait for one
// uncommitted claim; when it rolls back, one of them acquires the key.
// Each of the others either is a deadlock victim (1213, ErrRetryable: InnoDB
// rolled its transaction back) or waits for the new holder and replays its
// result. None is left hanging, none acquires a second time.
func TestWaitersWhenHolderRollsBack(t *testing.T) {
	t.Parallel()
	for _, path := range claimPaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, path.new, true)
			store := b.store(t, &idem.Config{WaitTimeout: 10 * time.Second})
			holder := b.begin(ctx, t)
			_, err := store.ClaimTx(ctx, holder, "t1/create", "k", idem.NewFingerprint())
			require.NoError(t, err)

			const waiters = 4
			type outcome struct {
				acquired, replayed, retryable bool
				err                           error
			}
			outcomes := make(chan outcome, waiters)
			for range waiters {
				tx := b.begin(ctx, t)
				go func() {
					c, err := store.ClaimTx(ctx, tx, "t1/create", "k", idem.NewFingerprint())
					var o outcome
					switch {
					case err == nil && c.Acquired():
						o.acquired = true
						if err := store.CompleteTx(ctx, tx, c, &idem.Response{StatusCode: http.StatusCreated}); err != nil {
							o.err = err
						} else {
							o.err = b.d.Commit(ctx, tx)
						}
					case err == nil:
						o.replayed = true
					default:
						var myErr *gomysql.MySQLError
						o.retryable = errors.Is(err, idem.ErrRetryable) && errors.As(err, &myErr) && myErr.Number == 1213
						if !o.retryable {
							o.err = err
						}
					}
					_ = b.d.Rollback(context.WithoutCancel(ctx), tx)
					outcomes <- o
				}()
			}
			time.Sleep(500 * time.Millisecond) // let them all wait
			require.NoError(t, b.d.Rollback(ctx, holder))

			var acquired, replayed, retryable int
			for range waiters {
				select {
				case o := <-outcomes:
					require.NoError(t, o.err)
					switch {
					case o.acquired:
						acquired++
					case o.replayed:
						replayed++
					case o.retryable:
						retryable++
					}
				case <-time.After(8 * time.Second):
					t.Fatal("a waiter is still waiting")
				}
			}
			require.Equal(t, 1, acquired)
			require.Equal(t, waiters-1, replayed+retryable)
			t.Logf("after the rollback: 1 acquired, %d replayed, %d deadlock victims", replayed, retryable)
			rec, err := store.Get(ctx, "t1/create", "k")
			require.NoError(t, err)
			require.Equal(t, idem.StatusSucceeded, rec.Status)
		})
	}
}

// TestCancelledWaitLeavesNothing: a pool claim cancelled while it waits for
// an uncommitted holder returns context.Canceled and leaves neither a
// record, once the holder rolls back, nor a connection with a shortened lock
// wait timeout in the pool.
func TestCancelledWaitLeavesNothing(t *testing.T) {
	t.Parallel()
	for _, path := range claimPaths {
		t.Run(path.name, func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, path.new, true)
			store := b.store(t, &idem.Config{WaitTimeout: 5 * time.Second})
			holder := b.begin(ctx, t)
			_, err := store.ClaimTx(ctx, holder, "t1/create", "k", idem.NewFingerprint())
			require.NoError(t, err)

			pool := testServer(t).connect(t, b.name, true)
			pool.SetMaxOpenConns(1)
			poolStore, err := idem.New(path.new(pool), &idem.Config{WaitTimeout: 5 * time.Second})
			require.NoError(t, err)
			before := lockWait(ctx, t, pool)
			cctx, cancel := context.WithCancel(ctx)
			time.AfterFunc(300*time.Millisecond, cancel)
			_, err = poolStore.Claim(cctx, "t1/create", "k", idem.NewFingerprint())
			require.ErrorIs(t, err, context.Canceled)
			require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
			require.Equal(t, before, lockWait(ctx, t, pool))

			require.NoError(t, b.d.Rollback(ctx, holder))
			time.Sleep(200 * time.Millisecond) // let the server notice the closed connection
			n, err := b.countRecords(ctx)
			require.NoError(t, err)
			require.Zero(t, n, "the cancelled claim committed a record")
		})
	}
}

// TestConcurrentTakeoversOfExpiredKey: two transactions whose claims both
// found the same expired record hold shared locks on it, so their takeovers
// deadlock: InnoDB rolls one back (1213, ErrRetryable) and the other takes
// the key over.
func TestConcurrentTakeoversOfExpiredKey(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, newPlain, true)
	cp := claimAt(ctx, t, b.d.DB(), "k", stateCompleted, pinnedNow)
	now := pinnedNow.Add(2 * time.Hour)
	tx1, tx2 := b.begin(ctx, t), b.begin(ctx, t)
	for _, tx := range []*sql.Tx{tx1, tx2} {
		p := claimParams("k")
		p.Now = &now
		res, err := b.d.Tx(tx).Claim(ctx, p)
		require.NoError(t, err)
		require.False(t, res.Created)
		require.Equal(t, cp.Token, res.Record.Token)
	}
	p1, p2 := takeoverOf(cp, idem.TakeoverRetentionExpired, now), takeoverOf(cp, idem.TakeoverRetentionExpired, now)
	errc := make(chan error, 1)
	go func() { errc <- b.d.Tx(tx1).Takeover(ctx, p1) }()
	time.Sleep(300 * time.Millisecond) // let the first one wait for tx2's lock
	err2 := b.d.Tx(tx2).Takeover(ctx, p2)
	err1 := <-errc

	winner, winnerTx, victim := p1, tx1, err2
	if err1 != nil {
		winner, winnerTx, victim = p2, tx2, err1
	}
	require.ErrorIs(t, victim, idem.ErrRetryable)
	var myErr *gomysql.MySQLError
	require.ErrorAs(t, victim, &myErr)
	require.EqualValues(t, 1213, myErr.Number)
	require.NoError(t, b.d.Commit(ctx, winnerTx))
	require.Equal(t, winner.NewToken, b.stored(ctx, t, "k").Token)
}

// TestChangedSinceSnapshotIsRetryable: with MariaDB's
// innodb_snapshot_isolation=ON (the default from 11.6), a claim in a
// transaction whose snapshot predates a change to the record fails with
// 1020 and the server rolls the transaction back: ErrRetryable, like a
// deadlock. Skipped where the variable does not exist (MySQL, MariaDB
// before 10.6.18/10.11.8).
func TestChangedSinceSnapshotIsRetryable(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, newPlain, true)
	store := b.store(t, nil)
	c, err := store.Claim(ctx, "t1/create", "k", idem.NewFingerprint())
	require.NoError(t, err)

	tx := b.begin(ctx, t)
	if _, err := tx.ExecContext(ctx, "SET SESSION innodb_snapshot_isolation = ON"); err != nil {
		var myErr *gomysql.MySQLError
		require.ErrorAs(t, err, &myErr)
		require.EqualValues(t, 1193, myErr.Number, "unknown system variable")
		t.Skip("the server has no innodb_snapshot_isolation")
	}
	// The setting stays on the connection, in this test's own pool.
	var n int // fixes the snapshot: the record processing
	require.NoError(t, tx.QueryRowContext(ctx, "SELECT COUNT(*) FROM idempotency_keys").Scan(&n))
	require.NoError(t, store.Complete(ctx, c, &idem.Response{StatusCode: http.StatusCreated}))

	_, err = store.ClaimTx(ctx, tx, "t1/create", "k", idem.NewFingerprint())
	require.ErrorIs(t, err, idem.ErrRetryable)
	var myErr *gomysql.MySQLError
	require.ErrorAs(t, err, &myErr)
	require.EqualValues(t, 1020, myErr.Number)
}

// TestReplayReadPastRetentionOnServerClock: with the server's clock (no
// Config.Now), a first read finds a completed record whose retention ran
// out and does not replay it: Do runs its callback under a fresh claim.
// The conformance suite pins the clock (Config.Now); this is the path of
// almost every Store, GetCompleted's retention predicate on the server's
// clock, in both protocols.
func TestReplayReadPastRetentionOnServerClock(t *testing.T) {
	t.Parallel()
	for _, interpolate := range []bool{true, false} {
		t.Run(fmt.Sprintf("interpolate=%v", interpolate), func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, newPlain, interpolate)
			store := b.store(t, &idem.Config{ReplayRead: idem.ReplayReadAlways, Retention: time.Hour})
			const scope, key = "t1/create", "past-retention"
			var calls int
			fn := func(context.Context, *sql.Tx) (*idem.Response, error) {
				calls++
				return &idem.Response{StatusCode: 201, Body: []byte(fmt.Sprintf(`{"call":%d}`, calls))}, nil
			}
			_, err := store.Do(ctx, scope, key, idem.NewFingerprint(), fn)
			require.NoError(t, err)
			res, err := store.Do(ctx, scope, key, idem.NewFingerprint(), fn)
			require.NoError(t, err)
			require.True(t, res.Replayed, "within retention the record replays")

			// A second before the server's now: past retention by the
			// server's clock, whatever the client's says.
			_, err = b.db.ExecContext(ctx, "UPDATE idempotency_keys SET expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE scope = ? AND idempotency_key = ?", scope, key)
			require.NoError(t, err)
			res, err = store.Do(ctx, scope, key, idem.NewFingerprint(), fn)
			require.NoError(t, err)
			require.False(t, res.Replayed, "past retention the key is free")
			require.Equal(t, 2, calls)
			require.JSONEq(t, `{"call":2}`, string(res.Response.Body))
		})
	}
}

// TestPreparedReplayRead: on the pool and the server's clock the replay read
// is a prepared statement (queryCompleted). A prepare that failed (here the
// table is away when the first replay read runs) must not stick, and the read
// must go on when the server drops the connections it was prepared on. Do
// falls back to its claim when the read fails, so the read is checked on the
// pool's executor itself.
func TestPreparedReplayRead(t *testing.T) {
	t.Parallel()
	for _, interpolate := range []bool{true, false} {
		t.Run(fmt.Sprintf("interpolate=%v", interpolate), func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, newPlain, interpolate)
			store := b.store(t, &idem.Config{ReplayRead: idem.ReplayReadAlways})
			reader, ok := b.d.DB().(idem.ReplayReader)
			require.True(t, ok, "the pool's executor reads replays")
			const scope, key = "t1/create", "prepared"
			read := func() (*idem.Record, error) {
				return reader.GetCompleted(ctx, &idem.GetParams{Scope: scope, Key: key})
			}
			var calls int
			fn := func(context.Context, *sql.Tx) (*idem.Response, error) {
				calls++
				return &idem.Response{StatusCode: 201, Body: []byte(`{"id":1}`)}, nil
			}

			_, err := b.db.ExecContext(ctx, "RENAME TABLE idempotency_keys TO idempotency_keys_away")
			require.NoError(t, err)
			_, err = read()
			require.Error(t, err, "no table, no prepared read")
			require.NotErrorIs(t, err, idem.ErrNotFound)
			_, err = b.db.ExecContext(ctx, "RENAME TABLE idempotency_keys_away TO idempotency_keys")
			require.NoError(t, err)
			_, err = read()
			require.ErrorIs(t, err, idem.ErrNotFound, "the failed prepare is tried again")

			res, err := store.Do(ctx, scope, key, idem.NewFingerprint(), fn)
			require.NoError(t, err)
			require.False(t, res.Replayed)
			rec, err := read()
			require.NoError(t, err)
			require.Equal(t, idem.StatusSucceeded, rec.Status)
			require.JSONEq(t, `{"id":1}`, string(rec.Response.Body))

			rows, err := b.admin.QueryContext(ctx, "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = ?", b.name)
			require.NoError(t, err)
			var ids []int64
			for rows.Next() {
				var id int64
				require.NoError(t, rows.Scan(&id))
				ids = append(ids, id)
			}
			require.NoError(t, rows.Err())
			require.NotEmpty(t, ids)
			for _, id := range ids {
				_, err := b.admin.ExecContext(ctx, fmt.Sprintf("KILL CONNECTION %d", id))
				require.NoError(t, err)
			}
			for range 2 * len(ids) {
				rec, err := read()
				require.NoError(t, err, "a read after the server dropped the pool's connections")
				require.JSONEq(t, `{"id":1}`, string(rec.Response.Body))
				res, err := store.Do(ctx, scope, key, idem.NewFingerprint(), fn)
				require.NoError(t, err)
				require.True(t, res.Replayed)
			}
			require.Equal(t, 1, calls)

			// First reads at once on a fresh Dialect: each may prepare, one
			// statement is kept, every read answers.
			fresh, ok := newPlain(b.db).DB().(idem.ReplayReader)
			require.True(t, ok)
			var wg sync.WaitGroup
			errs := make(chan error, 16)
			for range 16 {
				wg.Go(func() {
					rec, err := fresh.GetCompleted(ctx, &idem.GetParams{Scope: scope, Key: key})
					if err == nil && string(rec.Response.Body) != `{"id":1}` {
						err = fmt.Errorf("body %q", rec.Response.Body)
					}
					errs <- err
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
		})
	}
}

// TestReplayStatementSharedPerPool: the replay read's prepared statement
// belongs to the pool. Dialects built freely over one *sql.DB (one per
// tenant, or per request) prepare it once between them, not once each,
// which would leave a server-side statement per Dialect on every connection
// until it closed, up to the server-wide max_prepared_stmt_count; and when
// the last of them is gone the statement is closed on the server.
func TestReplayStatementSharedPerPool(t *testing.T) {
	t.Parallel()
	for _, interpolate := range []bool{true, false} {
		t.Run(fmt.Sprintf("interpolate=%v", interpolate), func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, newPlain, interpolate)
			// One connection: its session counters see every prepare and
			// close of the pool.
			b.db.SetMaxOpenConns(1)
			const scope, key = "t1/create", "shared"
			func() {
				store, err := idem.New(idemmysql.New(b.db), nil)
				require.NoError(t, err)
				_, err = store.Do(ctx, scope, key, idem.NewFingerprint(), func(context.Context, *sql.Tx) (*idem.Response, error) {
					return &idem.Response{StatusCode: 201, Body: []byte(`{"id":1}`)}, nil
				})
				require.NoError(t, err)
			}()
			counter := func(name string) (int64, error) {
				var v int64
				var n string
				err := b.db.QueryRowContext(ctx, "SHOW SESSION STATUS LIKE '"+name+"'").Scan(&n, &v)
				return v, err
			}
			prepares, err := counter("Com_stmt_prepare")
			require.NoError(t, err)
			closes, err := counter("Com_stmt_close")
			require.NoError(t, err)

			for range 50 {
				reader, ok := idemmysql.New(b.db).DB().(idem.ReplayReader)
				require.True(t, ok)
				rec, err := reader.GetCompleted(ctx, &idem.GetParams{Scope: scope, Key: key})
				require.NoError(t, err)
				require.JSONEq(t, `{"id":1}`, string(rec.Response.Body))
			}
			after, err := counter("Com_stmt_prepare")
			require.NoError(t, err)
			// At most once: the Dialect of the Do above may have prepared it
			// already, and if it has not been collected yet, it is shared.
			require.LessOrEqual(t, after-prepares, int64(1), "50 Dialects over one pool prepare the replay read once")

			// Every Dialect that used it is unreachable now.
			require.Eventually(t, func() bool {
				runtime.GC()
				n, err := counter("Com_stmt_close")
				return err == nil && n > closes
			}, 10*time.Second, 20*time.Millisecond, "the statement is closed once no Dialect uses it")
		})
	}
}
