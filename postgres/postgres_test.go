package postgres_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
	"github.com/idemstore/idem/migrations"
	idempg "github.com/idemstore/idem/postgres"
)

// testBundle is a migrated schema and a dialect over it.
type testBundle struct {
	pool    *pgxpool.Pool
	schema  string
	dialect *idempg.Dialect
}

// setup migrates a fresh schema for mode, which the dialect names
// explicitly (idempg.WithSchema): the pool sets no search_path.
func setup(t *testing.T, mode pgx.QueryExecMode) (context.Context, *testBundle) {
	t.Helper()
	ctx := t.Context()
	schema := createSchema(ctx, t)
	pool := testPool(ctx, t, mode, 10)
	require.NoError(t, idempg.Migrate(ctx, pool, idempg.WithSchema(schema)))
	return ctx, &testBundle{pool: pool, schema: schema, dialect: idempg.New(pool, idempg.WithSchema(schema))}
}

// q names the bundle's idempotency_keys table in sql.
func (b *testBundle) q(sql string) string { return qualify(b.schema, sql) }

// forEachMode runs fn as a parallel subtest per exec mode.
func forEachMode(t *testing.T, fn func(t *testing.T, mode pgx.QueryExecMode)) {
	t.Helper()
	testdb.PostgresURL(t) // skip or fail here rather than in each subtest
	for _, m := range execModes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			fn(t, m.mode)
		})
	}
}

func (b *testBundle) begin(ctx context.Context, t *testing.T, opts pgx.TxOptions) pgx.Tx {
	t.Helper()
	tx, err := b.pool.BeginTx(ctx, opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.WithoutCancel(ctx)) })
	return tx
}

// waitBlocked waits until some backend waits on a lock held by holder.
// The server is asked for holder's backend: through a pooler, the process
// ID of the client connection is the pooler's.
func (b *testBundle) waitBlocked(ctx context.Context, t *testing.T, holder pgx.Tx) {
	t.Helper()
	var pid int
	require.NoError(t, holder.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	require.Eventually(t, func() bool {
		var n int
		err := b.pool.QueryRow(ctx,
			`SELECT count(*) FROM pg_stat_activity WHERE $1::integer = ANY(pg_blocking_pids(pid))`, pid).Scan(&n)
		return err == nil && n > 0
	}, 10*time.Second, 10*time.Millisecond)
}

func claimParams(key string) *idem.ClaimParams {
	return &idem.ClaimParams{
		Scope:         "orders/create",
		Key:           key,
		Fingerprint:   idem.NewFingerprint([]byte("request")),
		Token:         time.Now().UnixNano(),
		LeaseDuration: 30 * time.Second,
		Retention:     24 * time.Hour,
		WaitTimeout:   10 * time.Second,
	}
}

func newKey() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "key-" + hex.EncodeToString(b[:])
}

func requirePgCode(t *testing.T, err error, code string) {
	t.Helper()
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, code, pgErr.Code)
}

func TestMigrate(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx := t.Context()
		schema := createSchema(ctx, t)
		pool := testPool(ctx, t, mode, 10)
		in := idempg.WithSchema(schema)

		require.NoError(t, idempg.Migrate(ctx, pool, in))
		require.NoError(t, idempg.Migrate(ctx, pool, in), "a second run must be a no-op")
		var applied int
		require.NoError(t, pool.QueryRow(ctx,
			`SELECT count(*) FROM `+qualifier(schema)(migrations.VersionTable)+` WHERE version_id > 0`).Scan(&applied))
		require.EqualValues(t, migrations.SchemaVersion, applied, "each version is applied once")

		tables := func() int {
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables
				WHERE table_schema = $1::text AND table_name = 'idempotency_keys'`, schema).Scan(&n))
			return n
		}
		indexes := func() int {
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_indexes
				WHERE schemaname = $1::text AND tablename = 'idempotency_keys'`, schema).Scan(&n))
			return n
		}
		require.Equal(t, 1, tables())
		require.Equal(t, 4, indexes(), "primary key, expires_at, stale lease and key digest indexes")

		db := stdlib.OpenDBFromPool(pool)
		t.Cleanup(func() { _ = db.Close() })
		fsys, err := migrations.FS(migrations.Postgres)
		require.NoError(t, err)
		fsys, err = idempg.InSchema(fsys, schema)
		require.NoError(t, err)
		p, err := goose.NewProvider(goose.DialectPostgres, db, fsys,
			goose.WithTableName(schema+"."+migrations.VersionTable), goose.WithDisableGlobalRegistry(true))
		require.NoError(t, err)
		_, err = p.DownTo(ctx, 0)
		require.NoError(t, err)
		require.Zero(t, tables())
		require.Zero(t, indexes())

		require.NoError(t, idempg.Migrate(ctx, pool, in), "migrating up again after a full down")
		require.Equal(t, 1, tables())
	})
}

func TestMigrateConcurrent(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	schema := createSchema(ctx, t)
	pool := testPool(ctx, t, defaultMode, 10)
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Go(func() { errs[i] = idempg.Migrate(ctx, pool, idempg.WithSchema(schema)) })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
}

func TestClaimTimes(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)

		t.Run("DatabaseClock", func(t *testing.T) {
			// Inside a transaction that started earlier, times come from the
			// current clock, not the transaction's start.
			tx := b.begin(ctx, t, pgx.TxOptions{})
			var txStart time.Time
			require.NoError(t, tx.QueryRow(ctx, `SELECT now()`).Scan(&txStart))
			_, err := tx.Exec(ctx, `SELECT pg_sleep(0.05)`)
			require.NoError(t, err)

			p := claimParams(newKey())
			res, err := b.dialect.Tx(tx).Claim(ctx, p)
			require.NoError(t, err)
			require.True(t, res.Created)
			rec := res.Record
			require.GreaterOrEqual(t, rec.CreatedAt.Sub(txStart), 50*time.Millisecond)
			require.Equal(t, rec.CreatedAt, rec.UpdatedAt, "one clock reading per statement")
			require.Equal(t, rec.CreatedAt.Add(p.LeaseDuration), rec.LeaseExpiresAt)
			require.Equal(t, rec.CreatedAt.Add(p.Retention), rec.ExpiresAt)
			require.False(t, res.Now.Before(rec.CreatedAt))
			require.Equal(t, time.UTC, rec.CreatedAt.Location())
			require.Equal(t, time.UTC, res.Now.Location())
		})

		t.Run("PinnedClock", func(t *testing.T) {
			// Nanoseconds are truncated the same way under every exec mode.
			pinned := time.Date(2030, 1, 2, 3, 4, 5, 123456789, time.FixedZone("X", 3600))
			want := pinned.UTC().Truncate(time.Microsecond)
			p := claimParams(newKey())
			p.Now = &pinned
			res, err := b.dialect.DB().Claim(ctx, p)
			require.NoError(t, err)
			require.Equal(t, want, res.Now)
			require.Equal(t, want, res.Record.CreatedAt)
			require.Equal(t, want.Add(p.LeaseDuration), res.Record.LeaseExpiresAt)
			require.Equal(t, want.Add(p.Retention), res.Record.ExpiresAt)

			// Get compares expires_at with the pinned clock.
			get := &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: new(want.Add(p.Retention - time.Microsecond))}
			_, err = b.dialect.DB().Get(ctx, get)
			require.NoError(t, err)
			get.Now = new(want.Add(p.Retention))
			_, err = b.dialect.DB().Get(ctx, get)
			require.ErrorIs(t, err, idem.ErrNotFound)
		})
	})
}

func TestCompleteEmptyResponse(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		p := claimParams(newKey())
		_, err := b.dialect.DB().Claim(ctx, p)
		require.NoError(t, err)
		require.NoError(t, b.dialect.DB().Complete(ctx, &idem.CompleteParams{
			Scope: p.Scope, Key: p.Key, Token: p.Token, Status: idem.StatusSucceeded,
			Response: &idem.Response{StatusCode: 204}, Retention: time.Hour,
		}))

		rec, err := b.dialect.DB().Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key})
		require.NoError(t, err)
		require.Equal(t, 204, rec.Response.StatusCode)
		require.Nil(t, rec.Response.Header)
		require.NotNil(t, rec.Response.Body)
		require.Empty(t, rec.Response.Body)
		var isNull bool
		require.NoError(t, b.pool.QueryRow(ctx, b.q(`SELECT response_body IS NULL FROM idempotency_keys`)).Scan(&isNull))
		require.False(t, isNull, "an empty body is stored as empty, not NULL")
	})
}

