package idemhttp_test

import (
	"net/http"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
	"github.com/idemstore/idem/internal/testdb"
	idempg "github.com/idemstore/idem/postgres"
)

// TestStoreMisconfigured: a store that cannot work as configured
// (idem.ErrMisconfigured, here an invalid postgres.WithSchema on a real
// server) is answered 500 idempotency_store_misconfigured, not 503: retrying
// does not help. The handler does not run, and the error's message, which
// names the fix, is logged at error level, in both modes.
func TestStoreMisconfigured(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(t.Context(), testdb.PostgresURL(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	for _, mode := range []idemhttp.Mode{idemhttp.Transactional, idemhttp.Leased} {
		b := setup(t, newPGHarness(t), options[pgx.Tx]{
			cfg: &idemhttp.Config{Mode: mode},
			wrapDialect: func(idem.Dialect[pgx.Tx]) idem.Dialect[pgx.Tx] {
				return idempg.New(pool, idempg.WithSchema("Not-A-Schema"))
			},
		})
		r := b.post(t, newKey(), orderBody)
		require.Equal(t, http.StatusInternalServerError, r.status, "mode %d: %s", mode, r.body)
		require.Equal(t, idemhttp.CodeStoreMisconfigured, r.code(t))
		require.Empty(t, r.header.Get("Retry-After"))
		require.Zero(t, b.calls.Load(), "the handler did not run")
		recs := b.logs.records(t, "idemhttp: request")
		require.Len(t, recs, 1)
		require.Equal(t, "ERROR", recs[0]["level"])
		require.Equal(t, "store_misconfigured", recs[0]["outcome"])
		require.Contains(t, recs[0]["error"], `WithSchema("Not-A-Schema")`, "the fix reaches the operator")
		require.Contains(t, recs[0]["error"], idem.ErrMisconfigured.Error())
	}
}
