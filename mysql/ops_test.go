package mysql_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/digest"
	idemmysql "github.com/idemstore/idem/mysql"
)

// Check names the missing parseTime=true, the problem that otherwise shows
// only as 503s on the first requests.
func TestCheckParseTime(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, newPlain, true)
	require.NoError(t, b.store(t, nil).Check(ctx))

	s := testServer(t)
	cfg := s.config(b.name, true)
	cfg.ParseTime = false
	db := openDB(t, cfg)
	store, err := idem.New(idemmysql.New(db), nil)
	require.NoError(t, err)
	err = store.Check(ctx)
	require.ErrorIs(t, err, idem.ErrNotReady)
	var ce *idem.CheckError
	require.True(t, errors.As(err, &ce))
	require.Len(t, ce.Problems, 1)
	require.Contains(t, ce.Problems[0].What, "parseTime=true")
	require.Contains(t, ce.Problems[0].Fix, "add parseTime=true")
}

// The digest look-up reads idempotency_keys_digest_idx, not the table.
func TestOpsDigestPlan(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, newPlain, true)
	d := digest.Sum("acme POST /orders", "k")
	plan := explain(ctx, t, b.db, idemmysql.OpsFindDigest, d[:])
	require.Len(t, plan, 1)
	require.Equal(t, "idempotency_keys_digest_idx", plan[0]["key"], "plan: %v", plan)
}
