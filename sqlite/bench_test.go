package sqlite_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/benchkit"
	"github.com/idemstore/idem/internal/codec"
	"github.com/idemstore/idem/internal/workload"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// BenchmarkIdem measures idem against the bare business transaction on a
// SQLite file of its own, opened with idemsqlite.Open. See
// docs/performance.md.
//
// As in the lab runs of issue 5, writes go through a pool of one connection
// (concurrent writers queue in Go rather than poll SQLite's lock), and
// replay, mismatch and the primary-key read through a second pool with one
// connection per goroutine.
func BenchmarkIdem(b *testing.B) {
	ctx := context.Background()
	path := filepath.Join(b.TempDir(), "bench.db")
	admin := benchSQLiteDB(b, path, 1)
	if err := idemsqlite.Migrate(ctx, admin); err != nil {
		b.Fatal(err)
	}
	for _, q := range workload.Tables(workload.SQLite) {
		if _, err := admin.ExecContext(ctx, q); err != nil {
			b.Fatal(err)
		}
	}
	if err := workload.FillProducts(ctx, workload.SQLite, func(ctx context.Context, q string, args ...any) error {
		_, err := admin.ExecContext(ctx, q, args...)
		return err
	}); err != nil {
		b.Fatal(err)
	}
	header, err := codec.EncodeHeader(benchkit.Response.Header)
	if err != nil {
		b.Fatal(err)
	}

	benchkit.Run(b, benchkit.Target[*sql.Tx]{
		Open: func(b *testing.B, conc int) *benchkit.Pools[*sql.Tx] {
			b.Helper()
			writes := benchSQLiteDB(b, path, 1)
			store, err := idem.New(idemsqlite.New(writes), nil)
			if err != nil {
				b.Fatal(err)
			}
			// The floor runs prepared statements, as idem's transactions do.
			floorRead, err := writes.PrepareContext(ctx, benchSQLiteSelect)
			if err != nil {
				b.Fatal(err)
			}
			floorInsert, err := writes.PrepareContext(ctx, benchSQLiteFloorInsert)
			if err != nil {
				b.Fatal(err)
			}
			reads := benchSQLiteDB(b, path, conc)
			readStore, err := idem.New(idemsqlite.New(reads), nil)
			if err != nil {
				b.Fatal(err)
			}
			return &benchkit.Pools[*sql.Tx]{
				Store:     store,
				ReadStore: readStore,
				PKSelect: func(ctx context.Context, scope, key string) error {
					var (
						status       int16
						fp, hdr, bdy []byte
						code         int32
					)
					return reads.QueryRowContext(ctx, benchSQLiteSelect, scope, key).Scan(&status, &fp, &code, &hdr, &bdy)
				},
				Floor: func(ctx context.Context, business func(context.Context, *sql.Tx, string) error, scope, key string) error {
					return benchkit.SQLFloor(ctx, writes, business, header, floorRead, floorInsert, "", "", scope, key, func() []any {
						now := time.Now().UnixMicro()
						return []any{now, benchkit.Response.StatusCode, header, benchkit.Response.Body, now, now, now, now + 86_400_000_000}
					})
				},
			}
		},
		Business: func(s workload.Shape) func(context.Context, *sql.Tx, string) error {
			return workload.SQLBusiness(s, workload.SQLite)
		},
		Counts: func(ctx context.Context) (c workload.Counts, err error) {
			err = admin.QueryRowContext(ctx, workload.CountsQuery(workload.SQLite)).Scan(&c.Orders, &c.Lines, &c.Stock, &c.Completed, &c.Pending)
			return c, err
		},
		Snapshot: func(ctx context.Context) error {
			_, err := admin.ExecContext(ctx, `CREATE TABLE bench_seed AS SELECT * FROM idempotency_keys`)
			return err
		},
		Reset: func(ctx context.Context) error {
			for _, q := range []string{
				`DELETE FROM idempotency_keys`,
				`DELETE FROM order_lines`,
				`DELETE FROM orders`,
				`INSERT INTO idempotency_keys SELECT * FROM bench_seed`,
				`PRAGMA wal_checkpoint(TRUNCATE)`,
			} {
				if _, err := admin.ExecContext(ctx, q); err != nil {
					return err
				}
			}
			return nil
		},
	})
}

// benchSQLiteSelect is the replay baseline: what a replay needs to answer,
// read by primary key.
const benchSQLiteSelect = `SELECT status, fingerprint, response_status, response_headers, response_body
FROM idempotency_keys WHERE scope = ? AND idempotency_key = ?`

// benchSQLiteFloorInsert writes a finished record in one plain INSERT: the
// floor's completion.
const benchSQLiteFloorInsert = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at
) VALUES (?, ?, ?, 2, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?)`

// benchSQLiteDB opens a pool of size conns on path, closed when b ends.
func benchSQLiteDB(b *testing.B, path string, conns int) *sql.DB {
	b.Helper()
	db, err := idemsqlite.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	b.Cleanup(func() { _ = db.Close() })
	return db
}
