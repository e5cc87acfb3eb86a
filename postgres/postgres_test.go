package postgres_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
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

// TestStatementTimeoutIsUnavailable: a claim cut off by the session's
// statement_timeout (57014, which pgx also uses for its own context
// cancellation) is the store being unavailable.
func TestStatementTimeoutIsUnavailable(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, defaultMode)
	holder := b.begin(ctx, t, pgx.TxOptions{})
	p := claimParams(newKey())
	_, err := b.dialect.Tx(holder).Claim(ctx, p)
	require.NoError(t, err)
	waiter := *p
	waiter.Token++

	tx := b.begin(ctx, t, pgx.TxOptions{})
	_, err = tx.Exec(ctx, `SET LOCAL statement_timeout = '100ms'`)
	require.NoError(t, err)
	_, err = b.dialect.Tx(tx).Claim(ctx, &waiter)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	requirePgCode(t, err, "57014")
}

// leaseClock is the pinned clock of the lease and reaper tests: a fixed
// instant far from the server's clock, so that only pinned times decide.
var leaseClock = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

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

// nodeTypes returns the node types of the plan, every level.
func nodeTypes(t *testing.T, plan []byte) []string {
	t.Helper()
	var explained []struct{ Plan planNode }
	require.NoError(t, json.Unmarshal(plan, &explained))
	require.Len(t, explained, 1)
	var out []string
	var walk func(n planNode)
	walk = func(n planNode) {
		out = append(out, n.NodeType)
		for _, c := range n.Plans {
			walk(c)
		}
	}
	walk(explained[0].Plan)
	return out
}

func TestLeaseQueryPlans(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, defaultMode)
	// A table shaped like production: mostly completed records within
	// retention, a few stale leases, a few records past retention, large
	// enough that the planner prefers the indexes to reading the table.
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

		plan := explain(b.q(idempg.DeleteExpiredSQL))
		conds = indexConds(t, plan)
		require.Contains(t, conds, "idempotency_keys_expires_at_idx")
		require.Contains(t, conds["idempotency_keys_expires_at_idx"], "expires_at")
		nodes := nodeTypes(t, plan)
		require.Contains(t, nodes, "Tid Scan", "the delete finds the batch by ctid")
		require.NotContains(t, nodes, "Seq Scan", "no statement reads the whole table")
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

// TestCancelRequestWatcher: with a context watcher that cancels through the
// server (query_canceled, 57014) rather than by closing the connection, the
// end of the caller's context is still reported as such.
func TestCancelRequestWatcher(t *testing.T) {
	t.Parallel()
	// Not through a transaction pooler (.ci/pgbouncer.sh leaves it out): PgBouncer 1.18 crashes on a cancel request (bad client state).
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
	// Not through a transaction pooler (.ci/pgbouncer.sh leaves it out): PgBouncer refuses the default_transaction_isolation startup parameter.
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

// TestClaimDeferredSkipsOutsideReadCommitted: the ErrSkipDefer clause of
// idem.DeferredClaimer. Under REPEATABLE READ or SERIALIZABLE a snapshot may
// predate the key's lock, so a free key cannot be held without a row: the
// deferred claim, unpiped or with BEGIN, answers ErrSkipDefer, and the
// transaction stays usable for the Executor's Claim and Complete.
func TestClaimDeferredSkipsOutsideReadCommitted(t *testing.T) {
	t.Parallel()
	// Not through a transaction pooler: PgBouncer refuses the default_transaction_isolation startup parameter.
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		complete := func(p *idem.ClaimParams) *idem.CompleteParams {
			return &idem.CompleteParams{Scope: p.Scope, Key: p.Key, Token: p.Token, Status: idem.StatusSucceeded,
				Response: &idem.Response{StatusCode: 201, Body: []byte("x")}, Retention: time.Hour}
		}
		check := func(p *idem.ClaimParams, what string) {
			rec, err := b.dialect.DB().Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key})
			require.NoError(t, err, what)
			require.Equal(t, idem.StatusSucceeded, rec.Status, what)
			require.Equal(t, p.Token, rec.Token, what)
		}
		for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
			p := claimParams(newKey())
			tx, err := b.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			require.NoError(t, err)
			t.Cleanup(func() { _ = tx.Rollback(context.WithoutCancel(ctx)) })
			_, err = b.dialect.ClaimDeferred(ctx, tx, p)
			require.ErrorIs(t, err, idem.ErrSkipDefer, iso)
			res, err := b.dialect.Tx(tx).Claim(ctx, p)
			require.NoError(t, err, "%s: the transaction stays usable", iso)
			require.True(t, res.Created, iso)
			require.NoError(t, b.dialect.Tx(tx).Complete(ctx, complete(p)), iso)
			require.NoError(t, tx.Commit(ctx), iso)
			check(p, string(iso))
		}

		cfg := b.pool.Config()
		cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		d := idempg.New(pool, idempg.WithSchema(b.schema))
		p := claimParams(newKey())
		tx, _, err := d.BeginClaimDeferred(ctx, p)
		t.Cleanup(func() { _ = d.Rollback(context.WithoutCancel(ctx), tx) })
		require.ErrorIs(t, err, idem.ErrSkipDefer, "pipelined")
		res, err := d.Tx(tx).Claim(ctx, p)
		require.NoError(t, err, "pipelined: the transaction stays usable")
		require.True(t, res.Created)
		require.NoError(t, d.CompleteCommit(ctx, tx, complete(p)))
		check(p, "pipelined")
	})
}

// TestMigrateClosedPoolIsUnavailable: Migrate classifies like the Executor.
func TestMigrateClosedPoolIsUnavailable(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, defaultMode)
	b.pool.Close()
	require.ErrorIs(t, idempg.Migrate(ctx, b.pool), idem.ErrStoreUnavailable)
}

// orders names the bundle's orders table, which tests that write a
// business row create.
func (b *testBundle) orders() string { return qualifier(b.schema)("orders") }
