package idemhttp_test

import (
	"context"
	"database/sql"
	"os"
	"path/filepath"
	"strconv"
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
// file, PostgreSQL schema or MariaDB database per test, migrated with the
// dialect's Migrate, plus a business table:
//
//	orders (id, tenant, idem_key, amount)
//
// with no unique constraint, so that a handler run twice shows as two rows.
// PostgreSQL and MariaDB come from internal/testdb: skipped locally when
// unreachable, failing under CI or IDEM_TEST_REQUIRE_DB=1.

// harness opens namespaces on one dialect.
type harness[TTx any] interface {
	name() string
	open(t *testing.T) *namespace[TTx]
	// unreachable returns a dialect whose database cannot be reached.
	unreachable(t *testing.T) idem.Dialect[TTx]
	features() features
}

// features tell the cases how the dialect waits, instead of branching on
// its name.
type features struct {
	// waitsAtBegin is true for SQLite: a transaction waits for the database
	// lock when it begins, so a duplicate of an open transaction queues
	// behind it instead of getting "in progress" after WaitTimeout.
	waitsAtBegin bool
	// minWait is the shortest WaitTimeout the dialect honours.
	minWait time.Duration
}

// namespace is one isolated database with idem's table and the orders table.
type namespace[TTx any] struct {
	dialect idem.Dialect[TTx]
	// insertOrder writes an order on tx and returns its ID.
	insertOrder func(ctx context.Context, tx TTx, tenant, key string, amount int64) (int64, error)
	// countOrders counts the orders, on the pool.
	countOrders func(ctx context.Context) (int, error)
	// countRecords counts idempotency records, on the pool.
	countRecords func(ctx context.Context) (int, error)
	// breakTx makes tx fail to complete: its commit (PostgreSQL, SQLite:
	// a deferred foreign key violation) or its next statement (MariaDB,
	// which has no deferred constraints: the connection is killed).
	breakTx func(ctx context.Context, tx TTx) error
	// dropKeys drops the idempotency_keys table, so the store fails.
	dropKeys func(ctx context.Context) error
	// setStoredStatus overwrites the response status of every stored
	// record by hand, as a damaged or hand-written row would have it.
	setStoredStatus func(ctx context.Context, status int) error
	// bodyTable is the dialect's table body store on the namespace.
	bodyTable func(cfg *idem.TableBodyStoreConfig) idem.BodyStore
	// dropBodies drops the idempotency_bodies table, so a table body
	// store fails.
	dropBodies func(ctx context.Context) error
}

// Short names for the two transaction types.
type (
	sqlTx = sql.Tx
	pgxTx = pgx.Tx
)

// ---- SQLite ----

type sqliteHarness struct{}

func (sqliteHarness) name() string { return "sqlite" }

func (sqliteHarness) features() features {
	return features{waitsAtBegin: true, minWait: time.Millisecond}
}

func (sqliteHarness) open(t *testing.T) *namespace[*sql.Tx] {
	t.Helper()
	ctx := t.Context()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemsqlite.Migrate(ctx, db))
	for _, stmt := range []string{
		`CREATE TABLE orders (id INTEGER PRIMARY KEY, tenant TEXT NOT NULL, idem_key TEXT NOT NULL, amount INTEGER NOT NULL)`,
		`CREATE TABLE guard_target (id INTEGER PRIMARY KEY)`,
		`CREATE TABLE commit_guard (ref INTEGER REFERENCES guard_target (id) DEFERRABLE INITIALLY DEFERRED)`,
	} {
		_, err := db.ExecContext(ctx, stmt)
		require.NoError(t, err)
	}
	ns := sqlNamespace(idemsqlite.New(db), db)
	ns.bodyTable = func(cfg *idem.TableBodyStoreConfig) idem.BodyStore {
		bs, err := idemsqlite.NewTableBodyStore(db, cfg)
		require.NoError(t, err)
		return bs
	}
	return ns
}

// newSQLiteStore returns a store on a fresh migrated SQLite file.
func newSQLiteStore(t *testing.T) *idem.Store[*sql.Tx] {
	t.Helper()
	store, err := idem.New(sqliteHarness{}.open(t).dialect, nil)
	require.NoError(t, err)
	return store
}

func (sqliteHarness) unreachable(t *testing.T) idem.Dialect[*sql.Tx] {
	t.Helper()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "missing", "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return idemsqlite.New(db)
}

