package idemotel_test

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

// This file gives the tests real stores on every dialect: a fresh SQLite
// file, PostgreSQL schema or MariaDB database per test (namespaced by
// internal/testdb, which skips locally when a server is unreachable and fails
// under CI or IDEM_TEST_REQUIRE_DB=1), migrated, plus a business table
// orders (id, tenant, idem_key, amount) without a unique constraint, so
// that a handler run twice shows as two rows.

type harness[TTx any] interface {
	name() string
	open(t *testing.T) *namespace[TTx]
	unreachable(t *testing.T) idem.Dialect[TTx]
	// waitsAtBegin is true for SQLite, where a duplicate of an open
	// transaction queues behind it (bounded by the busy timeout) instead of
	// getting "in progress" after WaitTimeout.
	waitsAtBegin() bool
	// minWait is the shortest WaitTimeout the dialect honours.
	minWait() time.Duration
}

type namespace[TTx any] struct {
	dialect      idem.Dialect[TTx]
	insertOrder  func(ctx context.Context, tx TTx, tenant, key string, amount int64) (int64, error)
	countOrders  func(ctx context.Context) (int, error)
	countRecords func(ctx context.Context) (int, error)
}

// ---- SQLite ----

type sqliteHarness struct{}

func (sqliteHarness) name() string           { return "sqlite" }
func (sqliteHarness) waitsAtBegin() bool     { return true }
func (sqliteHarness) minWait() time.Duration { return time.Millisecond }

func (sqliteHarness) open(t *testing.T) *namespace[*sql.Tx] {
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

func (sqliteHarness) unreachable(t *testing.T) idem.Dialect[*sql.Tx] {
	t.Helper()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "missing", "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return idemsqlite.New(db)
}

func sqlNamespace(d idem.Dialect[*sql.Tx], db *sql.DB) *namespace[*sql.Tx] {
	count := func(table string) func(context.Context) (int, error) {
		return func(ctx context.Context) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+table).Scan(&n)
			return n, err
		}
	}
	return &namespace[*sql.Tx]{
		dialect: d,
		insertOrder: func(ctx context.Context, tx *sql.Tx, tenant, key string, amount int64) (int64, error) {
			res, err := tx.ExecContext(ctx, `INSERT INTO orders (tenant, idem_key, amount) VALUES (?, ?, ?)`, tenant, key, amount)
			if err != nil {
				return 0, err
			}
			return res.LastInsertId()
		},
		countOrders:  count("orders"),
		countRecords: count("idempotency_keys"),
	}
}

// ---- PostgreSQL ----

type pgHarness struct {
	url   string
	admin *pgxpool.Pool
}

var pgAdmin struct {
	once sync.Once
	pool *pgxpool.Pool
	err  error
}

func newPGHarness(t *testing.T) *pgHarness {
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
	return &pgHarness{url: url, admin: pgAdmin.pool}
}

func (*pgHarness) name() string           { return "postgres" }
func (*pgHarness) waitsAtBegin() bool     { return false }
func (*pgHarness) minWait() time.Duration { return time.Millisecond }

func (h *pgHarness) open(t *testing.T) *namespace[pgx.Tx] {
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
	return &namespace[pgx.Tx]{
		dialect: idempg.New(pool),
		insertOrder: func(ctx context.Context, tx pgx.Tx, tenant, key string, amount int64) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, `INSERT INTO orders (tenant, idem_key, amount) VALUES ($1, $2, $3) RETURNING id`,
				tenant, key, amount).Scan(&id)
			return id, err
		},
		countOrders:  count("orders"),
		countRecords: count("idempotency_keys"),
	}
}

func (h *pgHarness) unreachable(t *testing.T) idem.Dialect[pgx.Tx] {
	t.Helper()
	pool, err := pgxpool.New(t.Context(), "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=2")
	require.NoError(t, err) // connects lazily
	t.Cleanup(pool.Close)
	return idempg.New(pool)
}

// ---- MariaDB / MySQL ----

type mysqlHarness struct {
	cfg   *gomysql.Config
	admin *sql.DB
}

var myAdmin struct {
	once sync.Once
	cfg  *gomysql.Config
	db   *sql.DB
	err  error
}

func newMySQLHarness(t *testing.T) *mysqlHarness {
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
	return &mysqlHarness{cfg: myAdmin.cfg, admin: myAdmin.db}
}

func (*mysqlHarness) name() string       { return "mariadb" }
func (*mysqlHarness) waitsAtBegin() bool { return false }

// MySQL counts lock waits in whole seconds.
func (*mysqlHarness) minWait() time.Duration { return time.Second }

func (h *mysqlHarness) open(t *testing.T) *namespace[*sql.Tx] {
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

func (h *mysqlHarness) unreachable(t *testing.T) idem.Dialect[*sql.Tx] {
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

func TestMain(m *testing.M) {
	code := m.Run()
	if pgAdmin.pool != nil {
		pgAdmin.pool.Close()
	}
	if myAdmin.db != nil {
		_ = myAdmin.db.Close()
	}
	os.Exit(code)
}
