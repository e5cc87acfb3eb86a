package postgres_test

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/conformance"
	"github.com/idemstore/idem/internal/testdb"
	"github.com/idemstore/idem/migrations"
	idempg "github.com/idemstore/idem/postgres"
)

// execModes are the pgx exec modes every test runs under
// (testdb.PostgresExecModes): by default the statement cache and the simple
// protocol PgBouncer users pick; through a transaction pooler, the modes
// safe there.
var execModes = pickExecModes(testdb.PostgresExecModes())

// defaultMode is the mode of the tests that run under one mode only.
var defaultMode = execModes[0].mode

// allExecModes maps the default_query_exec_mode names of pgx's connection
// strings to subtest names and modes.
var allExecModes = map[string]execMode{
	"cache_statement": {"CacheStatement", pgx.QueryExecModeCacheStatement},
	"cache_describe":  {"CacheDescribe", pgx.QueryExecModeCacheDescribe},
	"describe_exec":   {"DescribeExec", pgx.QueryExecModeDescribeExec},
	"exec":            {"Exec", pgx.QueryExecModeExec},
	"simple_protocol": {"SimpleProtocol", pgx.QueryExecModeSimpleProtocol},
}

func pickExecModes(names []string) []execMode {
	var modes []execMode
	for _, n := range names {
		m, ok := allExecModes[n]
		if !ok {
			panic("IDEM_TEST_POSTGRES_EXEC_MODES: unknown exec mode " + strconv.Quote(n))
		}
		modes = append(modes, m)
	}
	if len(modes) == 0 {
		panic("IDEM_TEST_POSTGRES_EXEC_MODES: no exec mode")
	}
	return modes
}

type execMode struct {
	name string
	mode pgx.QueryExecMode
}

func TestConformance(t *testing.T) {
	t.Parallel()
	testdb.PostgresURL(t) // skip or fail once, not in every case
	for _, m := range execModes {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			conformance.Run(t, &harness{modeName: m.name, mode: m.mode})
		})
	}
}

// TestConformanceChild is the lease holder the process cases of the suite
// start and kill; it does nothing in a normal run.
func TestConformanceChild(t *testing.T) { conformance.RunChild(t, reopen) }

// The environment of a child process: the server, the namespace's schema
// and the exec mode's name in execModes.
const (
	childURLEnv    = "IDEM_TEST_POSTGRES_CHILD_URL"
	childSchemaEnv = "IDEM_TEST_POSTGRES_CHILD_SCHEMA"
	childModeEnv   = "IDEM_TEST_POSTGRES_CHILD_MODE"
)

// reopen connects, in a child process, to the schema Namespace.ChildEnv names.
func reopen(ctx context.Context, t *testing.T) idem.Dialect[pgx.Tx] {
	t.Helper()
	url, schema, modeName := os.Getenv(childURLEnv), os.Getenv(childSchemaEnv), os.Getenv(childModeEnv)
	require.NotEmpty(t, url, childURLEnv)
	require.NotEmpty(t, schema, childSchemaEnv)
	i := slices.IndexFunc(execModes, func(m execMode) bool { return m.name == modeName })
	require.NotEqual(t, -1, i, "%s=%q", childModeEnv, modeName)
	return idempg.New(connect(ctx, t, url, execModes[i].mode, 4), idempg.WithSchema(schema))
}

// harness implements conformance.Harness with a schema per namespace.
type harness struct {
	modeName string
	mode     pgx.QueryExecMode
}

var _ conformance.Harness[pgx.Tx] = (*harness)(nil)

