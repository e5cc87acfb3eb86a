package mysql_test

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/conformance"
	"github.com/idemstore/idem/internal/testdb"
	"github.com/idemstore/idem/migrations"
	idemmysql "github.com/idemstore/idem/mysql"
)

func TestConformance(t *testing.T) {
	t.Parallel()
	conformance.Run(t, newHarness(t, "Detected"))
}

// TestConformanceSessionVariable runs the suite through the claim path
// written for MySQL 8 (session innodb_lock_wait_timeout set and restored
// around the claim), which MariaDB also accepts.
func TestConformanceSessionVariable(t *testing.T) {
	t.Parallel()
	conformance.Run(t, newHarness(t, "SessionVariable"))
}

// TestConformanceServerPrepared runs the executor cases, on both claim
// paths, with interpolateParams=false: every statement as a server-side
// prepared statement, whose DATETIME(6) and VARBINARY arguments travel in
// the binary protocol instead of as text.
func TestConformanceServerPrepared(t *testing.T) {
	t.Parallel()
	for _, p := range claimPaths {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, p.name)
			h.serverPrepared = true
			conformance.RunExecutor(t, h)
		})
	}
}

// TestConformancePiped runs the suite on a pool opened with NewConnector,
// on which Do's BEGIN travels with its claim and its COMMIT with its
// completion (on MariaDB). On the MySQL claim path (SessionVariable), the
// lazily begun transaction sends START TRANSACTION before its first
// statement and the completion and COMMIT apart, as on MySQL.
func TestConformancePiped(t *testing.T) {
	t.Parallel()
	for _, p := range claimPaths {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, p.name)
			h.piped = true
			conformance.Run(t, h)
		})
	}
}

// TestConformanceOptimistic runs the suite on Dialects made with
// WithOptimisticDo, on both ways of bounding a lock wait, through pools
// of NewConnector (MariaDB: the read with START TRANSACTION, the insert
// with COMMIT) and of the plain driver (every statement apart).
func TestConformanceOptimistic(t *testing.T) {
	t.Parallel()
	for _, p := range optimisticPaths {
		for _, piped := range []bool{true, false} {
			name := p.name
			if piped {
				name += "Piped"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				h := newHarness(t, p.name)
				h.piped, h.optimistic = piped, true
				conformance.Run(t, h)
			})
		}
	}
}

// claimPath returns the constructor of the claim path named name in claimPaths.
func claimPath(t *testing.T, name string) func(*sql.DB) *idemmysql.Dialect {
	t.Helper()
	for _, p := range append(claimPaths[:len(claimPaths):len(claimPaths)], optimisticPaths...) {
		if p.name == name {
			return p.new
		}
	}
	t.Fatalf("no claim path %q", name)
	return nil
}

// TestConformanceChild is the lease holder the process cases of the suite
// start and kill; it does nothing in a normal run.
func TestConformanceChild(t *testing.T) { conformance.RunChild(t, reopen) }

// The environment of a child process: the namespace's DSN (database
// included) and the claim path's name in claimPaths.
const (
	childDSNEnv  = "IDEM_TEST_MYSQL_CHILD_DSN"
	childPathEnv = "IDEM_TEST_MYSQL_CHILD_PATH"
)

// reopen connects, in a child process, to the database Namespace.ChildEnv names.
func reopen(_ context.Context, t *testing.T) idem.Dialect[*sql.Tx] {
	t.Helper()
	cfg, err := gomysql.ParseDSN(os.Getenv(childDSNEnv))
	require.NoError(t, err, childDSNEnv)
	require.NotEmpty(t, cfg.DBName, childDSNEnv)
	newDialect := claimPath(t, os.Getenv(childPathEnv))
	db := openDB(t, cfg)
	db.SetMaxOpenConns(4)
	return newDialect(db)
}

