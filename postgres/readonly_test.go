package postgres_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
	idempg "github.com/idemstore/idem/postgres"
)

// TestReadOnlyServer: a server that refuses writes answers 25006
// (read_only_sql_transaction): a hot standby, as during a failover before
// the promotion when the client reaches the servers through a name or
// address that has not moved yet (internal/failovertest); here the same
// answer comes from default_transaction_read_only. It must reach callers as
// ErrStoreUnavailable, to retry later, with nothing stored.
//
// Not through a transaction pooler, which refuses the startup parameter.
func TestReadOnlyServer(t *testing.T) {
	t.Parallel()
	// Not through a transaction pooler (.ci/pgbouncer.sh leaves it out): PgBouncer refuses the default_transaction_read_only startup parameter.
	ctx, b := setup(t, defaultMode)
	cfg, err := pgxpool.ParseConfig(testdb.PostgresURL(t))
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = defaultMode
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	dialect := idempg.New(pool, idempg.WithSchema(b.schema))
	store, err := idem.New(dialect, &idem.Config{})
	require.NoError(t, err)

	t.Run("Do", func(t *testing.T) {
		_, err := store.Do(ctx, "orders/create", newKey(), idem.NewFingerprint([]byte("request")),
			func(context.Context, pgx.Tx) (*idem.Response, error) {
				return &idem.Response{StatusCode: 201, Body: []byte("created")}, nil
			})
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		requirePgCode(t, err, "25006")
	})
	t.Run("Claim", func(t *testing.T) {
		_, err := dialect.DB().Claim(ctx, claimParams(newKey()))
		require.ErrorIs(t, err, idem.ErrStoreUnavailable)
		requirePgCode(t, err, "25006")
	})
	var n int
	require.NoError(t, b.pool.QueryRow(ctx, b.q(`SELECT count(*) FROM idempotency_keys`)).Scan(&n))
	require.Zero(t, n, "a read-only server stored nothing")
}
