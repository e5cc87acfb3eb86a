package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/workload"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// sqliteStatements: the namespace is a database file.
var sqliteStatements = statements{
	snapshot: `CREATE TABLE idembench_seed AS SELECT * FROM idempotency_keys`,
	reset: []string{
		`DELETE FROM idempotency_keys`,
		`DELETE FROM order_lines`,
		`DELETE FROM orders`,
		`DELETE FROM ` + floorTable,
		`INSERT INTO idempotency_keys SELECT * FROM idembench_seed`,
		floorSeed(", key_digest"),
		`PRAGMA wal_checkpoint(TRUNCATE)`,
	},
	// A recursive CTE makes the rows inside SQLite; keys are random so
	// that they spread over the primary key like real ones. Times are
	// microseconds since the epoch.
	fill: `WITH RECURSIVE g(n) AS (SELECT ? UNION ALL SELECT n + 1 FROM g WHERE n < ?)
	INSERT INTO idempotency_keys (scope, idempotency_key, fingerprint, status, token, attempt,
		lease_expires_at, response_status, response_headers, response_body, created_at, updated_at,
		completed_at, expires_at)
	SELECT ? || printf('%02d', g.n % 100), lower(hex(randomblob(16))), t.fingerprint, t.status, t.token, t.attempt,
		t.lease_expires_at, t.response_status, t.response_headers, t.response_body, t.created_at, t.updated_at,
		t.completed_at, t.expires_at + ?
	FROM g, idempotency_keys AS t
	WHERE t.scope = 'idembench-template' AND t.idempotency_key = 'template'`,
	fillArgs: func(prefix string, from, to int64, shift time.Duration) []any {
		return []any{from, to, prefix, shift.Microseconds()}
	},
	truncateOrders: []string{`DELETE FROM order_lines`, `DELETE FROM orders`},
	countOrders:    `SELECT COUNT(*) FROM orders WHERE tenant = ?`,
	countCompleted: `SELECT COUNT(*) FROM idempotency_keys WHERE scope = ? AND status = 2`,
	deleteScope:    `DELETE FROM idempotency_keys WHERE scope LIKE ?`,
	analyze:        []string{`ANALYZE`, `PRAGMA wal_checkpoint(TRUNCATE)`},
	floorDone:      floorDoneWhere + ` AND key_digest IS NOT NULL`,
}

// newSQLiteBackend returns the SQLite backend; each namespace is a file
// <ns>.db in dir.
func newSQLiteBackend(dir string) *backend[*sql.Tx] {
	path := func(ns string) string { return filepath.Join(dir, ns+".db") }
	b := &backend[*sql.Tx]{
		name:    "sqlite",
		dialect: workload.SQLite,
		sql:     sqliteStatements,
		business: func(s workload.Shape) func(context.Context, *sql.Tx, string) error {
			return workload.SQLBusiness(s, workload.SQLite)
		},
		close: func() {},
		create: func(ctx context.Context, ns string) (bool, error) {
			if _, err := os.Stat(path(ns)); err == nil {
				return true, nil
			} else if !errors.Is(err, fs.ErrNotExist) {
				return false, err
			}
			db, err := idemsqlite.Open(path(ns))
			if err != nil {
				return false, err
			}
			defer db.Close()
			if err := idemsqlite.Migrate(ctx, db); err != nil {
				return false, fmt.Errorf("migrate: %w", err)
			}
			for _, q := range workload.Tables(workload.SQLite) {
				if _, err := db.ExecContext(ctx, q); err != nil {
					return false, err
				}
			}
			if err := sqliteFloorTable(ctx, db); err != nil {
				return false, fmt.Errorf("floor table: %w", err)
			}
			return false, workload.FillProducts(ctx, workload.SQLite, sqlAdmin{db}.exec)
		},
		drop: func(_ context.Context, ns string) error {
			var errs []error
			for _, suffix := range []string{"", "-wal", "-shm"} {
				if err := os.Remove(path(ns) + suffix); err != nil && !errors.Is(err, fs.ErrNotExist) {
					errs = append(errs, err)
				}
			}
			return errors.Join(errs...)
		},
	}
	b.version = func(ctx context.Context) (string, error) {
		db, err := idemsqlite.Open(filepath.Join(dir, "idembench_version.db"))
		if err != nil {
			return "", err
		}
		defer func() { _ = db.Close(); _ = b.drop(ctx, "idembench_version") }()
		var v string
		err = db.QueryRowContext(ctx, `SELECT sqlite_version()`).Scan(&v)
		return "SQLite " + v + " (modernc.org/sqlite)", err
	}
	// As in BenchmarkIdem and the lab: writes through one connection, so
	// writers queue in Go instead of polling SQLite's lock, and reads
	// through a pool of one connection per worker.
	// SQLite runs in the process: there is nothing to put behind the
	// latency proxy (via is ignored).
	b.open = func(ctx context.Context, ns string, conns int, _ string) (*pools[*sql.Tx], error) {
		var dbs []*sql.DB
		closeAll := func() {
			for _, db := range dbs {
				_ = db.Close()
			}
		}
		for _, n := range []int{1, conns, 1} {
			db, err := idemsqlite.Open(path(ns))
			if err == nil {
				err = warm(ctx, db, n)
			}
			if err != nil {
				closeAll()
				return nil, fmt.Errorf("sqlite: %w", err)
			}
			dbs = append(dbs, db)
		}
		store, err := idem.New(idemsqlite.New(dbs[0]), b.storeCfg)
		if err != nil {
			closeAll()
			return nil, err
		}
		readStore, err := idem.New(idemsqlite.New(dbs[1]), b.storeCfg)
		if err != nil {
			closeAll()
			return nil, err
		}
		return &pools[*sql.Tx]{
			store: store, readStore: readStore, admin: sqlAdmin{dbs[2]}, pkSelect: sqlPKSelect(dbs[1]), storePKSelect: sqlPKSelect(dbs[0]),
			openFloor: func(ctx context.Context, _ bool) (*floorRunner[*sql.Tx], error) {
				return sqliteFloor(ctx, store, dbs[0])
			},
			close: closeAll,
		}, nil
	}
	return b
}