func TestClaimWait(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)

		t.Run("TimeoutOnPool", func(t *testing.T) {
			t.Parallel()
			holder := b.begin(ctx, t, pgx.TxOptions{})
			p := claimParams(newKey())
			_, err := b.dialect.Tx(holder).Claim(ctx, p)
			require.NoError(t, err)

			waiter := *p
			waiter.Token++
			waiter.WaitTimeout = 100 * time.Millisecond
			_, err = b.dialect.DB().Claim(ctx, &waiter)
			var ip *idem.InProgressError
			require.ErrorAs(t, err, &ip)
			require.Equal(t, waiter.WaitTimeout, ip.RetryAfter)
			require.False(t, ip.TxAborted, "there is no caller transaction to abort")
			requirePgCode(t, err, "55P03") // the cause stays reachable
			require.NotErrorIs(t, err, idem.ErrRetryable)
		})

		t.Run("TimeoutInTx", func(t *testing.T) {
			t.Parallel()
			holder := b.begin(ctx, t, pgx.TxOptions{})
			p := claimParams(newKey())
			_, err := b.dialect.Tx(holder).Claim(ctx, p)
			require.NoError(t, err)

			tx := b.begin(ctx, t, pgx.TxOptions{})
			waiter := *p
			waiter.Token++
			waiter.WaitTimeout = 100 * time.Millisecond
			_, err = b.dialect.Tx(tx).Claim(ctx, &waiter)
			var ip *idem.InProgressError
			require.ErrorAs(t, err, &ip)
			require.True(t, ip.TxAborted)
			requirePgCode(t, err, "55P03")

			// The transaction is aborted (25P02): not retryable, not an outage.
			_, err = b.dialect.Tx(tx).Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key})
			requirePgCode(t, err, "25P02")
			require.NotErrorIs(t, err, idem.ErrRetryable)
			require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
			require.NoError(t, b.dialect.Rollback(ctx, tx))
		})

		t.Run("TimeoutInSavepoint", func(t *testing.T) {
			t.Parallel()
			holder := b.begin(ctx, t, pgx.TxOptions{})
			p := claimParams(newKey())
			_, err := b.dialect.Tx(holder).Claim(ctx, p)
			require.NoError(t, err)

			// Claiming in a savepoint keeps the outer transaction usable.
			tx := b.begin(ctx, t, pgx.TxOptions{})
			sp, err := tx.Begin(ctx)
			require.NoError(t, err)
			waiter := *p
			waiter.Token++
			waiter.WaitTimeout = 50 * time.Millisecond
			_, err = b.dialect.Tx(sp).Claim(ctx, &waiter)
			require.ErrorIs(t, err, idem.ErrInProgress)
			require.NoError(t, b.dialect.Rollback(ctx, sp))
			var got string
			require.NoError(t, tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&got))
			require.Equal(t, "0", got)
		})

		t.Run("SeesHolderCommit", func(t *testing.T) {
			t.Parallel()
			holder := b.begin(ctx, t, pgx.TxOptions{})
			p := claimParams(newKey())
			_, err := b.dialect.Tx(holder).Claim(ctx, p)
			require.NoError(t, err)

			done := make(chan error, 1)
			var res *idem.ClaimResult
			go func() {
				waiter := *p
				waiter.Token++
				var err error
				res, err = b.dialect.DB().Claim(ctx, &waiter)
				done <- err
			}()
			b.waitBlocked(ctx, t, holder)
			require.NoError(t, b.dialect.Commit(ctx, holder))
			require.NoError(t, <-done)
			require.False(t, res.Created)
			require.Equal(t, p.Token, res.Record.Token, "the waiter reads the holder's committed record")
		})

		t.Run("InsertsAfterHolderRollback", func(t *testing.T) {
			t.Parallel()
			holder := b.begin(ctx, t, pgx.TxOptions{})
			p := claimParams(newKey())
			_, err := b.dialect.Tx(holder).Claim(ctx, p)
			require.NoError(t, err)

			done := make(chan error, 1)
			var res *idem.ClaimResult
			waiter := *p
			waiter.Token++
			go func() {
				var err error
				res, err = b.dialect.DB().Claim(ctx, &waiter)
				done <- err
			}()
			b.waitBlocked(ctx, t, holder)
			require.NoError(t, b.dialect.Rollback(ctx, holder))
			require.NoError(t, <-done)
			require.True(t, res.Created)
			require.Equal(t, waiter.Token, res.Record.Token)
		})
	})
}