// harness implements conformance.Harness with one database per Open.
type harness struct {
	server     *server
	path       string // the claim path's name in claimPaths
	newDialect func(*sql.DB) *idemmysql.Dialect
	// serverPrepared turns interpolateParams off.
	serverPrepared bool
	// piped opens the Dialect's pool with NewConnector.
	piped bool
	// optimistic: the Dialect was made with WithOptimisticDo.
	optimistic bool
}

var _ conformance.Harness[*sql.Tx] = (*harness)(nil)

func newHarness(t *testing.T, path string) *harness {
	t.Helper()
	return &harness{server: testServer(t), path: path, newDialect: claimPath(t, path)}
}

func (h *harness) Open(ctx context.Context, t *testing.T) *conformance.Namespace[*sql.Tx] {
	t.Helper()
	ns := h.server.open(ctx, t, !h.serverPrepared)
	db := ns.db
	if h.piped {
		db = h.server.connectPiped(t, ns.name)
	}
	return &conformance.Namespace[*sql.Tx]{
		Dialect:      h.newDialect(db),
		InsertOrder:  ns.insertOrder,
		CountOrders:  ns.countOrders,
		CountRecords: ns.countRecords,
		SeedExpired:  ns.seedExpired,
		Migrate:      func(ctx context.Context) error { return idemmysql.Migrate(ctx, ns.db) },
		Unmigrate:    func(ctx context.Context) error { return conformance.MigrateDown(ctx, migrations.MySQL, ns.db) },
		CorruptResponse: func(ctx context.Context, scope, key string, status *int, headers []byte) error {
			_, err := ns.db.ExecContext(ctx, `UPDATE idempotency_keys SET response_status = ?, response_headers = ?
				WHERE scope = ? AND idempotency_key = ?`, status, headers, scope, key)
			return err
		},
		BodyTable: func(cfg *idem.TableBodyStoreConfig) idem.BodyStore {
			bs, err := idemmysql.NewTableBodyStore(ns.db, cfg)
			require.NoError(t, err)
			return bs
		},
		BodyRows: func(ctx context.Context) (int, error) {
			var n int
			err := ns.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM idempotency_bodies`).Scan(&n)
			return n, err
		},
		SetBodyChunk: func(ctx context.Context, address string, seq int64, data []byte) error {
			return conformance.SetBodyChunkSQL(ctx, ns.db, address, seq, data)
		},
		DropBodyTable: func(ctx context.Context) error {
			_, err := ns.db.ExecContext(ctx, `DROP TABLE idempotency_bodies`)
			return err
		},
		Close: func() { _ = db.Close(); _ = ns.db.Close() },
		ChildEnv: []string{
			childDSNEnv + "=" + h.server.dsn(ns.name, !h.serverPrepared),
			childPathEnv + "=" + h.path,
		},
	}
}

func (h *harness) Unreachable(_ context.Context, t *testing.T) idem.Dialect[*sql.Tx] {
	t.Helper()
	cfg := h.server.cfg.Clone()
	cfg.Addr = "127.0.0.1:1" // nothing listens on port 1
	cfg.DBName = ""
	cfg.Timeout = 2 * time.Second
	return h.newDialect(openDB(t, cfg))
}

func (h *harness) Features() conformance.Features {
	return conformance.Features{
		TimePrecision:   time.Microsecond,
		WaitGranularity: time.Second,
		// The dialect pipelines (NewConnector's pools send Do's BEGIN with
		// the claim and its COMMIT with the completion; other pools send
		// them apart), but holds no key without its row.
		Pipelined:    true,
		OptimisticDo: h.optimistic,
	}
}

// server is the test server, shared by every test of the binary.
type server struct {
	cfg   *gomysql.Config // the base DSN
	admin *sql.DB         // creates and drops databases, counts rows
	// conns is the connection limit of each namespace's pool; see budget.
	conns int
}

var (
	serverOnce sync.Once
	shared     *server
	sharedErr  error
)

// testServer returns the shared server, skipping t when it is unreachable
// (failing it under CI or IDEM_TEST_REQUIRE_DB=1).
func testServer(t *testing.T) *server {
	t.Helper()
	dsn := testdb.MySQLDSN(t, func(dsn string) (string, error) {
		cfg, err := gomysql.ParseDSN(dsn)
		if err != nil {
			return "", err
		}
		return cfg.Addr, nil
	})
	serverOnce.Do(func() { shared, sharedErr = connectServer(dsn) })
	require.NoError(t, sharedErr)
	return shared
}

const adminConns = 5

func connectServer(dsn string) (*server, error) {
	cfg, err := gomysql.ParseDSN(dsn)
	if err != nil {
		return nil, err
	}
	cfg.ParseTime = true
	admin := cfg.Clone()
	if admin.Params == nil {
		admin.Params = map[string]string{}
	}
	// A test that leaks an open transaction must make DROP DATABASE fail
	// after a while, not wait for its metadata lock for a year.
	admin.Params["lock_wait_timeout"] = "30"
	conn, err := gomysql.NewConnector(admin)
	if err != nil {
		return nil, err
	}
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(adminConns)
	db.SetMaxIdleConns(adminConns)
	var maxConns int
	if err := db.QueryRowContext(context.Background(), "SELECT @@max_connections").Scan(&maxConns); err != nil {
		_ = db.Close()
		return nil, err
	}
	return &server{cfg: cfg, admin: db, conns: budget(maxConns)}, nil
}

// budget shares the server's max_connections between the namespaces of the
// tests that run at once (at most -test.parallel, each opening one
// namespace), keeping room for the admin pool and other clients. Contention
// cases run 50+ goroutines on one key; they queue for the pool's
// connections rather than exhaust the server's.
func budget(maxConns int) int {
	parallel := 1
	if f := flag.Lookup("test.parallel"); f != nil {
		if n, err := strconv.Atoi(f.Value.String()); err == nil && n > 0 {
			parallel = n
		}
	}
	const reserve = adminConns + 10
	return min(max((maxConns-reserve)/parallel, 4), 20)
}

// namespace is one test database.
type namespace struct {
	name  string
	db    *sql.DB
	admin *sql.DB
}

// open creates a migrated database holding idem's table and the orders
// table, and a pool on it with parseTime=true and interpolateParams as given.
func (s *server) open(ctx context.Context, t *testing.T, interpolate bool) *namespace {
	t.Helper()
	name := s.createDatabase(ctx, t)
	db := s.connect(t, name, interpolate)
	require.NoError(t, idemmysql.Migrate(ctx, db))
	_, err := db.ExecContext(ctx, `CREATE TABLE orders (
		id  BIGINT AUTO_INCREMENT PRIMARY KEY,
		ref VARCHAR(255) NOT NULL
	) ENGINE = InnoDB`)
	require.NoError(t, err)
	return &namespace{name: name, db: db, admin: s.admin}
}

// connect opens a pool on database name with the settings idem needs:
// parseTime=true, loc=UTC (the driver's default, set here to make it
// visible); interpolateParams=true saves the prepare round trip of each
// statement, false runs them as server-side prepared statements.
func (s *server) connect(t *testing.T, name string, interpolate bool) *sql.DB {
	t.Helper()
	db := openDB(t, s.config(name, interpolate))
	db.SetMaxOpenConns(s.conns)
	db.SetMaxIdleConns(s.conns)
	return db
}

// connectPiped is connect with interpolateParams, through
// idemmysql.NewConnector.
func (s *server) connectPiped(t *testing.T, name string) *sql.DB {
	t.Helper()
	db := openPiped(t, s.config(name, true))
	db.SetMaxOpenConns(s.conns)
	db.SetMaxIdleConns(s.conns)
	return db
}

// config is the driver configuration of connect.
func (s *server) config(name string, interpolate bool) *gomysql.Config {
	cfg := s.cfg.Clone()
	cfg.DBName = name
	cfg.ParseTime = true
	cfg.Loc = time.UTC
	cfg.InterpolateParams = interpolate
	return cfg
}

// dsn is config as a DSN, for a child process.
func (s *server) dsn(name string, interpolate bool) string {
	return s.config(name, interpolate).FormatDSN()
}

// createDatabase creates an empty database dropped when t ends.
func (s *server) createDatabase(ctx context.Context, t *testing.T) string {
	t.Helper()
	name := testdb.Name() // [a-z0-9_] only: safe unquoted
	_, err := s.admin.ExecContext(ctx, "CREATE DATABASE "+name)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := s.admin.ExecContext(context.WithoutCancel(ctx), "DROP DATABASE IF EXISTS "+name)
		assert.NoError(t, err)
	})
	return name
}

// openDB opens a pool for cfg, closed when t ends (before the database is
// dropped, as cleanups run last-in first-out).
func openDB(t *testing.T, cfg *gomysql.Config) *sql.DB {
	t.Helper()
	conn, err := gomysql.NewConnector(cfg)
	require.NoError(t, err)
	db := sql.OpenDB(conn)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// openPiped is openDB through idemmysql.NewConnector.
func openPiped(t *testing.T, cfg *gomysql.Config) *sql.DB {
	t.Helper()
	conn, err := idemmysql.NewConnector(cfg)
	require.NoError(t, err)
	db := sql.OpenDB(conn)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// seedExpired inserts succeeded records "seed"/"seed-0" ... "seed-<?-1>",
// at most a million, completed an hour before their retention deadline, in
// one statement: the numbers are the digits 0-9 cross-joined six times (no
// recursive CTE, which MySQL stops after cte_max_recursion_depth, 1000 by
// default, and no sequence table, which only MariaDB has).
//
// Arguments: completion time, retention deadline, n.
const seedExpired = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at)
WITH d (n) AS (
	SELECT 0 UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4
	UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9)
SELECT 'seed', CONCAT('seed-', s.i), UNHEX(REPEAT('00', 32)), 2, 1, 1, t.done,
	200, NULL, '', t.done, t.done, t.done, t.expires
FROM (
	SELECT d0.n + 10 * d1.n + 100 * d2.n + 1000 * d3.n + 10000 * d4.n + 100000 * d5.n AS i
	FROM d AS d0, d AS d1, d AS d2, d AS d3, d AS d4, d AS d5
) AS s, (SELECT CAST(? AS DATETIME(6)) AS done, CAST(? AS DATETIME(6)) AS expires) AS t
WHERE s.i < ?`

func (n *namespace) seedExpired(ctx context.Context, count int, expiresAt time.Time) error {
	if count > 1_000_000 {
		return fmt.Errorf("seedExpired: %d records, at most 1000000", count)
	}
	expires := expiresAt.UTC().Truncate(time.Microsecond)
	_, err := n.db.ExecContext(ctx, seedExpired, expires.Add(-time.Hour), expires, count)
	return err
}

func (n *namespace) insertOrder(ctx context.Context, tx *sql.Tx, ref string) error {
	_, err := tx.ExecContext(ctx, "INSERT INTO orders (ref) VALUES (?)", ref)
	return err
}

// countOrders and countRecords read through the admin pool, so they work
// after the namespace's pool is closed.
func (n *namespace) countOrders(ctx context.Context, ref string) (int, error) {
	var c int
	err := n.admin.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+n.name+".orders WHERE ref = ?", ref).Scan(&c)
	return c, err
}

func (n *namespace) countRecords(ctx context.Context) (int, error) {
	var c int
	err := n.admin.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+n.name+".idempotency_keys").Scan(&c)
	return c, err
}

// TestLargeBody is not parallel: it measures the process's heap.
func TestLargeBody(t *testing.T) { conformance.RunLargeBody(t, newHarness(t, "Detected")) }