func (h *harness) Open(ctx context.Context, t *testing.T) *conformance.Namespace[pgx.Tx] {
	t.Helper()
	url, schema := testdb.PostgresURL(t), createSchema(ctx, t)
	pool := connect(ctx, t, url, h.mode, 10)
	require.NoError(t, idempg.Migrate(ctx, pool, idempg.WithSchema(schema)))
	q := qualifier(schema)
	_, err := pool.Exec(ctx, `CREATE TABLE `+q("orders")+` (
		id  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		ref text NOT NULL
	)`)
	require.NoError(t, err)

	return &conformance.Namespace[pgx.Tx]{
		Dialect: idempg.New(pool, idempg.WithSchema(schema)),
		InsertOrder: func(ctx context.Context, tx pgx.Tx, ref string) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+q("orders")+` (ref) VALUES ($1::text)`, ref)
			return err
		},
		CountOrders: func(ctx context.Context, ref string) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM `+q("orders")+` WHERE ref = $1::text`, ref).Scan(&n)
			return n, err
		},
		CountRecords: func(ctx context.Context) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM `+q("idempotency_keys")).Scan(&n)
			return n, err
		},
		SeedExpired: func(ctx context.Context, n int, expiresAt time.Time) error {
			_, err := pool.Exec(ctx, qualify(schema, seedExpired), n, expiresAt)
			return err
		},
		Migrate: func(ctx context.Context) error { return idempg.Migrate(ctx, pool, idempg.WithSchema(schema)) },
		Unmigrate: func(ctx context.Context) error {
			db := stdlib.OpenDBFromPool(pool)
			defer func() { _ = db.Close() }()
			// Down in the namespace's schema, as Migrate with WithSchema went up.
			fsys, err := migrations.FS(migrations.Postgres)
			if err != nil {
				return err
			}
			if fsys, err = idempg.InSchema(fsys, schema); err != nil {
				return err
			}
			p, err := goose.NewProvider(goose.DialectPostgres, db, fsys,
				goose.WithTableName(schema+"."+migrations.VersionTable), goose.WithDisableGlobalRegistry(true))
			if err != nil {
				return err
			}
			_, err = p.DownTo(ctx, 0)
			return err
		},
		CorruptResponse: func(ctx context.Context, scope, key string, status *int, headers []byte) error {
			var code *int32
			if status != nil {
				c := int32(*status) //nolint:gosec // test values are small
				code = &c
			}
			_, err := pool.Exec(ctx, `UPDATE `+q("idempotency_keys")+` SET response_status = $1, response_headers = $2
				WHERE scope = $3::text AND idempotency_key = $4::text`, code, headers, scope, key)
			return err
		},
		BodyTable: func(cfg *idem.TableBodyStoreConfig) idem.BodyStore {
			bs, err := idempg.NewTableBodyStore(pool, cfg, idempg.WithSchema(schema))
			require.NoError(t, err)
			return bs
		},
		BodyRows: func(ctx context.Context) (int, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM `+q("idempotency_bodies")).Scan(&n)
			return n, err
		},
		SetBodyChunk: func(ctx context.Context, address string, seq int64, data []byte) error {
			var (
				tag pgconn.CommandTag
				err error
			)
			if data == nil {
				tag, err = pool.Exec(ctx, `DELETE FROM `+q("idempotency_bodies")+` WHERE address = $1::text AND seq = $2::bigint`, address, seq)
			} else {
				tag, err = pool.Exec(ctx, `UPDATE `+q("idempotency_bodies")+` SET data = $1::bytea WHERE address = $2::text AND seq = $3::bigint`, data, address, seq)
			}
			if err == nil && tag.RowsAffected() != 1 {
				err = fmt.Errorf("set body chunk: %d rows affected", tag.RowsAffected())
			}
			return err
		},
		DropBodyTable: func(ctx context.Context) error {
			_, err := pool.Exec(ctx, `DROP TABLE `+q("idempotency_bodies"))
			return err
		},
		Close: pool.Close,
		ChildEnv: []string{
			childURLEnv + "=" + url,
			childSchemaEnv + "=" + schema,
			childModeEnv + "=" + h.modeName,
		},
	}
}

// seedExpired inserts succeeded records "seed"/"seed-0" ... "seed-<$1-1>",
// completed an hour before their retention deadline $2, in one statement.
const seedExpired = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at
)
SELECT 'seed', 'seed-' || i, decode(repeat('00', 32), 'hex'), 2, 1, 1, done,
	200, NULL, ''::bytea, done, done, done, $2::timestamptz
FROM generate_series(0, $1::integer - 1) AS i,
	(SELECT $2::timestamptz - interval '1 hour' AS done) AS d`

func (h *harness) Unreachable(ctx context.Context, t *testing.T) idem.Dialect[pgx.Tx] {
	t.Helper()
	cfg, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=2")
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = h.mode
	pool, err := pgxpool.NewWithConfig(ctx, cfg) // connects lazily
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return idempg.New(pool)
}

func (h *harness) Features() conformance.Features {
	return conformance.Features{
		TimePrecision:   time.Microsecond,
		WaitAbortsTx:    true,
		WaitGranularity: time.Millisecond, // lock_timeout counts milliseconds
		DeferredClaims:  true,
		Pipelined:       true,
	}
}

// admin is the one pool per test binary that creates and drops schemas.
var admin struct {
	once sync.Once
	pool *pgxpool.Pool
	err  error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if admin.pool != nil {
		admin.pool.Close()
	}
	os.Exit(code)
}

func adminPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	url := testdb.PostgresURL(t)
	admin.once.Do(func() {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			admin.err = err
			return
		}
		cfg.MaxConns = 4
		admin.pool, admin.err = pgxpool.NewWithConfig(context.Background(), cfg)
	})
	require.NoError(t, admin.err)
	return admin.pool
}

// qualifier returns a function that names a table of schema, quoted.
func qualifier(schema string) func(table string) string {
	return func(table string) string { return pgx.Identifier{schema, table}.Sanitize() }
}

// tableRef matches the idempotency_keys table in the SQL of a test.
var tableRef = regexp.MustCompile(`\bidempotency_keys\b`)

// qualify names the idempotency_keys table of schema in sql: the tests
// set no search_path, which a transaction pooler would refuse.
func qualify(schema, sql string) string {
	return tableRef.ReplaceAllLiteralString(sql, qualifier(schema)("idempotency_keys"))
}

// createSchema creates an empty schema, dropped when t ends, and returns its name.
func createSchema(ctx context.Context, t *testing.T) string {
	t.Helper()
	ap := adminPool(t) //nolint:contextcheck // the admin pool is shared by the whole test binary and outlives ctx, so it is not built from it
	schema := testdb.Name()
	_, err := ap.Exec(ctx, "CREATE SCHEMA "+schema)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := ap.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+schema+" CASCADE")
		require.NoError(t, err)
	})
	return schema
}

// testPool opens another pool on the test server, closed when t ends.
func testPool(ctx context.Context, t *testing.T, mode pgx.QueryExecMode, maxConns int32) *pgxpool.Pool {
	t.Helper()
	return connect(ctx, t, testdb.PostgresURL(t), mode, maxConns)
}

// connect opens a pool on the server at url, closed when t ends. It sets no
// search_path: the tests name their schema in each statement (WithSchema,
// qualify), which works through a transaction pooler too.
func connect(ctx context.Context, t *testing.T, url string, mode pgx.QueryExecMode, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = maxConns
	cfg.ConnConfig.DefaultQueryExecMode = mode
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// TestLargeBody is not parallel: it measures the process's heap.
func TestLargeBody(t *testing.T) {
	testdb.PostgresURL(t)
	conformance.RunLargeBody(t, &harness{modeName: execModes[0].name, mode: defaultMode})
}