func TestClaimRestoresLockTimeout(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)

		t.Run("InTx", func(t *testing.T) {
			t.Parallel()
			tx := b.begin(ctx, t, pgx.TxOptions{})
			_, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '7s'`)
			require.NoError(t, err)
			for range 2 { // insert, then replay
				_, err = b.dialect.Tx(tx).Claim(ctx, claimParams("same-key"))
				require.NoError(t, err)
				var got string
				require.NoError(t, tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&got))
				require.Equal(t, "7s", got)
			}
		})

		t.Run("OnPool", func(t *testing.T) {
			t.Parallel()
			one := testPool(ctx, t, mode, 1) // every statement on the same session
			exec := idempg.New(one, idempg.WithSchema(b.schema)).DB()
			lockTimeout := func() string {
				var got string
				require.NoError(t, one.QueryRow(ctx, `SHOW lock_timeout`).Scan(&got))
				return got
			}
			_, err := exec.Claim(ctx, claimParams(newKey()))
			require.NoError(t, err)
			require.Equal(t, "0", lockTimeout())

			// A claim that times out leaves the session as it was, too.
			holder := b.begin(ctx, t, pgx.TxOptions{})
			p := claimParams(newKey())
			_, err = b.dialect.Tx(holder).Claim(ctx, p)
			require.NoError(t, err)
			p.WaitTimeout = 50 * time.Millisecond
			_, err = exec.Claim(ctx, p)
			require.ErrorIs(t, err, idem.ErrInProgress)
			require.Equal(t, "0", lockTimeout())
		})
	})
}

func TestRepeatableReadConflictIsRetryable(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		p := claimParams(newKey())

		// The snapshot of tx predates the other claim's commit.
		tx := b.begin(ctx, t, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		_, err := tx.Exec(ctx, `SELECT 1`)
		require.NoError(t, err)
		other := *p
		_, err = b.dialect.DB().Claim(ctx, &other)
		require.NoError(t, err)

		p.Token++
		_, err = b.dialect.Tx(tx).Claim(ctx, p)
		require.ErrorIs(t, err, idem.ErrRetryable)
		requirePgCode(t, err, "40001")
	})
}

func TestRepeatableReadWaiterIsRetryable(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		holder := b.begin(ctx, t, pgx.TxOptions{})
		p := claimParams(newKey())
		_, err := b.dialect.Tx(holder).Claim(ctx, p)
		require.NoError(t, err)

		tx := b.begin(ctx, t, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		done := make(chan error, 1)
		go func() {
			waiter := *p
			waiter.Token++
			_, err := b.dialect.Tx(tx).Claim(ctx, &waiter)
			done <- err
		}()
		b.waitBlocked(ctx, t, holder)
		require.NoError(t, b.dialect.Commit(ctx, holder))
		err = <-done
		require.ErrorIs(t, err, idem.ErrRetryable)
		requirePgCode(t, err, "40001")
	})
}

func TestDeadlockIsRetryable(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, defaultMode)
	a, c := claimParams("key-a"), claimParams("key-b")
	txA := b.begin(ctx, t, pgx.TxOptions{})
	txB := b.begin(ctx, t, pgx.TxOptions{})
	_, err := b.dialect.Tx(txA).Claim(ctx, a)
	require.NoError(t, err)
	_, err = b.dialect.Tx(txB).Claim(ctx, c)
	require.NoError(t, err)

	// A waits for B's key while B waits for A's: the server aborts one.
	errs := make(chan error, 2)
	go func() {
		_, err := b.dialect.Tx(txA).Claim(ctx, c)
		errs <- err
	}()
	b.waitBlocked(ctx, t, txB)
	_, err = b.dialect.Tx(txB).Claim(ctx, a)
	errs <- err
	// The victim's transaction is aborted, which releases its locks, so the
	// survivor's claim goes through.
	var victims int
	for range 2 {
		if err := <-errs; err != nil {
			require.ErrorIs(t, err, idem.ErrRetryable)
			requirePgCode(t, err, "40P01")
			victims++
		}
	}
	require.Equal(t, 1, victims)
}

func TestErrorClassification(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, defaultMode)

	holder := b.begin(ctx, t, pgx.TxOptions{})
	p := claimParams(newKey())
	_, err := b.dialect.Tx(holder).Claim(ctx, p)
	require.NoError(t, err)
	waiter := *p
	waiter.Token++

	t.Run("DeadlineExceeded", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		_, err := b.dialect.DB().Claim(ctx, &waiter)
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		require.ErrorIs(t, err, context.DeadlineExceeded)
	})

	t.Run("Canceled", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(ctx)
		time.AfterFunc(100*time.Millisecond, cancel)
		_, err := b.dialect.DB().Claim(ctx, &waiter)
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
	})

	t.Run("StatementTimeout", func(t *testing.T) {
		t.Parallel()
		tx := b.begin(ctx, t, pgx.TxOptions{})
		_, err := tx.Exec(ctx, `SET LOCAL statement_timeout = '100ms'`)
		require.NoError(t, err)
		_, err = b.dialect.Tx(tx).Claim(ctx, &waiter)
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		requirePgCode(t, err, "57014")
	})

	t.Run("FencedAndNotFound", func(t *testing.T) {
		t.Parallel()
		exec := b.dialect.DB()
		key := newKey()
		_, err := exec.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: key})
		require.ErrorIs(t, err, idem.ErrNotFound)
		require.ErrorIs(t, exec.Release(ctx, &idem.ReleaseParams{Scope: p.Scope, Key: key, Token: 1}), idem.ErrFenced)
		require.ErrorIs(t, exec.Complete(ctx, &idem.CompleteParams{
			Scope: p.Scope, Key: key, Token: 1, Status: idem.StatusSucceeded,
			Response: &idem.Response{StatusCode: 200}, Retention: time.Hour,
		}), idem.ErrFenced)
		require.ErrorIs(t, exec.Takeover(ctx, &idem.TakeoverParams{
			Scope: p.Scope, Key: key, Token: 1, NewToken: 2, Attempt: 1,
			LeaseDuration: time.Minute, Retention: time.Hour, Condition: idem.TakeoverReserved,
		}), idem.ErrFenced)
	})

	t.Run("RollbackFinishedTx", func(t *testing.T) {
		t.Parallel()
		tx, err := b.dialect.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, b.dialect.Commit(ctx, tx))
		require.NoError(t, b.dialect.Rollback(ctx, tx))
		require.NoError(t, b.dialect.Rollback(ctx, tx))
	})
}

func TestClosedPool(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, defaultMode)
	b.pool.Close()

	p := claimParams(newKey())
	_, err := b.dialect.DB().Claim(ctx, p)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	_, err = b.dialect.DB().Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key})
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	require.ErrorIs(t, b.dialect.DB().Release(ctx, &idem.ReleaseParams{Scope: p.Scope, Key: p.Key, Token: 1}), idem.ErrStoreUnavailable)
	_, err = b.dialect.Begin(ctx)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	require.ErrorIs(t, idempg.Migrate(ctx, b.pool), idem.ErrStoreUnavailable)
}

// leaseClock is the pinned clock of the lease and reaper tests: a fixed
// instant far from the server's clock, so that only pinned times decide.
var leaseClock = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// seed claims key at claimedAt with the given lease and retention and
// returns the claim's parameters.
func (b *testBundle) seed(ctx context.Context, t *testing.T, key string, claimedAt time.Time, lease, retention time.Duration) *idem.ClaimParams {
	t.Helper()
	p := claimParams(key)
	p.LeaseDuration, p.Retention, p.Now = lease, retention, &claimedAt
	res, err := b.dialect.DB().Claim(ctx, p)
	require.NoError(t, err)
	require.True(t, res.Created)
	return p
}

// keys returns the keys of every stored record, sorted.
func (b *testBundle) keys(ctx context.Context, t *testing.T) []string {
	t.Helper()
	rows, err := b.pool.Query(ctx, b.q(`SELECT idempotency_key FROM idempotency_keys ORDER BY idempotency_key`))
	require.NoError(t, err)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return keys
}

func TestRenewLease(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)

		t.Run("PinnedClock", func(t *testing.T) {
			t.Parallel()
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			// Nanoseconds are truncated before the clock is used.
			at := leaseClock.Add(20*time.Second + 123456789)
			renew := &idem.RenewLeaseParams{
				Scope: p.Scope, Key: p.Key, Token: p.Token, NewToken: p.Token + 1,
				Duration: 45 * time.Second, Now: &at,
			}
			got, err := b.dialect.DB().RenewLease(ctx, renew)
			require.NoError(t, err)
			want := at.Truncate(time.Microsecond).Add(renew.Duration)
			require.Equal(t, want, got)
			require.Equal(t, time.UTC, got.Location())

			rec, err := b.dialect.DB().Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: &at})
			require.NoError(t, err)
			require.Equal(t, got, rec.LeaseExpiresAt, "the returned expiry is the stored one")
			require.Equal(t, renew.NewToken, rec.Token)
			require.Equal(t, at.Truncate(time.Microsecond), rec.UpdatedAt)
			require.Equal(t, leaseClock, rec.CreatedAt, "a renewal is not a new claim")
			require.Equal(t, leaseClock.Add(p.Retention), rec.ExpiresAt, "retention is not extended")
			require.Equal(t, idem.StatusProcessing, rec.Status)
			require.Equal(t, 1, rec.Attempt)

			// The old token is fenced and changes nothing.
			stale := *renew
			stale.NewToken = p.Token + 2
			stale.Now = new(at.Add(time.Second))
			_, err = b.dialect.DB().RenewLease(ctx, &stale)
			require.ErrorIs(t, err, idem.ErrFenced)
			after, err := b.dialect.DB().Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: &at})
			require.NoError(t, err)
			require.Equal(t, rec, after)

			// A plain renewal keeps the token.
			plain := &idem.RenewLeaseParams{
				Scope: p.Scope, Key: p.Key, Token: renew.NewToken, NewToken: renew.NewToken,
				Duration: time.Minute, Now: new(at.Add(time.Second)),
			}
			got, err = b.dialect.DB().RenewLease(ctx, plain)
			require.NoError(t, err)
			require.Equal(t, at.Truncate(time.Microsecond).Add(time.Second+time.Minute), got)
		})

		t.Run("DatabaseClock", func(t *testing.T) {
			t.Parallel()
			// Inside a transaction that started earlier, the renewal uses the
			// current clock, not the transaction's start.
			p := claimParams(newKey())
			res, err := b.dialect.DB().Claim(ctx, p)
			require.NoError(t, err)
			tx := b.begin(ctx, t, pgx.TxOptions{})
			_, err = tx.Exec(ctx, `SELECT pg_sleep(0.02)`)
			require.NoError(t, err)
			got, err := b.dialect.Tx(tx).RenewLease(ctx, &idem.RenewLeaseParams{
				Scope: p.Scope, Key: p.Key, Token: p.Token, NewToken: p.Token, Duration: time.Hour,
			})
			require.NoError(t, err)
			require.NoError(t, b.dialect.Commit(ctx, tx))

			rec, err := b.dialect.DB().Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key})
			require.NoError(t, err)
			require.Equal(t, got, rec.LeaseExpiresAt)
			require.Equal(t, rec.UpdatedAt.Add(time.Hour), got, "one clock reading for both columns")
			require.True(t, rec.UpdatedAt.After(res.Record.UpdatedAt))
		})

		t.Run("Fenced", func(t *testing.T) {
			t.Parallel()
			exec := b.dialect.DB()
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			renew := func(token int64) error {
				_, err := exec.RenewLease(ctx, &idem.RenewLeaseParams{
					Scope: p.Scope, Key: p.Key, Token: token, NewToken: token + 10,
					Duration: time.Hour, Now: new(leaseClock.Add(time.Second)),
				})
				return err
			}
			require.ErrorIs(t, renew(p.Token-1), idem.ErrFenced, "wrong token")

			completedAt := leaseClock.Add(time.Second)
			require.NoError(t, exec.Complete(ctx, &idem.CompleteParams{
				Scope: p.Scope, Key: p.Key, Token: p.Token, Status: idem.StatusSucceeded,
				Response: &idem.Response{StatusCode: 201}, Retention: time.Hour, Now: &completedAt,
			}))
			before, err := exec.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: &completedAt})
			require.NoError(t, err)
			require.ErrorIs(t, renew(p.Token), idem.ErrFenced, "right token, completed record")
			after, err := exec.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: &completedAt})
			require.NoError(t, err)
			require.Equal(t, before, after)

			_, err = exec.RenewLease(ctx, &idem.RenewLeaseParams{
				Scope: p.Scope, Key: newKey(), Token: p.Token, NewToken: p.Token, Duration: time.Hour,
			})
			require.ErrorIs(t, err, idem.ErrFenced, "no record")
		})
	})
}

func TestListStaleLeases(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		now := leaseClock
		b.seed(ctx, t, "stale-1", now.Add(-10*time.Minute), time.Minute, time.Hour)
		b.seed(ctx, t, "stale-2", now.Add(-5*time.Minute), time.Minute, time.Hour)
		b.seed(ctx, t, "stale-3", now.Add(-time.Minute), time.Minute, time.Hour) // lease ends at now: stale
		b.seed(ctx, t, "live-lease", now.Add(-time.Minute), 2*time.Minute, time.Hour)
		b.seed(ctx, t, "retention-over", now.Add(-2*time.Hour), time.Minute, time.Hour)
		b.seed(ctx, t, "retention-ends-now", now.Add(-time.Hour), time.Minute, time.Hour)
		done := b.seed(ctx, t, "completed", now.Add(-20*time.Minute), time.Minute, time.Hour)
		require.NoError(t, b.dialect.DB().Complete(ctx, &idem.CompleteParams{
			Scope: done.Scope, Key: done.Key, Token: done.Token, Status: idem.StatusSucceeded,
			Response: &idem.Response{StatusCode: 200}, Retention: time.Hour, Now: new(now.Add(-19 * time.Minute)),
		}))

		list := func(limit int, now *time.Time) ([]string, time.Time) {
			t.Helper()
			recs, used, err := b.dialect.DB().ListStaleLeases(ctx, &idem.ListStaleLeasesParams{Limit: limit, Now: now})
			require.NoError(t, err)
			var keys []string
			for _, rec := range recs {
				get, err := b.dialect.DB().Get(ctx, &idem.GetParams{Scope: rec.Scope, Key: rec.Key, Now: now})
				require.NoError(t, err)
				require.Equal(t, get, rec, "the whole record is read")
				keys = append(keys, rec.Key)
			}
			return keys, used
		}

		keys, used := list(10, &now)
		require.Equal(t, []string{"stale-1", "stale-2", "stale-3"}, keys, "oldest lease first")
		require.Equal(t, now, used)

		keys, _ = list(2, &now)
		require.Equal(t, []string{"stale-1", "stale-2"}, keys)

		// Nothing stale: the time used is still returned.
		early := now.Add(-3 * time.Hour)
		keys, used = list(10, &early)
		require.Empty(t, keys)
		require.Equal(t, early, used)

		// On the database's clock (years before leaseClock) no lease has run out.
		keys, used = list(10, nil)
		require.Empty(t, keys)
		require.WithinDuration(t, time.Now(), used, time.Minute)
		require.Equal(t, time.UTC, used.Location())

		// The read takes no row locks, so a locked record neither blocks it
		// nor is skipped.
		holder := b.begin(ctx, t, pgx.TxOptions{})
		_, err := holder.Exec(ctx, b.q(`SELECT 1 FROM idempotency_keys WHERE idempotency_key = 'stale-2' FOR UPDATE`))
		require.NoError(t, err)
		keys, _ = list(10, &now)
		require.Equal(t, []string{"stale-1", "stale-2", "stale-3"}, keys)

		for _, limit := range []int{0, -1} {
			_, _, err := b.dialect.DB().ListStaleLeases(ctx, &idem.ListStaleLeasesParams{Limit: limit, Now: &now})
			require.Error(t, err)
		}
	})
}

func TestDeleteExpired(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		now := leaseClock

		// seedExpired stores n records whose retention ended i minutes before
		// now (i = n..1), named expired-<i>, and returns their keys, oldest
		// first.
		seedExpired := func(ctx context.Context, t *testing.T, b *testBundle, n int) []string {
			t.Helper()
			var keys []string
			for i := n; i >= 1; i-- {
				key := "expired-" + strconv.Itoa(i)
				b.seed(ctx, t, key, now.Add(-time.Hour-time.Duration(i)*time.Minute), time.Minute, time.Hour)
				keys = append(keys, key)
			}
			return keys
		}
		deleteExpired := func(ctx context.Context, t *testing.T, exec idem.Executor, limit int) int {
			t.Helper()
			// A statement that waited on a lock would run into this deadline.
			ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			n, err := exec.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: limit, Now: &now})
			require.NoError(t, err)
			return n
		}

		t.Run("Limit", func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, mode)
			seedExpired(ctx, t, b, 5)
			b.seed(ctx, t, "expires-now", now.Add(-time.Hour), time.Minute, time.Hour)
			b.seed(ctx, t, "live-1", now.Add(-time.Hour).Add(time.Microsecond), time.Minute, time.Hour)
			b.seed(ctx, t, "live-2", now, time.Minute, time.Hour)
			// Completed records expire like processing ones.
			p := b.seed(ctx, t, "completed", now.Add(-3*time.Hour), time.Minute, time.Hour)
			require.NoError(t, b.dialect.DB().Complete(ctx, &idem.CompleteParams{
				Scope: p.Scope, Key: p.Key, Token: p.Token, Status: idem.StatusFailed,
				Response: &idem.Response{StatusCode: 402}, Retention: time.Hour, Now: new(now.Add(-70 * time.Minute)),
			}))

			// Oldest deadline first: completed (now-10m), then expired-5.
			require.Equal(t, 2, deleteExpired(ctx, t, b.dialect.DB(), 2))
			require.Equal(t, []string{"expired-1", "expired-2", "expired-3", "expired-4", "expires-now", "live-1", "live-2"}, b.keys(ctx, t))
			require.Equal(t, 5, deleteExpired(ctx, t, b.dialect.DB(), 100))
			require.Zero(t, deleteExpired(ctx, t, b.dialect.DB(), 100))
			require.Equal(t, []string{"live-1", "live-2"}, b.keys(ctx, t))
		})

		t.Run("SkipsLockedRows", func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, mode)
			keys := seedExpired(ctx, t, b, 2)

			// An open claim transaction takes over the older expired record
			// and holds its row lock.
			holder := b.begin(ctx, t, pgx.TxOptions{})
			p := claimParams(keys[0])
			rec, err := b.dialect.DB().Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: new(now.Add(-2 * time.Hour))})
			require.NoError(t, err)
			require.NoError(t, b.dialect.Tx(holder).Takeover(ctx, &idem.TakeoverParams{
				Scope: p.Scope, Key: p.Key, Token: rec.Token, NewToken: rec.Token + 1, Fingerprint: p.Fingerprint,
				Attempt: 2, LeaseDuration: time.Minute, Retention: time.Hour,
				Condition: idem.TakeoverRetentionExpired, WaitTimeout: time.Second, Now: &now,
			}))

			require.Equal(t, 1, deleteExpired(ctx, t, b.dialect.DB(), 10), "the locked record is skipped, not waited for")
			require.Equal(t, []string{keys[0]}, b.keys(ctx, t))

			// Committed, the takeover has a new retention deadline.
			require.NoError(t, b.dialect.Commit(ctx, holder))
			require.Zero(t, deleteExpired(ctx, t, b.dialect.DB(), 10))
			require.Equal(t, []string{keys[0]}, b.keys(ctx, t))
		})

		t.Run("ConcurrentReapers", func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, mode)
			seedExpired(ctx, t, b, 5)
			b.seed(ctx, t, "live", now, time.Minute, time.Hour)

			// Two reapers in open transactions take disjoint batches without
			// waiting for each other.
			first := b.begin(ctx, t, pgx.TxOptions{})
			second := b.begin(ctx, t, pgx.TxOptions{})
			require.Equal(t, 3, deleteExpired(ctx, t, b.dialect.Tx(first), 3))
			require.Equal(t, 2, deleteExpired(ctx, t, b.dialect.Tx(second), 3))
			require.Zero(t, deleteExpired(ctx, t, b.dialect.DB(), 10), "every expired row is locked by a reaper")
			require.NoError(t, b.dialect.Commit(ctx, first))
			require.NoError(t, b.dialect.Commit(ctx, second))
			require.Equal(t, []string{"live"}, b.keys(ctx, t))
		})

		t.Run("DatabaseClock", func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, mode)
			b.seed(ctx, t, "expired", time.Now().Add(-2*time.Hour), time.Minute, time.Hour)
			_, err := b.dialect.DB().Claim(ctx, claimParams("live"))
			require.NoError(t, err)
			n, err := b.dialect.DB().DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: 10})
			require.NoError(t, err)
			require.Equal(t, 1, n)
			require.Equal(t, []string{"live"}, b.keys(ctx, t))
		})

		t.Run("LimitOutOfRange", func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, mode)
			seedExpired(ctx, t, b, 1)
			for _, limit := range []int{0, -1} {
				_, err := b.dialect.DB().DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: limit, Now: &now})
				require.Error(t, err)
			}
			require.Len(t, b.keys(ctx, t), 1)
		})
	})
}

// planNode is one node of EXPLAIN (FORMAT JSON) output.
type planNode struct {
	NodeType  string     `json:"Node Type"`
	IndexName string     `json:"Index Name"`
	IndexCond string     `json:"Index Cond"`
	Plans     []planNode `json:"Plans"`
}

// indexConds returns, per index the plan scans with an index condition,
// that condition.
func indexConds(t *testing.T, plan []byte) map[string]string {
	t.Helper()
	var explained []struct{ Plan planNode }
	require.NoError(t, json.Unmarshal(plan, &explained))
	require.Len(t, explained, 1)
	conds := map[string]string{}
	var walk func(n planNode)
	walk = func(n planNode) {
		if n.IndexName != "" && n.IndexCond != "" {
			conds[n.IndexName] = n.IndexCond
		}
		for _, c := range n.Plans {
			walk(c)
		}
	}
	walk(explained[0].Plan)
	return conds
}

func TestLeaseQueryPlans(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, defaultMode)
	// A table shaped like production: mostly completed records within
	// retention, a few stale leases, a few records past retention. Large
	// enough that finding a reaper batch of 1000 by primary key beats
	// reading the table; on a small table a hash join over a sequential
	// scan is cheaper and the planner rightly takes it.
	_, err := b.pool.Exec(ctx, b.q(`INSERT INTO idempotency_keys (scope, idempotency_key, fingerprint,
		status, token, attempt, lease_expires_at, created_at, updated_at, expires_at)
		SELECT 's', 'k' || g, decode(repeat('00', 32), 'hex'),
			CASE WHEN g % 1000 = 0 THEN 1 ELSE 2 END, g, 1,
			$1::timestamptz - interval '1 minute', $1::timestamptz, $1::timestamptz,
			$1::timestamptz + CASE WHEN g % 500 = 1 THEN -1 ELSE 1 END * (g % 60 + 1) * interval '1 minute'
		FROM generate_series(1, 100000) g`), leaseClock)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, b.q(`ANALYZE idempotency_keys`))
	require.NoError(t, err)

	check := func(t *testing.T, explain func(sql string) []byte) {
		t.Helper()
		conds := indexConds(t, explain(b.q(idempg.ListStaleLeasesSQL)))
		require.Contains(t, conds, "idempotency_keys_stale_lease_idx")
		require.Contains(t, conds["idempotency_keys_stale_lease_idx"], "lease_expires_at")

		conds = indexConds(t, explain(b.q(idempg.DeleteExpiredSQL)))
		require.Contains(t, conds, "idempotency_keys_expires_at_idx")
		require.Contains(t, conds["idempotency_keys_expires_at_idx"], "expires_at")
		require.Contains(t, conds, "idempotency_keys_pkey", "the delete finds the batch by primary key")
	}

	// Both subtests only read the table, each on its own connection.
	t.Run("CustomPlan", func(t *testing.T) {
		t.Parallel()
		check(t, func(sql string) []byte {
			var plan []byte
			require.NoError(t, b.pool.QueryRow(ctx, `EXPLAIN (FORMAT JSON) `+sql, leaseClock, 1000).Scan(&plan))
			return plan
		})
	})

	t.Run("GenericPlan", func(t *testing.T) {
		t.Parallel()
		// The plan the statement cache may settle on after five runs. All
		// in one transaction, which keeps its server connection through a
		// pooler: SET LOCAL ends with it, the prepared statement is
		// deallocated in it.
		conn, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = conn.Rollback(context.WithoutCancel(ctx)) }()
		_, err = conn.Exec(ctx, `SET LOCAL plan_cache_mode = force_generic_plan`)
		require.NoError(t, err)
		check(t, func(sql string) []byte {
			_, err := conn.Exec(ctx, `PREPARE lease_plan(timestamptz, bigint) AS `+sql)
			require.NoError(t, err)
			var plan []byte
			require.NoError(t, conn.QueryRow(ctx,
				`EXPLAIN (FORMAT JSON) EXECUTE lease_plan('2030-01-02 03:04:05+00', 1000)`).Scan(&plan))
			_, err = conn.Exec(ctx, `DEALLOCATE lease_plan`)
			require.NoError(t, err)
			return plan
		})
	})
}

// longAgo is a pinned clock before every stored deadline: Get with it finds
// a record whatever its retention.
var longAgo = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// record reads the record claimed with p, live or not.
func (b *testBundle) record(ctx context.Context, t *testing.T, p *idem.ClaimParams) *idem.Record {
	t.Helper()
	rec, err := b.dialect.DB().Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: &longAgo})
	require.NoError(t, err)
	return rec
}

// takeoverOf returns the parameters of a takeover, with cond, of the record
// claimed with p, fenced by token, at now.
func takeoverOf(p *idem.ClaimParams, token int64, cond idem.TakeoverCondition, now *time.Time) *idem.TakeoverParams {
	return &idem.TakeoverParams{
		Scope: p.Scope, Key: p.Key, Token: token, NewToken: token + 100, Fingerprint: p.Fingerprint,
		Attempt: 2, LeaseDuration: time.Minute, Retention: time.Hour, Condition: cond,
		WaitTimeout: 10 * time.Second, Now: now,
	}
}

// renewOf returns the parameters of a renewal of the record claimed with p,
// fenced by p.Token, at now.
func renewOf(p *idem.ClaimParams, newToken int64, d time.Duration, onlyIfExpired bool, now *time.Time) *idem.RenewLeaseParams {
	return &idem.RenewLeaseParams{
		Scope: p.Scope, Key: p.Key, Token: p.Token, NewToken: newToken, Duration: d,
		OnlyIfExpired: onlyIfExpired, WaitTimeout: 10 * time.Second, Now: now,
	}
}

// completeOf returns the parameters of a completion of the record claimed
// with p, at now.
func completeOf(p *idem.ClaimParams, now *time.Time) *idem.CompleteParams {
	return &idem.CompleteParams{
		Scope: p.Scope, Key: p.Key, Token: p.Token, Status: idem.StatusSucceeded,
		Response: &idem.Response{StatusCode: 201, Body: []byte("done")}, Retention: time.Hour, Now: now,
	}
}

// afterHolder runs op while holder, which changed the record, is open, and
// returns op's result after end ended holder (commit or rollback).
func (b *testBundle) afterHolder(ctx context.Context, t *testing.T, holder pgx.Tx, end func(context.Context, pgx.Tx) error, op func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- op() }()
	b.waitBlocked(ctx, t, holder)
	require.NoError(t, end(ctx, holder))
	return <-done
}

// at returns the pinned lease clock moved by d.
func at(d time.Duration) *time.Time { return new(leaseClock.Add(d)) }

func TestTakeoverCondition(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		exec := b.dialect.DB()

		t.Run("RetentionExpired", func(t *testing.T) {
			t.Parallel()
			p := b.seed(ctx, t, newKey(), leaseClock, time.Minute, time.Hour)
			before := b.record(ctx, t, p)
			err := exec.Takeover(ctx, takeoverOf(p, p.Token, idem.TakeoverRetentionExpired, at(59*time.Minute)))
			require.ErrorIs(t, err, idem.ErrFenced, "retention has not run out")
			require.Equal(t, before, b.record(ctx, t, p))

			tp := takeoverOf(p, p.Token, idem.TakeoverRetentionExpired, at(time.Hour))
			require.NoError(t, exec.Takeover(ctx, tp), "retention runs out at its deadline")
			rec := b.record(ctx, t, p)
			require.Equal(t, tp.NewToken, rec.Token)
			require.Equal(t, idem.StatusProcessing, rec.Status)
			require.Equal(t, 2, rec.Attempt)
			require.Equal(t, tp.Now.Add(tp.Retention), rec.ExpiresAt)
		})

		t.Run("RetentionExpiredNotAfterCompletion", func(t *testing.T) {
			t.Parallel()
			// A claimer reads the record past its retention; the slow holder
			// completes, keeping its token; the takeover fenced by that
			// token must not overwrite the fresh result.
			p := b.seed(ctx, t, newKey(), leaseClock, time.Minute, time.Hour)
			require.NoError(t, exec.Complete(ctx, completeOf(p, at(2*time.Hour))))
			err := exec.Takeover(ctx, takeoverOf(p, p.Token, idem.TakeoverRetentionExpired, at(2*time.Hour)))
			require.ErrorIs(t, err, idem.ErrFenced)
			rec := b.record(ctx, t, p)
			require.Equal(t, idem.StatusSucceeded, rec.Status)
			require.Equal(t, []byte("done"), rec.Response.Body)
		})

		t.Run("RetentionExpiredRecheckedAfterWait", func(t *testing.T) {
			t.Parallel()
			// The completion is uncommitted when the takeover runs: the
			// takeover waits for it and re-checks the condition on the
			// committed row.
			p := b.seed(ctx, t, newKey(), leaseClock, time.Minute, time.Hour)
			holder := b.begin(ctx, t, pgx.TxOptions{})
			require.NoError(t, b.dialect.Tx(holder).Complete(ctx, completeOf(p, at(2*time.Hour))))
			err := b.afterHolder(ctx, t, holder, b.dialect.Commit, func() error {
				return exec.Takeover(ctx, takeoverOf(p, p.Token, idem.TakeoverRetentionExpired, at(2*time.Hour)))
			})
			require.ErrorIs(t, err, idem.ErrFenced)
			require.Equal(t, idem.StatusSucceeded, b.record(ctx, t, p).Status)

			// Had the holder rolled back, the takeover would have gone ahead.
			q := b.seed(ctx, t, newKey(), leaseClock, time.Minute, time.Hour)
			holder = b.begin(ctx, t, pgx.TxOptions{})
			require.NoError(t, b.dialect.Tx(holder).Complete(ctx, completeOf(q, at(2*time.Hour))))
			err = b.afterHolder(ctx, t, holder, b.dialect.Rollback, func() error {
				return exec.Takeover(ctx, takeoverOf(q, q.Token, idem.TakeoverRetentionExpired, at(2*time.Hour)))
			})
			require.NoError(t, err)
			require.Equal(t, q.Token+100, b.record(ctx, t, q).Token)
		})

		t.Run("LeaseExpired", func(t *testing.T) {
			t.Parallel()
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			before := b.record(ctx, t, p)
			err := exec.Takeover(ctx, takeoverOf(p, p.Token, idem.TakeoverLeaseExpired, at(29*time.Second)))
			require.ErrorIs(t, err, idem.ErrFenced, "the lease is live")
			require.Equal(t, before, b.record(ctx, t, p))

			tp := takeoverOf(p, p.Token, idem.TakeoverLeaseExpired, at(30*time.Second))
			require.NoError(t, exec.Takeover(ctx, tp), "the lease runs out at its deadline")
			require.Equal(t, tp.NewToken, b.record(ctx, t, p).Token)
		})

		t.Run("LeaseExpiredNotAfterCompletion", func(t *testing.T) {
			t.Parallel()
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			require.NoError(t, exec.Complete(ctx, completeOf(p, at(10*time.Second))))
			err := exec.Takeover(ctx, takeoverOf(p, p.Token, idem.TakeoverLeaseExpired, at(time.Minute)))
			require.ErrorIs(t, err, idem.ErrFenced, "a completed record has no lease to run out")
			require.Equal(t, idem.StatusSucceeded, b.record(ctx, t, p).Status)
		})

		t.Run("LeaseExpiredRecheckedAfterWait", func(t *testing.T) {
			t.Parallel()
			// The holder renews (keeping its token) in a transaction that
			// commits while the blind takeover waits.
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			holder := b.begin(ctx, t, pgx.TxOptions{})
			until, err := b.dialect.Tx(holder).RenewLease(ctx, renewOf(p, p.Token, 30*time.Second, false, at(40*time.Second)))
			require.NoError(t, err)
			err = b.afterHolder(ctx, t, holder, b.dialect.Commit, func() error {
				return exec.Takeover(ctx, takeoverOf(p, p.Token, idem.TakeoverLeaseExpired, at(40*time.Second)))
			})
			require.ErrorIs(t, err, idem.ErrFenced, "a renewed lease must not be stolen")
			rec := b.record(ctx, t, p)
			require.Equal(t, p.Token, rec.Token)
			require.Equal(t, until, rec.LeaseExpiresAt)
		})

		t.Run("Reserved", func(t *testing.T) {
			t.Parallel()
			// Token only: the lease and retention are live.
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			err := exec.Takeover(ctx, takeoverOf(p, p.Token-1, idem.TakeoverReserved, at(time.Second)))
			require.ErrorIs(t, err, idem.ErrFenced)
			tp := takeoverOf(p, p.Token, idem.TakeoverReserved, at(time.Second))
			require.NoError(t, exec.Takeover(ctx, tp))
			require.Equal(t, tp.NewToken, b.record(ctx, t, p).Token)
		})

		t.Run("UnknownCondition", func(t *testing.T) {
			t.Parallel()
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			before := b.record(ctx, t, p)
			// On a closed pool, any statement would fail as unavailable.
			closed, err := pgxpool.NewWithConfig(ctx, b.pool.Config())
			require.NoError(t, err)
			closed.Close()
			for _, cond := range []idem.TakeoverCondition{0, 99} {
				for _, exec := range []idem.Executor{exec, idempg.New(closed, idempg.WithSchema(b.schema)).DB()} {
					err := exec.Takeover(ctx, takeoverOf(p, p.Token, cond, at(2*time.Hour)))
					require.Error(t, err)
					require.NotErrorIs(t, err, idem.ErrFenced)
					require.NotErrorIs(t, err, idem.ErrStoreUnavailable, "the database is not asked")
				}
			}
			require.Equal(t, before, b.record(ctx, t, p))
		})
	})
}

func TestRenewLeaseConditions(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		exec := b.dialect.DB()

		t.Run("OnlyIfExpired", func(t *testing.T) {
			t.Parallel()
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			before := b.record(ctx, t, p)
			_, err := exec.RenewLease(ctx, renewOf(p, p.Token+1, time.Minute, true, at(29*time.Second)))
			require.ErrorIs(t, err, idem.ErrFenced, "the lease is live")
			require.Equal(t, before, b.record(ctx, t, p))

			got, err := exec.RenewLease(ctx, renewOf(p, p.Token+1, time.Minute, true, at(30*time.Second)))
			require.NoError(t, err)
			require.Equal(t, leaseClock.Add(90*time.Second), got)
			rec := b.record(ctx, t, p)
			require.Equal(t, p.Token+1, rec.Token)
			require.Equal(t, got, rec.LeaseExpiresAt)
		})

		t.Run("OnlyIfExpiredRecheckedAfterWait", func(t *testing.T) {
			t.Parallel()
			// The holder renews in a transaction that commits while a
			// reservation of its stale record waits.
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			holder := b.begin(ctx, t, pgx.TxOptions{})
			until, err := b.dialect.Tx(holder).RenewLease(ctx, renewOf(p, p.Token, 30*time.Second, false, at(40*time.Second)))
			require.NoError(t, err)
			err = b.afterHolder(ctx, t, holder, b.dialect.Commit, func() error {
				_, err := exec.RenewLease(ctx, renewOf(p, p.Token+1, time.Minute, true, at(40*time.Second)))
				return err
			})
			require.ErrorIs(t, err, idem.ErrFenced, "a renewed lease must not be reserved")
			rec := b.record(ctx, t, p)
			require.Equal(t, p.Token, rec.Token)
			require.Equal(t, until, rec.LeaseExpiresAt)
		})

		t.Run("RetentionCoversLease", func(t *testing.T) {
			t.Parallel()
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Minute, time.Hour)
			renew := func(now, d time.Duration) *idem.Record {
				t.Helper()
				got, err := exec.RenewLease(ctx, renewOf(p, p.Token, d, false, at(now)))
				require.NoError(t, err)
				rec := b.record(ctx, t, p)
				require.Equal(t, got, rec.LeaseExpiresAt)
				require.False(t, rec.ExpiresAt.Before(rec.LeaseExpiresAt), "retention must cover the live lease")
				return rec
			}
			rec := renew(50*time.Minute, 30*time.Minute)
			require.Equal(t, leaseClock.Add(80*time.Minute), rec.ExpiresAt, "retention moved out to the lease")
			rec = renew(55*time.Minute, time.Minute)
			require.Equal(t, leaseClock.Add(56*time.Minute), rec.LeaseExpiresAt)
			require.Equal(t, leaseClock.Add(80*time.Minute), rec.ExpiresAt, "retention never moves in")

			// Past the original retention deadline the record is live: Get
			// finds it and the reaper leaves it.
			_, err := exec.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: at(79 * time.Minute)})
			require.NoError(t, err)
			tx := b.begin(ctx, t, pgx.TxOptions{})
			_, err = b.dialect.Tx(tx).DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: 1000, Now: at(79 * time.Minute)})
			require.NoError(t, err)
			var n int
			require.NoError(t, tx.QueryRow(ctx, b.q(`SELECT count(*) FROM idempotency_keys WHERE idempotency_key = $1`), p.Key).Scan(&n))
			require.Equal(t, 1, n)
			require.NoError(t, b.dialect.Rollback(ctx, tx))
		})
	})
}

func TestReleaseOnlyIfLeaseExpired(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		exec := b.dialect.DB()
		release := func(p *idem.ClaimParams, now *time.Time) error {
			return exec.Release(ctx, &idem.ReleaseParams{
				Scope: p.Scope, Key: p.Key, Token: p.Token, OnlyIfLeaseExpired: true, Now: now,
			})
		}
		gone := func(t *testing.T, p *idem.ClaimParams) {
			t.Helper()
			_, err := exec.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key, Now: &longAgo})
			require.ErrorIs(t, err, idem.ErrNotFound)
		}

		t.Run("PinnedClock", func(t *testing.T) {
			t.Parallel()
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			require.ErrorIs(t, release(p, at(29*time.Second)), idem.ErrFenced, "the lease is live")
			b.record(ctx, t, p)
			require.NoError(t, release(p, at(30*time.Second)))
			gone(t, p)

			// Without the flag the lease does not matter.
			q := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			require.NoError(t, exec.Release(ctx, &idem.ReleaseParams{Scope: q.Scope, Key: q.Key, Token: q.Token, Now: at(time.Second)}))
			gone(t, q)
		})

		t.Run("DatabaseClock", func(t *testing.T) {
			t.Parallel()
			p := claimParams(newKey())
			_, err := exec.Claim(ctx, p)
			require.NoError(t, err)
			require.ErrorIs(t, release(p, nil), idem.ErrFenced, "the lease is live on the database's clock")
			b.record(ctx, t, p)
		})

		t.Run("RecheckedAfterWait", func(t *testing.T) {
			t.Parallel()
			p := b.seed(ctx, t, newKey(), leaseClock, 30*time.Second, time.Hour)
			holder := b.begin(ctx, t, pgx.TxOptions{})
			_, err := b.dialect.Tx(holder).RenewLease(ctx, renewOf(p, p.Token, 30*time.Second, false, at(40*time.Second)))
			require.NoError(t, err)
			err = b.afterHolder(ctx, t, holder, b.dialect.Commit, func() error {
				return release(p, at(40*time.Second))
			})
			require.ErrorIs(t, err, idem.ErrFenced, "a renewed lease must not be released")
			b.record(ctx, t, p)
		})
	})
}

func TestBoundedWaits(t *testing.T) {
	t.Parallel()
	// The writes that may wait for another transaction holding the record,
	// besides Claim (see TestClaimWait).
	ops := []struct {
		name string
		run  func(ctx context.Context, exec idem.Executor, p *idem.ClaimParams, wait time.Duration) error
	}{
		{"Takeover", func(ctx context.Context, exec idem.Executor, p *idem.ClaimParams, wait time.Duration) error {
			tp := takeoverOf(p, p.Token, idem.TakeoverReserved, nil)
			tp.WaitTimeout = wait
			return exec.Takeover(ctx, tp)
		}},
		{"RenewLease", func(ctx context.Context, exec idem.Executor, p *idem.ClaimParams, wait time.Duration) error {
			rp := renewOf(p, p.Token, time.Minute, false, nil)
			rp.WaitTimeout = wait
			_, err := exec.RenewLease(ctx, rp)
			return err
		}},
	}
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)

		// held claims a record and has an open transaction lock its row.
		held := func(t *testing.T) *idem.ClaimParams {
			t.Helper()
			p := claimParams(newKey())
			_, err := b.dialect.DB().Claim(ctx, p)
			require.NoError(t, err)
			holder := b.begin(ctx, t, pgx.TxOptions{})
			_, err = holder.Exec(ctx, b.q(`SELECT 1 FROM idempotency_keys WHERE idempotency_key = $1 FOR UPDATE`), p.Key)
			require.NoError(t, err)
			return p
		}

		for _, op := range ops {
			t.Run(op.name, func(t *testing.T) {
				t.Parallel()

				t.Run("TimeoutOnPool", func(t *testing.T) {
					t.Parallel()
					one := testPool(ctx, t, mode, 1) // every statement on the same session
					p := held(t)
					const wait = 200 * time.Millisecond
					start := time.Now()
					err := op.run(ctx, idempg.New(one, idempg.WithSchema(b.schema)).DB(), p, wait)
					elapsed := time.Since(start)
					var ip *idem.InProgressError
					require.ErrorAs(t, err, &ip)
					require.Equal(t, wait, ip.RetryAfter)
					require.False(t, ip.TxAborted, "there is no caller transaction to abort")
					requirePgCode(t, err, "55P03")
					require.GreaterOrEqual(t, elapsed, wait)
					require.Less(t, elapsed, wait+2*time.Second)

					var got string
					require.NoError(t, one.QueryRow(ctx, `SHOW lock_timeout`).Scan(&got))
					require.Equal(t, "0", got, "the session's lock_timeout is restored")
					require.EqualValues(t, 1, one.Stat().NewConnsCount(), "the connection outlives the timeout")
				})

				t.Run("TimeoutInTx", func(t *testing.T) {
					t.Parallel()
					p := held(t)
					tx := b.begin(ctx, t, pgx.TxOptions{})
					err := op.run(ctx, b.dialect.Tx(tx), p, 100*time.Millisecond)
					var ip *idem.InProgressError
					require.ErrorAs(t, err, &ip)
					require.True(t, ip.TxAborted)
					requirePgCode(t, err, "55P03")
					_, err = tx.Exec(ctx, `SELECT 1`)
					requirePgCode(t, err, "25P02")
				})

				t.Run("RestoresLockTimeoutInTx", func(t *testing.T) {
					t.Parallel()
					p := claimParams(newKey())
					_, err := b.dialect.DB().Claim(ctx, p)
					require.NoError(t, err)
					tx := b.begin(ctx, t, pgx.TxOptions{})
					_, err = tx.Exec(ctx, `SET LOCAL lock_timeout = '7s'`)
					require.NoError(t, err)
					fenced := *p
					fenced.Token--
					require.NoError(t, op.run(ctx, b.dialect.Tx(tx), p, time.Second))
					require.ErrorIs(t, op.run(ctx, b.dialect.Tx(tx), &fenced, time.Second), idem.ErrFenced)
					var got string
					require.NoError(t, tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&got))
					require.Equal(t, "7s", got)
				})
			})
		}
	})
}

func TestNilTx(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool, err := pgxpool.New(ctx, "postgres://idem@127.0.0.1:1/idem") // connects lazily: never
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	d := idempg.New(pool)

	exec := d.Tx(nil)
	p := claimParams(newKey())
	_, claimErr := exec.Claim(ctx, p)
	_, getErr := exec.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key})
	_, renewErr := exec.RenewLease(ctx, renewOf(p, p.Token, time.Minute, false, nil))
	_, _, listErr := exec.ListStaleLeases(ctx, &idem.ListStaleLeasesParams{Limit: 1})
	_, deleteErr := exec.DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: 1})
	for _, err := range []error{
		claimErr, getErr, renewErr, listErr, deleteErr,
		exec.Takeover(ctx, takeoverOf(p, p.Token, idem.TakeoverReserved, nil)),
		exec.Complete(ctx, completeOf(p, nil)),
		exec.Release(ctx, &idem.ReleaseParams{Scope: p.Scope, Key: p.Key, Token: p.Token}),
		d.Commit(ctx, nil),
		d.Rollback(ctx, nil),
	} {
		require.Error(t, err)
		require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
		require.NotErrorIs(t, err, idem.ErrNotFound)
		require.NotErrorIs(t, err, idem.ErrFenced)
	}
}

// TestCancelRequestWatcher: with a context watcher that cancels through the
// server (query_canceled, 57014) rather than by closing the connection, the
// end of the caller's context is still reported as such.
//
// Not through a transaction pooler: PgBouncer 1.18 crashes on the cancel
// request (postgres/doc.go, "Exec modes and PgBouncer").
func TestCancelRequestWatcher(t *testing.T) {
	t.Parallel()
	if testdb.PostgresPooler() {
		t.Skip("through a transaction pooler: PgBouncer 1.18 crashes on a cancel request (bad client state)")
	}
	ctx, b := setup(t, defaultMode)
	cfg, err := pgxpool.ParseConfig(testdb.PostgresURL(t))
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = defaultMode
	cfg.ConnConfig.BuildContextWatcherHandler = func(conn *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.CancelRequestContextWatcherHandler{Conn: conn, DeadlineDelay: 10 * time.Second}
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	exec := idempg.New(pool, idempg.WithSchema(b.schema)).DB()

	holder := b.begin(ctx, t, pgx.TxOptions{})
	p := claimParams(newKey())
	_, err = b.dialect.Tx(holder).Claim(ctx, p)
	require.NoError(t, err)
	waiter := *p
	waiter.Token++

	t.Run("Canceled", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(ctx)
		time.AfterFunc(100*time.Millisecond, cancel)
		_, err := exec.Claim(ctx, &waiter)
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
		requirePgCode(t, err, "57014")
	})

	t.Run("DeadlineExceeded", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		_, err := exec.Claim(ctx, &waiter)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		requirePgCode(t, err, "57014")
	})

	t.Run("StatementTimeout", func(t *testing.T) {
		t.Parallel()
		// The server's own timeout, with ctx alive: unavailable.
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(context.WithoutCancel(ctx)) })
		_, err = tx.Exec(ctx, `SET LOCAL statement_timeout = '100ms'`)
		require.NoError(t, err)
		_, err = idempg.New(pool, idempg.WithSchema(b.schema)).Tx(tx).Claim(ctx, &waiter)
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		require.NotErrorIs(t, err, context.Canceled)
		requirePgCode(t, err, "57014")
	})
}

// TestCanceledWaitLeavesNothing: a write on the pool whose context ends
// while it waits for another transaction leaves nothing behind when that
// transaction then rolls back, although the server finishes the write.
func TestCanceledWaitLeavesNothing(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		exec := b.dialect.DB()

		// canceledWhileHeld runs op with a context canceled while op waits
		// for holder, then rolls holder back.
		canceledWhileHeld := func(t *testing.T, holder pgx.Tx, op func(ctx context.Context) error) {
			t.Helper()
			cctx, cancel := context.WithCancel(ctx)
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- op(cctx) }()
			b.waitBlocked(ctx, t, holder)
			cancel()
			err := <-done
			require.ErrorIs(t, err, context.Canceled)
			require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
			require.NoError(t, b.dialect.Rollback(ctx, holder))
		}

		t.Run("Claim", func(t *testing.T) {
			t.Parallel()
			holder := b.begin(ctx, t, pgx.TxOptions{})
			p := claimParams(newKey())
			_, err := b.dialect.Tx(holder).Claim(ctx, p)
			require.NoError(t, err)
			waiter := *p
			waiter.Token++
			canceledWhileHeld(t, holder, func(ctx context.Context) error {
				_, err := exec.Claim(ctx, &waiter)
				return err
			})
			// A plain loop, not require.Never: its condition runs in a
			// goroutine that may outlive the test and must not fail it.
			for deadline := time.Now().Add(500 * time.Millisecond); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				_, err := exec.Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key})
				require.ErrorIs(t, err, idem.ErrNotFound, "the canceled claim committed")
			}
			res, err := exec.Claim(ctx, p)
			require.NoError(t, err)
			require.True(t, res.Created)
		})

		for _, name := range []string{"Takeover", "RenewLease"} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				p := claimParams(newKey())
				_, err := exec.Claim(ctx, p)
				require.NoError(t, err)
				before := b.record(ctx, t, p)
				holder := b.begin(ctx, t, pgx.TxOptions{})
				_, err = holder.Exec(ctx, b.q(`SELECT 1 FROM idempotency_keys WHERE idempotency_key = $1 FOR UPDATE`), p.Key)
				require.NoError(t, err)
				canceledWhileHeld(t, holder, func(ctx context.Context) error {
					if name == "Takeover" {
						return exec.Takeover(ctx, takeoverOf(p, p.Token, idem.TakeoverReserved, nil))
					}
					_, err := exec.RenewLease(ctx, renewOf(p, p.Token+1, time.Hour, false, nil))
					return err
				})
				for deadline := time.Now().Add(500 * time.Millisecond); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
					require.Equal(t, before.Token, b.record(ctx, t, p).Token, "the canceled write committed")
				}
				require.Equal(t, before, b.record(ctx, t, p))
			})
		}
	})
}

// TestDoUnderStricterDefaultIsolation: with REPEATABLE READ or SERIALIZABLE
// as the sessions' default, Do's deferred claim cannot trust a snapshot
// taken before the key's lock was granted. A fresh key still completes
// once, and a Do that waited for another Do holding the key replays that
// one's response without running its callback.
func TestDoUnderStricterDefaultIsolation(t *testing.T) {
	t.Parallel()
	if testdb.PostgresPooler() {
		t.Skip("through a transaction pooler: PgBouncer refuses the default_transaction_isolation startup parameter")
	}
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		for _, iso := range []string{"repeatable read", "serializable"} {
			t.Run(strings.ReplaceAll(iso, " ", "_"), func(t *testing.T) {
				cfg := b.pool.Config()
				cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = iso
				pool, err := pgxpool.NewWithConfig(ctx, cfg)
				require.NoError(t, err)
				t.Cleanup(pool.Close)
				store, err := idem.New(idempg.New(pool, idempg.WithSchema(b.schema)), &idem.Config{WaitTimeout: 5 * time.Second, MaxTxRetries: 5})
				require.NoError(t, err)
				fp := idem.NewFingerprint([]byte("x"))
				var calls atomic.Int32
				respond := func(body string) func(context.Context, pgx.Tx) (*idem.Response, error) {
					return func(context.Context, pgx.Tx) (*idem.Response, error) {
						calls.Add(1)
						return &idem.Response{StatusCode: 201, Body: []byte(body)}, nil
					}
				}

				res, err := store.Do(ctx, "t", newKey(), fp, respond("fresh"))
				require.NoError(t, err)
				require.False(t, res.Replayed)
				require.EqualValues(t, 1, calls.Load())

				key := newKey()
				entered, proceed := make(chan struct{}), make(chan struct{})
				first := make(chan error, 1)
				go func() {
					_, err := store.Do(ctx, "t", key, fp, func(ctx context.Context, tx pgx.Tx) (*idem.Response, error) {
						close(entered)
						<-proceed
						return respond("first")(ctx, tx)
					})
					first <- err
				}()
				<-entered
				second := make(chan *idem.Result, 1)
				go func() {
					res, err := store.Do(ctx, "t", key, fp, respond("second"))
					assert.NoError(t, err)
					second <- res
				}()
				time.Sleep(200 * time.Millisecond) // the second Do is waiting for the key's lock
				close(proceed)
				require.NoError(t, <-first)
				res = <-second
				require.NotNil(t, res)
				require.True(t, res.Replayed, "the second Do must replay the first one's response")
				require.Equal(t, "first", string(res.Response.Body))
				require.EqualValues(t, 2, calls.Load(), "the second Do's callback must not run")
			})
		}
	})
}

// orders names the bundle's orders table, which tests that write a
// business row create.
func (b *testBundle) orders() string { return qualifier(b.schema)("orders") }
