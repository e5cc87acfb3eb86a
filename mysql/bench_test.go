package mysql_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/benchkit"
	"github.com/idemstore/idem/internal/codec"
	"github.com/idemstore/idem/internal/testdb"
	"github.com/idemstore/idem/internal/workload"
	idemmysql "github.com/idemstore/idem/mysql"
)

// BenchmarkIdem measures idem against the bare business transaction on the
// MySQL or MariaDB server of IDEM_TEST_MYSQL_DSN (skipped when unreachable),
// in a database of its own, with interpolateParams=true. See
// docs/performance.md.
func BenchmarkIdem(b *testing.B) {
	ctx := context.Background()
	dsn := testdb.MySQLDSN(b, func(dsn string) (string, error) {
		cfg, err := gomysql.ParseDSN(dsn)
		if err != nil {
			return "", err
		}
		return cfg.Addr, nil
	})
	base, err := gomysql.ParseDSN(dsn)
	if err != nil {
		b.Fatal(err)
	}
	name := testdb.Name()

	server := benchMySQLDB(b, base, "", 2)
	if _, err := server.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if _, err := server.ExecContext(context.Background(), "DROP DATABASE IF EXISTS "+name); err != nil {
			b.Error(err)
		}
	})
	// The admin connections run without foreign key checks, so that Reset
	// can TRUNCATE orders, which order_lines references.
	adminCfg := base.Clone()
	adminCfg.Params = map[string]string{"foreign_key_checks": "0"}
	for k, v := range base.Params {
		adminCfg.Params[k] = v
	}
	admin := benchMySQLDB(b, adminCfg, name, 4)
	if err := idemmysql.Migrate(ctx, admin); err != nil {
		b.Fatal(err)
	}
	for _, q := range workload.Tables(workload.MySQL) {
		if _, err := admin.ExecContext(ctx, q); err != nil {
			b.Fatal(err)
		}
	}
	if err := workload.FillProducts(ctx, workload.MySQL, func(ctx context.Context, q string, args ...any) error {
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
			db := benchMySQLDB(b, base, name, conc)
			store, err := idem.New(idemmysql.New(db), nil)
			if err != nil {
				b.Fatal(err)
			}
			return &benchkit.Pools[*sql.Tx]{
				Store: store,
				PKSelect: func(ctx context.Context, scope, key string) error {
					var (
						status       int16
						fp, hdr, bdy []byte
						code         int32
					)
					return db.QueryRowContext(ctx, benchMySQLSelect, scope, key).Scan(&status, &fp, &code, &hdr, &bdy)
				},
				Floor: func(ctx context.Context, business func(context.Context, *sql.Tx, string) error, scope, key string) error {
					return benchkit.SQLFloor(ctx, db, business, header, nil, nil, benchMySQLSelect, benchMySQLFloorInsert, scope, key, nil)
				},
			}
		},
		Business: func(s workload.Shape) func(context.Context, *sql.Tx, string) error {
			return workload.SQLBusiness(s, workload.MySQL)
		},
		Counts: func(ctx context.Context) (c workload.Counts, err error) {
			err = admin.QueryRowContext(ctx, workload.CountsQuery(workload.MySQL)).Scan(&c.Orders, &c.Lines, &c.Stock, &c.Completed, &c.Pending)
			return c, err
		},
		Snapshot: func(ctx context.Context) error {
			_, err := admin.ExecContext(ctx, `CREATE TABLE bench_seed AS SELECT `+benchSeedColumns+` FROM idempotency_keys`)
			return err
		},
		Reset: func(ctx context.Context) error {
			for _, q := range []string{
				`TRUNCATE TABLE idempotency_keys`,
				`TRUNCATE TABLE order_lines`,
				`TRUNCATE TABLE orders`,
				`INSERT INTO idempotency_keys (` + benchSeedColumns + `) SELECT * FROM bench_seed`,
				`ANALYZE TABLE idempotency_keys, orders, order_lines, products`,
			} {
				if _, err := admin.ExecContext(ctx, q); err != nil {
					return err
				}
			}
			return nil
		},
	})
}

// benchMySQLSelect is the replay baseline: what a replay needs to answer,
// read by primary key.
const benchMySQLSelect = `SELECT status, fingerprint, response_status, response_headers, response_body
FROM idempotency_keys WHERE scope = ? AND idempotency_key = ?`

// benchMySQLFloorInsert writes a finished record in one plain INSERT: the
// floor's completion.
const benchMySQLFloorInsert = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at
) VALUES (?, ?, ?, 2, ?, 1, UTC_TIMESTAMP(6), ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6),
	UTC_TIMESTAMP(6) + INTERVAL 1 DAY)`

// benchMySQLDB opens a pool of size conns on database name (none when
// empty) with the settings idem needs and interpolateParams=true, which
// saves a prepare round trip per statement. It is closed when b ends.
func benchMySQLDB(b *testing.B, base *gomysql.Config, name string, conns int) *sql.DB {
	b.Helper()
	cfg := base.Clone()
	cfg.DBName = name
	cfg.ParseTime = true
	cfg.Loc = time.UTC
	cfg.InterpolateParams = true
	// Through NewConnector, as docs/dialects.md recommends: Do's BEGIN
	// travels with its claim, its COMMIT with its completion.
	conn, err := idemmysql.NewConnector(cfg)
	if err != nil {
		b.Fatal(err)
	}
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	b.Cleanup(func() { _ = db.Close() })
	return db
}

// benchSeedColumns are the stored columns, without the virtual key_digest
// (migration 00002), which an INSERT may not set.
const benchSeedColumns = `scope, idempotency_key, fingerprint, status, token, attempt,
	lease_expires_at, response_status, response_headers, response_body,
	created_at, updated_at, completed_at, expires_at`
