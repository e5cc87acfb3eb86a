package postgres_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
	idempg "github.com/idemstore/idem/postgres"
)

// TestWithSchemaInvalid: a schema name WithSchema cannot pass to goose
// unquoted, or that PostgreSQL would truncate, is a configuration error on
// every call and in Migrate; nothing reaches the server.
func TestWithSchemaInvalid(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	pool := testPool(ctx, t, defaultMode, 2)
	for _, bad := range []string{"", "Idem", "1idem", "idem.keys", `idem"x`, "idem x", strings.Repeat("a", 64)} {
		d := idempg.New(pool, idempg.WithSchema(bad))
		p := claimParams(newKey())
		_, err := d.DB().Claim(ctx, p)
		require.ErrorIs(t, err, idem.ErrMisconfigured, "%q", bad)
		_, err = d.Begin(ctx)
		require.ErrorIs(t, err, idem.ErrMisconfigured, "%q", bad)
		tx, _, err := d.BeginClaim(ctx, p)
		require.ErrorIs(t, err, idem.ErrMisconfigured, "%q", bad)
		require.NoError(t, d.Rollback(ctx, tx))
		require.ErrorIs(t, idempg.Migrate(ctx, pool, idempg.WithSchema(bad)), idem.ErrMisconfigured, "%q", bad)
	}
	require.NoError(t, idempg.Migrate(ctx, pool, idempg.WithSchema(createSchema(ctx, t))), "a valid name")
	long := strings.Repeat("a", 63)
	_, err := idempg.New(pool, idempg.WithSchema(long)).DB().Get(ctx, &idem.GetParams{Scope: "s", Key: "k"})
	require.NotErrorIs(t, err, idem.ErrMisconfigured, "63 bytes is a valid name (the schema does not exist)")
}

// TestWithSchemaIgnoresSearchPath: with WithSchema, a search_path that
// points at another migrated schema changes nothing: claims, reads and the
// pipelined Do all use the named schema. Without it, the same search_path
// sends the dialect to the other table, which is what WithSchema prevents.
func TestWithSchemaIgnoresSearchPath(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		other := createSchema(ctx, t)
		require.NoError(t, idempg.Migrate(ctx, b.pool, idempg.WithSchema(other)))
		count := func(schema string) int {
			var n int
			require.NoError(t, b.pool.QueryRow(ctx, qualify(schema, `SELECT count(*) FROM idempotency_keys`)).Scan(&n))
			return n
		}
		// SET LOCAL: transaction state, which a transaction pooler keeps.
		inOther := func(t *testing.T, d *idempg.Dialect) {
			t.Helper()
			tx, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }()
			_, err = tx.Exec(ctx, `SELECT set_config('search_path', $1::text, true)`, pgx.Identifier{other}.Sanitize())
			require.NoError(t, err)
			p := claimParams(newKey())
			_, err = d.Tx(tx).Claim(ctx, p)
			require.NoError(t, err)
			_, err = d.Tx(tx).Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key})
			require.NoError(t, err, "the read finds the claim where it was written")
			require.NoError(t, tx.Commit(ctx))
		}

		inOther(t, b.dialect)
		require.Equal(t, 1, count(b.schema))
		require.Zero(t, count(other))

		inOther(t, idempg.New(b.pool)) // no option: search_path decides
		require.Equal(t, 1, count(b.schema))
		require.Equal(t, 1, count(other))

		store, err := idem.New(b.dialect, nil)
		require.NoError(t, err)
		res, err := store.Do(ctx, "s", newKey(), idem.NewFingerprint([]byte("x")), func(context.Context, pgx.Tx) (*idem.Response, error) {
			return &idem.Response{StatusCode: 201}, nil
		})
		require.NoError(t, err)
		require.False(t, res.Replayed)
		require.Equal(t, 2, count(b.schema))
	})
}