// sqlNamespace is the namespace of a database/sql dialect over db.
func sqlNamespace(d idem.Dialect[*sql.Tx], db *sql.DB) *namespace[*sql.Tx] {
	return &namespace[*sql.Tx]{
		dialect: d,
		insertOrder: func(ctx context.Context, tx *sql.Tx, tenant, key string, amount int64) (int64, error) {
			res, err := tx.ExecContext(ctx, `INSERT INTO orders (tenant, idem_key, amount) VALUES (?, ?, ?)`, tenant, key, amount)
			if err != nil {
				return 0, err
			}
			return res.LastInsertId()
		},
		countOrders: func(ctx context.Context) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n)
			return n, err
		},
		countRecords: func(ctx context.Context) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&n)
			return n, err
		},
		breakTx: func(ctx context.Context, tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO commit_guard (ref) VALUES (1)`)
			return err
		},
		dropKeys: func(ctx context.Context) error {
			_, err := db.ExecContext(ctx, `DROP TABLE idempotency_keys`)
			return err
		},
		setStoredStatus: func(ctx context.Context, status int) error {
			_, err := db.ExecContext(ctx, `UPDATE idempotency_keys SET response_status = ?`, status)
			return err
		},
		dropBodies: func(ctx context.Context) error {
			_, err := db.ExecContext(ctx, `DROP TABLE idempotency_bodies`)
			return err
		},
	}
}

// ---- PostgreSQL ----

type pgHarness struct {
	url   string
	admin *pgxpool.Pool
}

// pgAdmin is the one pool per test binary that creates and drops schemas.
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

func (*pgHarness) name() string { return "postgres" }

func (*pgHarness) features() features { return features{minWait: time.Millisecond} }

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
	_, err = pool.Exec(ctx, `
		CREATE TABLE orders (
			id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
			tenant   text NOT NULL,
			idem_key text NOT NULL,
			amount   bigint NOT NULL
		);
		CREATE TABLE guard_target (id int PRIMARY KEY);
		CREATE TABLE commit_guard (ref int REFERENCES guard_target (id) DEFERRABLE INITIALLY DEFERRED);`)
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
		breakTx: func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO commit_guard (ref) VALUES (1)`)
			return err
		},
		dropKeys: func(ctx context.Context) error {
			_, err := pool.Exec(ctx, `DROP TABLE idempotency_keys`)
			return err
		},
		setStoredStatus: func(ctx context.Context, status int) error {
			_, err := pool.Exec(ctx, `UPDATE idempotency_keys SET response_status = $1::integer`, status)
			return err
		},
		bodyTable: func(cfg *idem.TableBodyStoreConfig) idem.BodyStore {
			bs, err := idempg.NewTableBodyStore(pool, cfg)
			require.NoError(t, err)
			return bs
		},
		dropBodies: func(ctx context.Context) error {
			_, err := pool.Exec(ctx, `DROP TABLE idempotency_bodies`)
			return err
		},
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

func (*mysqlHarness) name() string { return "mariadb" }

// MySQL counts lock waits in whole seconds.
func (*mysqlHarness) features() features { return features{minWait: time.Second} }

// mysqlConns is each namespace's pool size: the server's connections are
// shared with the other packages' tests running at the same time.
const mysqlConns = 4

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
	db.SetMaxOpenConns(mysqlConns)
	db.SetMaxIdleConns(mysqlConns)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemmysql.Migrate(ctx, db))
	_, err = db.ExecContext(ctx, `CREATE TABLE orders (
		id       BIGINT AUTO_INCREMENT PRIMARY KEY,
		tenant   VARCHAR(255) NOT NULL,
		idem_key VARCHAR(255) NOT NULL,
		amount   BIGINT NOT NULL
	) ENGINE = InnoDB`)
	require.NoError(t, err)
	ns := sqlNamespace(idemmysql.New(db), db)
	ns.bodyTable = func(cfg *idem.TableBodyStoreConfig) idem.BodyStore {
		bs, err := idemmysql.NewTableBodyStore(db, cfg)
		require.NoError(t, err)
		return bs
	}
	ns.breakTx = func(ctx context.Context, tx *sql.Tx) error {
		var id int64
		if err := tx.QueryRowContext(ctx, `SELECT CONNECTION_ID()`).Scan(&id); err != nil {
			return err
		}
		_, err := h.admin.ExecContext(ctx, "KILL CONNECTION "+strconv.FormatInt(id, 10))
		return err
	}
	return ns
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
