package sqlite_test

import (
	"context"
	"database/sql"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/conformance"
	"github.com/idemstore/idem/migrations"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

func TestConformance(t *testing.T) {
	t.Parallel()
	conformance.Run(t, harness{})
}

// TestConformanceChild is the lease holder the process cases of the suite
// start and kill; it does nothing in a normal run.
func TestConformanceChild(t *testing.T) { conformance.RunChild(t, reopen) }

// childPathEnv names the namespace's database file in a child process.
const childPathEnv = "IDEM_TEST_SQLITE_CHILD_PATH"

// reopen opens, in a child process, the file Namespace.ChildEnv names.
func reopen(_ context.Context, t *testing.T) idem.Dialect[*sql.Tx] {
	t.Helper()
	path := os.Getenv(childPathEnv)
	require.NotEmpty(t, path, childPathEnv)
	db, err := idemsqlite.Open(path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return idemsqlite.New(db)
}

// harness gives every case a database file of its own in t.TempDir().
type harness struct{}

var _ conformance.Harness[*sql.Tx] = harness{}

func (harness) Open(ctx context.Context, t *testing.T) *conformance.Namespace[*sql.Tx] {
	t.Helper()
	path := filepath.Join(t.TempDir(), "idem.db")
	db := openDBAt(ctx, t, path)
	closeDB := func() { _ = db.Close() } // idempotent
	return &conformance.Namespace[*sql.Tx]{
		Dialect: idemsqlite.New(db),
		InsertOrder: func(ctx context.Context, tx *sql.Tx, ref string) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO orders (ref) VALUES (?)`, ref)
			return err
		},
		CountOrders: func(ctx context.Context, ref string) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM orders WHERE ref = ?`, ref).Scan(&n)
			return n, err
		},
		CountRecords: func(ctx context.Context) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&n)
			return n, err
		},
		SeedExpired: func(ctx context.Context, n int, expiresAt time.Time) error {
			exp := expiresAt.UnixMicro()
			done := expiresAt.Add(-time.Hour).UnixMicro()
			_, err := db.ExecContext(ctx, seedExpired, n, done, done, done, done, exp)
			return err
		},
		Migrate:   func(ctx context.Context) error { return idemsqlite.Migrate(ctx, db) },
		Unmigrate: func(ctx context.Context) error { return conformance.MigrateDown(ctx, migrations.SQLite, db) },
		CorruptResponse: func(ctx context.Context, scope, key string, status *int, headers []byte) error {
			_, err := db.ExecContext(ctx, `UPDATE idempotency_keys SET response_status = ?, response_headers = ?
				WHERE scope = ? AND idempotency_key = ?`, status, headers, scope, key)
			return err
		},
		BodyTable: func(cfg *idem.TableBodyStoreConfig) idem.BodyStore {
			bs, err := idemsqlite.NewTableBodyStore(db, cfg)
			require.NoError(t, err)
			return bs
		},
		BodyRows: func(ctx context.Context) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM idempotency_bodies`).Scan(&n)
			return n, err
		},
		SetBodyChunk: func(ctx context.Context, address string, seq int64, data []byte) error {
			return conformance.SetBodyChunkSQL(ctx, db, address, seq, data)
		},
		DropBodyTable: func(ctx context.Context) error {
			_, err := db.ExecContext(ctx, `DROP TABLE idempotency_bodies`)
			return err
		},
		Close:    closeDB,
		ChildEnv: []string{childPathEnv + "=" + path},
	}
}

func (harness) Unreachable(_ context.Context, t *testing.T) idem.Dialect[*sql.Tx] {
	t.Helper()
	// sql.Open is lazy: the missing directory fails the first use with
	// SQLITE_CANTOPEN.
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "missing", "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return idemsqlite.New(db)
}

func (harness) Features() conformance.Features {
	return conformance.Features{
		TimePrecision:   time.Microsecond,
		SingleWriter:    true,
		WaitGranularity: time.Millisecond,
		DeferredClaims:  true,
	}
}

// seedExpired inserts succeeded records "seed"/"seed-0" ... "seed-<n-1>",
// completed an hour before their retention deadline, in one statement: a
// recursive CTE counts from 0 to n-1.
const seedExpired = `WITH RECURSIVE seq(i) AS (
	SELECT 0 WHERE ?1 > 0
	UNION ALL
	SELECT i + 1 FROM seq WHERE i + 1 < ?1
)
INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at
)
SELECT 'seed', 'seed-' || i, zeroblob(32), 2, 1, 1, ?2, 200, NULL, x'', ?3, ?4, ?5, ?6
FROM seq`

// openDB opens a new migrated database file with the test business table,
// closed when t ends.
func openDB(ctx context.Context, t *testing.T) *sql.DB {
	t.Helper()
	return openDBAt(ctx, t, filepath.Join(t.TempDir(), "idem.db"))
}

// openDBAt is openDB with the file at path.
func openDBAt(ctx context.Context, t *testing.T, path string) *sql.DB {
	t.Helper()
	db, err := idemsqlite.Open(path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemsqlite.Migrate(ctx, db))
	_, err = db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY, ref TEXT NOT NULL)`)
	require.NoError(t, err)
	return db
}

// TestLargeBody is not parallel: it measures the process's heap.
func TestLargeBody(t *testing.T) { conformance.RunLargeBody(t, harness{}) }
