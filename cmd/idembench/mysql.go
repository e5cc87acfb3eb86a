package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/workload"
	idemmysql "github.com/idemstore/idem/mysql"
)

// mysqlRecordColumns are the stored columns of idempotency_keys (all but
// the generated key_digest).
const mysqlRecordColumns = `scope, idempotency_key, fingerprint, status, token, attempt,
	lease_expires_at, response_status, response_headers, response_body, created_at, updated_at,
	completed_at, expires_at`

// mysqlStatements: the namespace is a database.
var mysqlStatements = statements{
	// The columns by name: key_digest is a generated column, which an
	// INSERT may not write.
	snapshot: `CREATE TABLE idembench_seed AS SELECT ` + mysqlRecordColumns + ` FROM idempotency_keys`,
	// The admin connections run with foreign_key_checks=0 (mysqlDB), so
	// that orders, which order_lines references, can be truncated.
	reset: []string{
		`TRUNCATE TABLE idempotency_keys`,
		`TRUNCATE TABLE order_lines`,
		`TRUNCATE TABLE orders`,
		`TRUNCATE TABLE ` + floorTable,
		`TRUNCATE TABLE ` + floorResponsesTable,
		`TRUNCATE TABLE ` + floorRespTable,
		`INSERT INTO idempotency_keys (` + mysqlRecordColumns + `) SELECT ` + mysqlRecordColumns + ` FROM idembench_seed`,
		floorSeed(""),
		`ANALYZE TABLE idempotency_keys, orders, order_lines, products, ` + floorTable,
	},
	truncateOrders: []string{`TRUNCATE TABLE order_lines`, `TRUNCATE TABLE orders`},
	// The template is copied into a table of its own first: an INSERT
	// that selects from its own table goes through an internal temporary
	// table, on disk (tmpdir) at 200 000 rows, which failed in a run here.
	fillPrep: []string{`CREATE TABLE IF NOT EXISTS idembench_template AS
		SELECT * FROM idempotency_keys WHERE scope = 'idembench-template' AND idempotency_key = 'template'`},
	// MariaDB's SEQUENCE engine makes the rows in the server; a range on
	// its seq column is read as an index range, not a scan. MySQL has no
	// such engine: prefill and reaper are MariaDB-only. Keys increase with
	// seq, so InnoDB appends to 100 places of its clustered index instead
	// of splitting pages at random: several times faster to fill than MD5
	// keys, and the table the claims meet is the same size.
	fill: `INSERT INTO idempotency_keys (scope, idempotency_key, fingerprint, status, token, attempt,
		lease_expires_at, response_status, response_headers, response_body, created_at, updated_at,
		completed_at, expires_at)
	SELECT CONCAT(?, LPAD(s.seq % 100, 2, '0')), LPAD(HEX(s.seq), 32, '0'), t.fingerprint, t.status, t.token, t.attempt,
		t.lease_expires_at, t.response_status, t.response_headers, t.response_body, t.created_at, t.updated_at,
		t.completed_at, t.expires_at + INTERVAL ? SECOND
	FROM seq_1_to_100000000000 AS s, idembench_template AS t
	WHERE s.seq BETWEEN ? AND ?`,
	fillArgs: func(prefix string, from, to int64, shift time.Duration) []any {
		return []any{prefix, int64(shift.Seconds()), from, to}
	},
	countOrders:    `SELECT COUNT(*) FROM orders WHERE tenant = ?`,
	countCompleted: `SELECT COUNT(*) FROM idempotency_keys WHERE scope = ? AND status = 2`,
	deleteScope:    `DELETE FROM idempotency_keys WHERE scope LIKE ?`,
	analyze:        []string{`ANALYZE TABLE idempotency_keys`},
	floorDone:      floorDoneWhere + ` AND key_digest IS NOT NULL`,
}

