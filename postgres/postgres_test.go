package postgres_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
	"github.com/idemstore/idem/migrations"
	idempg "github.com/idemstore/idem/postgres"
)

// testBundle is a migrated schema and a dialect over it.
type testBundle struct {
	pool    *pgxpool.Pool
	dialect *idempg.Dialect
}

// setup migrates a fresh schema for mode.
func setup(t *testing.T, mode pgx.QueryExecMode) (context.Context, *testBundle) {
	t.Helper()
	ctx := t.Context()
	pool := openSchema(ctx, t, mode)
	require.NoError(t, idempg.Migrate(ctx, pool))
	return ctx, &testBundle{pool: pool, dialect: idempg.New(pool)}
}

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
func (b *testBundle) waitBlocked(ctx context.Context, t *testing.T, holder pgx.Tx) {
	t.Helper()
	pid := holder.Conn().PgConn().PID()
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
		pool := openSchema(ctx, t, mode)

		require.NoError(t, idempg.Migrate(ctx, pool))
		require.NoError(t, idempg.Migrate(ctx, pool), "a second run must be a no-op")
		var applied int
		require.NoError(t, pool.QueryRow(ctx,
			`SELECT count(*) FROM `+migrations.VersionTable+` WHERE version_id > 0`).Scan(&applied))
		require.Equal(t, 1, applied, "each version is applied once")

		tables := func() int {
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables
				WHERE table_schema = current_schema() AND table_name = 'idempotency_keys'`).Scan(&n))
			return n
		}
		indexes := func() int {
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_indexes
				WHERE schemaname = current_schema() AND tablename = 'idempotency_keys'`).Scan(&n))
			return n
		}
		require.Equal(t, 1, tables())
		require.Equal(t, 3, indexes(), "primary key, expires_at and stale lease indexes")

		db := stdlib.OpenDBFromPool(pool)
		t.Cleanup(func() { _ = db.Close() })
		p, err := migrations.NewProvider(migrations.Postgres, db)
		require.NoError(t, err)
		_, err = p.DownTo(ctx, 0)
		require.NoError(t, err)
		require.Zero(t, tables())
		require.Zero(t, indexes())

		require.NoError(t, idempg.Migrate(ctx, pool), "migrating up again after a full down")
		require.Equal(t, 1, tables())
	})
}

func TestMigrateConcurrent(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := openSchema(ctx, t, pgx.QueryExecModeCacheStatement)
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Go(func() { errs[i] = idempg.Migrate(ctx, pool) })
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
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT response_body IS NULL FROM idempotency_keys`).Scan(&isNull))
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
			var schema string
			require.NoError(t, b.pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema))
			one := schemaPool(ctx, t, schema, mode, 1) // every statement on the same session
			exec := idempg.New(one).DB()
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
	ctx, b := setup(t, pgx.QueryExecModeCacheStatement)
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
	ctx, b := setup(t, pgx.QueryExecModeCacheStatement)

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
			LeaseDuration: time.Minute, Retention: time.Hour,
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
	ctx, b := setup(t, pgx.QueryExecModeCacheStatement)
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
