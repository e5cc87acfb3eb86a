package sqlite_test

import (
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/digest"
	"github.com/idemstore/idem/migrations"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

func checkProblems(t *testing.T, db *sql.DB) []string {
	t.Helper()
	store, err := idem.New(idemsqlite.New(db), nil)
	require.NoError(t, err)
	err = store.Check(t.Context())
	if err == nil {
		return nil
	}
	var ce *idem.CheckError
	require.True(t, errors.As(err, &ce), "%v", err)
	require.ErrorIs(t, err, idem.ErrNotReady)
	var out []string
	for _, p := range ce.Problems {
		out = append(out, p.What)
	}
	return out
}

// Check reports what it finds and changes nothing; Migrate fixes the schema
// and back-fills the digests of rows written before migration 00002.
func TestCheckAndBackfill(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	path := filepath.Join(t.TempDir(), "idem.db")

	// A plain DSN: rollback journal, no busy timeout, no table.
	plain, err := sql.Open("sqlite", path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = plain.Close() })
	got := checkProblems(t, plain)
	require.Len(t, got, 3, "%q", got)
	require.Contains(t, got[0], "journal_mode")
	require.Contains(t, got[1], "busy_timeout")
	require.Contains(t, got[2], "idempotency_keys does not exist")
	require.Len(t, checkProblems(t, plain), 3, "Check changed nothing")

	db, err := idemsqlite.Open(path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	p, err := migrations.NewProvider(migrations.SQLite, db)
	require.NoError(t, err)
	_, err = p.UpTo(ctx, 1)
	require.NoError(t, err)
	got = checkProblems(t, db)
	require.Equal(t, []string{fmt.Sprintf("schema version is 1, this idem needs %d", migrations.SchemaVersion)}, got)

	// Rows of the version 1 schema, as an older idem wrote them.
	for _, k := range []string{"a", "b", "c"} {
		_, err := db.ExecContext(ctx, `INSERT INTO idempotency_keys (scope, idempotency_key, fingerprint, status, token, attempt,
			lease_expires_at, created_at, updated_at, expires_at) VALUES ('old', ?, zeroblob(32), 1, 1, 1, 0, 0, 0, 9000000000000000)`, k)
		require.NoError(t, err)
	}
	_, err = p.UpTo(ctx, migrations.SchemaVersion)
	require.NoError(t, err)
	require.Empty(t, checkProblems(t, db))
	store, err := idem.New(idemsqlite.New(db), nil)
	require.NoError(t, err)
	recs, err := store.LookupDigest(ctx, idem.KeyDigest("old", "b"))
	require.NoError(t, err, "a row without a stored digest is found before the back-fill")
	require.Len(t, recs, 1)
	require.Equal(t, "b", recs[0].Key)

	require.NoError(t, idemsqlite.Migrate(ctx, db))
	var missing int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM idempotency_keys WHERE key_digest IS NULL`).Scan(&missing))
	require.Zero(t, missing, "Migrate back-filled every digest")
	var stored []byte
	require.NoError(t, db.QueryRowContext(ctx, `SELECT key_digest FROM idempotency_keys WHERE idempotency_key = 'c'`).Scan(&stored))
	want := digest.Sum("old", "c")
	require.Equal(t, want[:], stored)
}

// The digest look-up reads idempotency_keys_digest_idx twice (the digest,
// the rows still without one), never the table.
func TestOpsDigestPlan(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemsqlite.Migrate(ctx, db))
	d := digest.Sum("s", "k")
	rows, err := db.QueryContext(ctx, `EXPLAIN QUERY PLAN `+idemsqlite.OpsFindDigest, d[:])
	require.NoError(t, err)
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var id, parent, unused int
		var detail string
		require.NoError(t, rows.Scan(&id, &parent, &unused, &detail))
		plan = append(plan, detail)
	}
	require.NoError(t, rows.Err())
	joined := strings.Join(plan, "\n")
	require.Contains(t, joined, "USING INDEX idempotency_keys_digest_idx (key_digest=?)")
	require.NotContains(t, joined, "SCAN idempotency_keys", "plan:\n%s", joined)
}
