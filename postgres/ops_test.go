package postgres_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/digest"
	idempg "github.com/idemstore/idem/postgres"
)

// The digest look-up's expression is the index's (migration 00003), in a
// schema named by WithSchema: with sequential scans priced out, the
// planner reads idempotency_keys_digest_idx, which it could not if the
// expressions differed.
func TestOpsDigestPlan(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	schema := createSchema(ctx, t)
	pool := testPool(ctx, t, defaultMode, 2)
	require.NoError(t, idempg.Migrate(ctx, pool, idempg.WithSchema(schema)))
	d := idempg.New(pool, idempg.WithSchema(schema))
	store, err := idem.New(d, nil)
	require.NoError(t, err)
	require.NoError(t, store.Check(ctx))

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SET LOCAL enable_seqscan = off`)
	require.NoError(t, err)
	sum := digest.Sum("acme POST /orders", "k")
	var plan []byte
	require.NoError(t, tx.QueryRow(ctx, `EXPLAIN (FORMAT JSON) `+idempg.OpsFindDigestSQL(d), sum[:]).Scan(&plan))
	require.Contains(t, indexConds(t, plan), "idempotency_keys_digest_idx", "plan: %s", plan)
}
