// Package storetest gives the tests of the contrib modules real stores on
// every dialect: a fresh SQLite file, PostgreSQL schema or MariaDB database
// per test (namespaced by internal/testdb, which skips locally when a server
// is unreachable and fails under CI or IDEM_TEST_REQUIRE_DB=1), migrated,
// plus a business table orders (id, tenant, idem_key, amount) without a
// unique constraint, so that a handler run twice shows as two rows.
package storetest

import (
	"context"
	"database/sql"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
	idemmysql "github.com/idemstore/idem/mysql"
	idempg "github.com/idemstore/idem/postgres"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// Harness opens stores of one dialect.
type Harness[TTx any] interface {
	// Name is the dialect's name in subtest names.
	Name() string
	// Open returns a fresh migrated namespace, dropped when t ends.
	Open(t *testing.T) *Namespace[TTx]
	// Unreachable returns a dialect whose database cannot be reached.
	Unreachable(t *testing.T) idem.Dialect[TTx]
	// WaitsAtBegin is true for SQLite, where a duplicate of an open
	// transaction queues behind it (bounded by the busy timeout) instead of
	// getting "in progress" after WaitTimeout.
	WaitsAtBegin() bool
	// MinWait is the shortest WaitTimeout the dialect honours.
	MinWait() time.Duration
}

// Namespace is one test's store and business table.
type Namespace[TTx any] struct {
	Dialect idem.Dialect[TTx]
	// InsertOrder inserts a row into orders in tx and returns its id.
	InsertOrder func(ctx context.Context, tx TTx, tenant, key string, amount int64) (int64, error)
	// CountOrders and CountRecords count the rows of orders and idempotency_keys.
	CountOrders  func(ctx context.Context) (int, error)
	CountRecords func(ctx context.Context) (int, error)
}

// ---- SQLite ----

// SQLite is the Harness of package sqlite: a file per test.
type SQLite struct{}

func (SQLite) Name() string           { return "sqlite" }
func (SQLite) WaitsAtBegin() bool     { return true }
func (SQLite) MinWait() time.Duration { return time.Millisecond }

func (SQLite) Open(t *testing.T) *Namespace[*sql.Tx] {
	t.Helper()
	ctx := t.Context()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemsqlite.Migrate(ctx, db))
	_, err = db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, idem_key TEXT NOT NULL, amount INTEGER NOT NULL)`)
	require.NoError(t, err)
	return sqlNamespace(idemsqlite.New(db), db)
}

func (SQLite) Unreachable(t *testing.T) idem.Dialect[*sql.Tx] {
	t.Helper()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "missing", "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return idemsqlite.New(db)
}

func sqlNamespace(d idem.Dialect[*sql.Tx], db *sql.DB) *Namespace[*sql.Tx] {
	count := func(table string) func(context.Context) (int, error) {
		return func(ctx context.Context) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+table).Scan(&n)
			return n, err
		}
	}
	return &Namespace[*sql.Tx]{
		Dialect: d,
		InsertOrder: func(ctx context.Context, tx *sql.Tx, tenant, key string, amount int64) (int64, error) {
			res, err := tx.ExecContext(ctx, `INSERT INTO orders (tenant, idem_key, amount) VALUES (?, ?, ?)`, tenant, key, amount)
			if err != nil {
				return 0, err
			}
			return res.LastInsertId()
		},
		CountOrders:  count("orders"),
		CountRecords: count("idempotency_keys"),
	}
}

// ---- PostgreSQL ----

// Postgres is the Harness of package postgres: a schema per test.
type Postgres struct {
	url   string
	admin *pgxpool.Pool
}

var pgAdmin struct {
	once sync.Once
	pool *pgxpool.Pool
	err  error
}

// NewPostgres returns the PostgreSQL harness of the test server.
func NewPostgres(t *testing.T) *Postgres {
	t.Helper()
	url := testdb.PostgresURL(t)
	pgAdmin.once.Do(func() {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			pgAdmin.err = err
			return
		}
		cfg.MaxConns = 2
		pgAdmin.pool, pgAdmin.err = pgxpool.NewWithConfig(context.Background(), cfg)
	})
	require.NoError(t, pgAdmin.err)
	return &Postgres{url: url, admin: pgAdmin.pool}
}

func (*Postgres) Name() string           { return "postgres" }
func (*Postgres) WaitsAtBegin() bool     { return false }
func (*Postgres) MinWait() time.Duration { return time.Millisecond }

func (h *Postgres) Open(t *testing.T) *Namespace[pgx.Tx] {
	t.Helper()
	ctx := t.Context()
	schema := testdb.Name()
	_, err := h.admin.Exec(ctx, "CREATE SCHEMA "+schema)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := h.admin.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+schema+" CASCADE")
		assert.NoError(t, err)
	})
	cfg, err := pgxpool.ParseConfig(h.url)
	require.NoError(t, err)
	cfg.MaxConns = 4
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, idempg.Migrate(ctx, pool))
	_, err = pool.Exec(ctx, `CREATE TABLE orders (
		id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		tenant   text NOT NULL,
		idem_key text NOT NULL,
		amount   bigint NOT NULL)`)
	require.NoError(t, err)
	count := func(table string) func(context.Context) (int, error) {
		return func(ctx context.Context) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&n)
			return n, err
		}
	}
	return &Namespace[pgx.Tx]{
		Dialect: idempg.New(pool),
		InsertOrder: func(ctx context.Context, tx pgx.Tx, tenant, key string, amount int64) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO orders (tenant, idem_key, amount) VALUES ($1, $2, $3) RETURNING id`,
				tenant, key, amount).Scan(&id)
			return id, err
		},
		CountOrders:  count("orders"),
		CountRecords: count("idempotency_keys"),
	}
}

