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

// BenchmarkDeleteExpired measures the reaper's delete alone, with no claim
// load: 100 000 expired records (random keys, as in idembench's reaper
// scenario) beside 20 000 live ones, deleted by the pool's DeleteExpired in
// batches of 1000 (what a Reaper with its default BatchSize runs, the pause
// after each full batch included), by the same statement in a loop with no
// pause, and, as the floor, by one unbounded DELETE that the reaper never
// runs. It reports rows/s. The pause halves the rate of the loop; the gap
// between the loop and the floor is the cost of committing in batches:
// each batch of 1000 rows writes about 800 pages to the WAL (its rows are
// spread over the pages of the primary key's index), and every batch or
// two a checkpoint copies them into the database.
func BenchmarkDeleteExpired(b *testing.B) {
	const expired, live = 100_000, 20_000
	ctx := context.Background()
	now := time.Now()
	for _, c := range []struct {
		name string
		run  func(ctx context.Context, d *idemsqlite.Dialect, db *sql.DB) (int, error)
	}{
		{"Batches1000", func(ctx context.Context, d *idemsqlite.Dialect, _ *sql.DB) (int, error) {
			total := 0
			for {
				n, err := d.DB().DeleteExpired(ctx, &idem.DeleteExpiredParams{Limit: 1000, Now: &now})
				total += n
				if err != nil || n < 1000 {
					return total, err
				}
			}
		}},
		{"Batches100NoPause", batchesNoPause(now, 100)},
		{"Batches250NoPause", batchesNoPause(now, 250)},
		{"Batches1000NoPause", batchesNoPause(now, 1000)},
		{"OneStatement", func(ctx context.Context, _ *idemsqlite.Dialect, db *sql.DB) (int, error) {
			res, err := db.ExecContext(ctx, `DELETE FROM idempotency_keys WHERE expires_at <= ?`, now.UnixMicro())
			if err != nil {
				return 0, err
			}
			n, err := res.RowsAffected()
			return int(n), err
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			var rows int
			var elapsed time.Duration
			for range b.N {
				b.StopTimer()
				db := benchSQLiteDB(b, filepath.Join(b.TempDir(), "reap.db"), 1)
				if err := idemsqlite.Migrate(ctx, db); err != nil {
					b.Fatal(err)
				}
				for _, f := range []struct {
					prefix string
					n      int
					shift  time.Duration
				}{{"exp-", expired, -48 * time.Hour}, {"live-", live, 48 * time.Hour}} {
					if _, err := db.ExecContext(ctx, benchFillExpired, f.n, f.prefix, now.UnixMicro(), now.Add(f.shift).UnixMicro()); err != nil {
						b.Fatal(err)
					}
				}
				if _, err := db.ExecContext(ctx, `PRAGMA wal_checkpoint(TRUNCATE)`); err != nil {
					b.Fatal(err)
				}
				d := idemsqlite.New(db)
				b.StartTimer()
				start := time.Now()
				n, err := c.run(ctx, d, db)
				elapsed += time.Since(start)
				if err != nil {
					b.Fatal(err)
				}
				if n != expired {
					b.Fatalf("deleted %d rows, want %d", n, expired)
				}
				rows += n
			}
			b.ReportMetric(float64(rows)/elapsed.Seconds(), "rows/s")
		})
	}
}

// batchesNoPause deletes the expired records in batches of size, back to
// back: what the statement costs per row at that size, without the
// dialect's yield to other writers.
func batchesNoPause(now time.Time, size int) func(context.Context, *idemsqlite.Dialect, *sql.DB) (int, error) {
	return func(ctx context.Context, _ *idemsqlite.Dialect, db *sql.DB) (int, error) {
		total := 0
		for {
			res, err := db.ExecContext(ctx, benchExpiredDelete, now.UnixMicro(), size)
			if err != nil {
				return total, err
			}
			n, err := res.RowsAffected()
			total += int(n)
			if err != nil || n < int64(size) {
				return total, err
			}
		}
	}
}

// benchExpiredDelete is the dialect's delete of expired records (queries.go).
const benchExpiredDelete = `DELETE FROM idempotency_keys
WHERE rowid IN (
	SELECT rowid FROM idempotency_keys
	WHERE expires_at <= ?
	ORDER BY expires_at
	LIMIT ?
)`

// benchFillExpired inserts ? completed records of scope prefix||NN with
// random keys, all expiring at the last parameter, in one statement.
const benchFillExpired = `WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < ?)
INSERT INTO idempotency_keys (scope, idempotency_key, fingerprint, status, token, attempt,
	lease_expires_at, response_status, response_headers, response_body, created_at, updated_at,
	completed_at, expires_at)
SELECT ?2 || printf('%02d', g.n % 100), lower(hex(randomblob(16))), randomblob(32), 2, 1, 1,
	?3, 200, randomblob(40), randomblob(60), ?3, ?3, ?3, ?4
FROM g`