// newMySQLBackend returns the MySQL/MariaDB backend on the server of dsn;
// each namespace is a database.
func newMySQLBackend(ctx context.Context, dsn string) (*backend[*sql.Tx], error) {
	base, err := gomysql.ParseDSN(dsn)
	if err != nil {
		return nil, fmt.Errorf("mysql: %w", err)
	}
	server, err := mysqlDB(ctx, base, "", 2, "", mysqlAdmin)
	if err != nil {
		return nil, err
	}
	b := &backend[*sql.Tx]{
		name:       "mysql",
		dialect:    workload.MySQL,
		sql:        mysqlStatements,
		serverAddr: base.Addr,
		business: func(s workload.Shape) func(context.Context, *sql.Tx, string) error {
			return workload.SQLBusiness(s, workload.MySQL)
		},
		close: func() { _ = server.Close() },
		version: func(ctx context.Context) (string, error) {
			var v string
			err := server.QueryRowContext(ctx, `SELECT VERSION()`).Scan(&v)
			return "MySQL/MariaDB " + v, err
		},
		create: func(ctx context.Context, ns string) (bool, error) {
			// Names are made by the tool, never by user input;
			// identifiers cannot be parameters.
			_, err := server.ExecContext(ctx, "CREATE DATABASE "+ns)
			var myErr *gomysql.MySQLError
			if errors.As(err, &myErr) && myErr.Number == 1007 { // database exists
				return true, nil
			}
			if err != nil {
				return false, err
			}
			// Migrate holds its lock on one connection and migrates on
			// another: a pool of one would wait for itself forever.
			db, err := mysqlDB(ctx, base, ns, 2, "", mysqlAdmin)
			if err != nil {
				return false, err
			}
			defer db.Close()
			if err := idemmysql.Migrate(ctx, db); err != nil {
				return false, fmt.Errorf("migrate: %w", err)
			}
			for _, q := range append(workload.Tables(workload.MySQL), mysqlFloorTable, mysqlFloorResponsesTable, mysqlFloorRespTable) {
				if _, err := db.ExecContext(ctx, q); err != nil {
					return false, err
				}
			}
			return false, workload.FillProducts(ctx, workload.MySQL, sqlAdmin{db}.exec)
		},
		drop: func(ctx context.Context, ns string) error {
			_, err := server.ExecContext(ctx, "DROP DATABASE IF EXISTS "+ns)
			return err
		},
	}
	b.open = func(ctx context.Context, ns string, conns int, via string) (*pools[*sql.Tx], error) {
		db, err := mysqlDB(ctx, base, ns, conns, via, mysqlMeasured)
		if err != nil {
			return nil, err
		}
		adm, err := mysqlDB(ctx, base, ns, 1, "", mysqlAdmin)
		if err != nil {
			_ = db.Close()
			return nil, err
		}
		store, err := idem.New(idemmysql.New(db), b.storeCfg)
		if err != nil {
			_ = db.Close()
			_ = adm.Close()
			return nil, err
		}
		optStore, err := idem.New(idemmysql.New(db, idemmysql.WithOptimisticDo()), b.storeCfg)
		if err != nil {
			_ = db.Close()
			_ = adm.Close()
			return nil, err
		}
		return &pools[*sql.Tx]{
			store: store, readStore: store, optStore: optStore, floorLock: true, admin: sqlAdmin{adm}, pkSelect: sqlPKSelect(db), storePKSelect: sqlPKSelect(db),
			// floortx runs on the measured pool. floor on a pool of its
			// own, as many connections, behind the same proxy, open for
			// its measurements only; the measured pool's idle connections
			// close meanwhile, so that the two never need twice the
			// workers' connections of max_connections (151 by default),
			// and open again after.
			openFloor: func(ctx context.Context, callerTx bool) (*floorRunner[*sql.Tx], error) {
				if callerTx {
					return mysqlFloor(store, nil), nil
				}
				db.SetMaxIdleConns(0)
				rewarm := func() {
					// A failure leaves the connections to be opened on
					// demand, by the warm-up of the next measurement.
					_ = warm(context.WithoutCancel(ctx), db, conns)
				}
				fdb, err := mysqlDB(ctx, base, ns, conns, via, mysqlFloorPool)
				if err != nil {
					rewarm()
					return nil, err
				}
				fr := mysqlFloor(store, fdb)
				fr.close = func() { _ = fdb.Close(); rewarm() }
				return fr, nil
			},
			close: func() { _ = db.Close(); _ = adm.Close() },
		}, nil
	}
	return b, nil
}

// mysqlPool is the kind of pool mysqlDB opens.
type mysqlPool int

const (
	mysqlMeasured  mysqlPool = iota // through idemmysql.NewConnector
	mysqlAdmin                      // the driver's, without foreign key checks
	mysqlFloorPool                  // through floorConnector
)

// mysqlDB opens a pool of conns connections on database name (none when
// empty) with what idem needs (parseTime, UTC) and interpolateParams, as
// BenchmarkIdem does: it saves a prepare round trip per statement. The
// measured pools go through idemmysql.NewConnector, as docs/dialects.md
// recommends: Do's BEGIN travels with its claim and its COMMIT with its
// completion; other transactions are the driver's. via, when not empty,
// is the host:port to connect to instead of the server's (the latency
// proxy). An admin pool's connections run without foreign key checks, so
// that resets can truncate orders.
func mysqlDB(ctx context.Context, base *gomysql.Config, name string, conns int, via string, kind mysqlPool) (*sql.DB, error) {
	cfg := base.Clone()
	if via != "" {
		cfg.Addr = via
	}
	if kind == mysqlAdmin {
		params := map[string]string{"foreign_key_checks": "0"}
		for k, v := range base.Params {
			params[k] = v
		}
		cfg.Params = params
	}
	cfg.DBName = name
	cfg.ParseTime = true
	cfg.Loc = time.UTC
	cfg.InterpolateParams = true
	var (
		conn driver.Connector
		err  error
	)
	switch kind {
	case mysqlAdmin:
		conn, err = gomysql.NewConnector(cfg)
	case mysqlFloorPool:
		conn, err = newFloorConnector(cfg)
	default:
		conn, err = idemmysql.NewConnector(cfg)
	}
	if err != nil {
		return nil, fmt.Errorf("mysql: %w", err)
	}
	db := sql.OpenDB(conn)
	if err := warm(ctx, db, conns); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("mysql: %w", err)
	}
	return db, nil
}