func (h *Postgres) Unreachable(t *testing.T) idem.Dialect[pgx.Tx] {
	t.Helper()
	pool, err := pgxpool.New(t.Context(), "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=2")
	require.NoError(t, err) // connects lazily
	t.Cleanup(pool.Close)
	return idempg.New(pool)
}

// ---- MariaDB / MySQL ----

// MySQL is the Harness of package mysql: a database per test.
type MySQL struct {
	cfg   *gomysql.Config
	admin *sql.DB
}

var myAdmin struct {
	once sync.Once
	cfg  *gomysql.Config
	db   *sql.DB
	err  error
}

// NewMySQL returns the MariaDB harness of the test server.
func NewMySQL(t *testing.T) *MySQL {
	t.Helper()
	dsn := testdb.MySQLDSN(t, func(dsn string) (string, error) {
		cfg, err := gomysql.ParseDSN(dsn)
		if err != nil {
			return "", err
		}
		return cfg.Addr, nil
	})
	myAdmin.once.Do(func() {
		cfg, err := gomysql.ParseDSN(dsn)
		if err != nil {
			myAdmin.err = err
			return
		}
		cfg.ParseTime = true
		cfg.Loc = time.UTC
		cfg.InterpolateParams = true
		conn, err := gomysql.NewConnector(cfg)
		if err != nil {
			myAdmin.err = err
			return
		}
		myAdmin.cfg = cfg
		myAdmin.db = sql.OpenDB(conn)
		myAdmin.db.SetMaxOpenConns(2)
	})
	require.NoError(t, myAdmin.err)
	return &MySQL{cfg: myAdmin.cfg, admin: myAdmin.db}
}

func (*MySQL) Name() string       { return "mariadb" }
func (*MySQL) WaitsAtBegin() bool { return false }

// MySQL counts lock waits in whole seconds.
func (*MySQL) MinWait() time.Duration { return time.Second }

func (h *MySQL) Open(t *testing.T) *Namespace[*sql.Tx] {
	t.Helper()
	ctx := t.Context()
	name := testdb.Name()
	_, err := h.admin.ExecContext(ctx, "CREATE DATABASE "+name)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := h.admin.ExecContext(context.WithoutCancel(ctx), "DROP DATABASE IF EXISTS "+name)
		assert.NoError(t, err)
	})
	cfg := h.cfg.Clone()
	cfg.DBName = name
	conn, err := gomysql.NewConnector(cfg)
	require.NoError(t, err)
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(4)
	db.SetMaxIdleConns(4)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemmysql.Migrate(ctx, db))
	_, err = db.ExecContext(ctx, `CREATE TABLE orders (
		id       BIGINT AUTO_INCREMENT PRIMARY KEY,
		tenant   VARCHAR(255) NOT NULL,
		idem_key VARCHAR(255) NOT NULL,
		amount   BIGINT NOT NULL
	) ENGINE = InnoDB`)
	require.NoError(t, err)
	return sqlNamespace(idemmysql.New(db), db)
}

func (h *MySQL) Unreachable(t *testing.T) idem.Dialect[*sql.Tx] {
	t.Helper()
	cfg := h.cfg.Clone()
	cfg.Addr = "127.0.0.1:1" // nothing listens on port 1
	cfg.DBName = ""
	cfg.Timeout = 2 * time.Second
	conn, err := gomysql.NewConnector(cfg)
	require.NoError(t, err)
	db := sql.OpenDB(conn)
	t.Cleanup(func() { _ = db.Close() })
	return idemmysql.New(db)
}

// Main runs the tests and closes the shared admin connections; call it from
// TestMain.
func Main(m *testing.M) {
	code := m.Run()
	if pgAdmin.pool != nil {
		pgAdmin.pool.Close()
	}
	if myAdmin.db != nil {
		_ = myAdmin.db.Close()
	}
	os.Exit(code)
}

// Dialects runs a test case on SQLite, PostgreSQL and MariaDB, in parallel
// subtests when parallel is set.
func Dialects(t *testing.T, parallel Parallelism, sqlCase func(*testing.T, Harness[*sql.Tx]), pgCase func(*testing.T, Harness[pgx.Tx])) {
	t.Helper()
	run := func(name string, fn func(*testing.T)) {
		t.Run(name, func(t *testing.T) {
			if parallel == InParallel {
				t.Parallel()
			}
			fn(t)
		})
	}
	run("sqlite", func(t *testing.T) { sqlCase(t, SQLite{}) })
	run("postgres", func(t *testing.T) { pgCase(t, NewPostgres(t)) })
	run("mariadb", func(t *testing.T) { sqlCase(t, NewMySQL(t)) })
}

// Parallelism says whether Dialects runs its subtests in parallel.
type Parallelism int

const (
	// InSequence runs the dialects one after the other.
	InSequence Parallelism = iota
	// InParallel runs them as parallel subtests.
	InParallel
)