// TestStatementCacheLost: a prepared statement pgx's cache believes in but
// the server connection lacks (SQLSTATE 26000, what a transaction pooler
// causes by moving the client to another server connection; here DEALLOCATE
// ALL) is a configuration error whose message names the fix, and is not
// retryable, so Do gives up at once instead of retrying it or answering
// unavailable forever.
func TestStatementCacheLost(t *testing.T) {
	t.Parallel()
	// setup migrates in a mode safe through a pooler; the statement cache
	// is the dialect's alone.
	ctx, b := setup(t, defaultMode)
	cache := testPool(ctx, t, pgx.QueryExecModeCacheStatement, 1)
	d := idempg.New(cache, idempg.WithSchema(b.schema))
	tx, err := cache.Begin(ctx) // one server connection until it ends, also through a pooler
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.WithoutCancel(ctx)) })
	_, err = d.Tx(tx).Claim(ctx, claimParams(newKey())) // prepares the claim's statements
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `DEALLOCATE ALL`)
	require.NoError(t, err)
	_, err = d.Tx(tx).Claim(ctx, claimParams(newKey()))
	require.ErrorIs(t, err, idem.ErrMisconfigured)
	require.NotErrorIs(t, err, idem.ErrRetryable)
	require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
	requirePgCode(t, err, "26000")
	require.Contains(t, err.Error(), "QueryExecModeExec")

	var pgErr *pgconn.PgError
	for _, code := range []string{"26000", "42P05"} {
		err := idempg.InterpretError(ctx, &pgconn.PgError{Code: code, Message: `prepared statement "stmtcache_1" does not exist`})
		require.ErrorIs(t, err, idem.ErrMisconfigured, code)
		require.NotErrorIs(t, err, idem.ErrRetryable, code)
		require.ErrorAs(t, err, &pgErr)
	}
}

// TestStartupParameterRefused: PgBouncer refuses a connection that sets a
// startup parameter it does not track, such as a search_path: the same for
// every connection, so a configuration error, not an outage. Through the
// pooler the refusal is real; directly connected, the server accepts the
// parameter, and the refusal is PgBouncer's error as pgconn reports it.
func TestStartupParameterRefused(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, defaultMode)
	cfg := b.pool.Config()
	cfg.ConnConfig.RuntimeParams["search_path"] = b.schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = idempg.New(pool).DB().Claim(ctx, claimParams(newKey()))
	if testdb.PostgresPooler() {
		require.ErrorIs(t, err, idem.ErrMisconfigured)
		require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
		require.Contains(t, err.Error(), "WithSchema")
		requirePgCode(t, err, "08P01")
	} else {
		require.NoError(t, err, "the server takes search_path as a startup parameter")
	}
	refused := &pgconn.PgError{Severity: "FATAL", Code: "08P01", Message: "unsupported startup parameter: search_path"}
	require.ErrorIs(t, idempg.InterpretError(ctx, refused), idem.ErrMisconfigured)
	other := &pgconn.PgError{Severity: "ERROR", Code: "08P01", Message: "query_wait_timeout"}
	require.ErrorIs(t, idempg.InterpretError(ctx, other), idem.ErrStoreUnavailable, "PgBouncer's other 08P01 errors stay unavailable")
}

// TestStatementCacheBehindPooler: pgx's default exec mode (the statement
// cache) when the server connection can change between transactions.
// Directly connected it cannot, and every Do succeeds. Through a
// transaction pooler it does: each round, another client's transaction
// takes a server connection (PgBouncer hands out the one used last first),
// so that the next Do lands on a server connection that lacks the
// statements pgx prepared. Every failure is ErrMisconfigured, never
// unavailable or retryable, and leaves nothing committed.
func TestStatementCacheBehindPooler(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, defaultMode)
	one := testPool(ctx, t, pgx.QueryExecModeCacheStatement, 1)
	store, err := idem.New(idempg.New(one, idempg.WithSchema(b.schema)), &idem.Config{WaitTimeout: time.Second})
	require.NoError(t, err)
	check := idempg.New(testPool(ctx, t, pgx.QueryExecModeExec, 2), idempg.WithSchema(b.schema)).DB()

	const rounds = 8 // under the pooler's and the bundle pool's sizes
	var failed, succeeded int
	for range rounds {
		other, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = other.Rollback(context.WithoutCancel(ctx)) })
		_, err = other.Exec(ctx, `SELECT 1`)
		require.NoError(t, err)

		key := newKey()
		_, err = store.Do(ctx, "s", key, idem.NewFingerprint([]byte("x")), func(context.Context, pgx.Tx) (*idem.Response, error) {
			return &idem.Response{StatusCode: 201}, nil
		})
		_, getErr := check.Get(ctx, &idem.GetParams{Scope: "s", Key: key})
		if err == nil {
			succeeded++
			require.NoError(t, getErr)
			continue
		}
		failed++
		require.ErrorIs(t, err, idem.ErrMisconfigured)
		require.NotErrorIs(t, err, idem.ErrStoreUnavailable)
		require.NotErrorIs(t, err, idem.ErrRetryable)
		require.Contains(t, err.Error(), "PgBouncer", "the message names the cause and the fix")
		require.ErrorIs(t, getErr, idem.ErrNotFound, "a failed Do commits nothing")
		if testdb.PostgresPooler() {
			break
		}
	}
	if testdb.PostgresPooler() {
		require.Positive(t, failed, "through a transaction pooler the statement cache must be reported")
	} else {
		require.Equal(t, rounds, succeeded, "directly connected the statement cache works")
	}
}
