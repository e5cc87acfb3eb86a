package postgres_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/benchkit"
	"github.com/idemstore/idem/internal/codec"
	"github.com/idemstore/idem/internal/testdb"
	"github.com/idemstore/idem/internal/workload"
	idempg "github.com/idemstore/idem/postgres"
)

// BenchmarkIdem measures idem against the bare business transaction on the
// PostgreSQL server of IDEM_TEST_POSTGRES_URL (skipped when unreachable),
// in a schema of its own. See docs/performance.md.
func BenchmarkIdem(b *testing.B) {
	ctx := context.Background()
	url := testdb.PostgresURL(b)
	schema := testdb.Name()

	// setup creates the schema and resets the tables between measurements.
	setup := benchPGPool(ctx, b, url, "public", 2)
	_, err := setup.Exec(ctx, "CREATE SCHEMA "+schema)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if _, err := setup.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			b.Error(err)
		}
	})
	admin := benchPGPool(ctx, b, url, schema, 2)
	if err := idempg.Migrate(ctx, admin); err != nil {
		b.Fatal(err)
	}
	for _, q := range workload.Tables(workload.Postgres) {
		benchPGExec(ctx, b, admin, q)
	}
	if err := workload.FillProducts(ctx, workload.Postgres, func(ctx context.Context, q string, args ...any) error {
		_, err := admin.Exec(ctx, q, args...)
		return err
	}); err != nil {
		b.Fatal(err)
	}
	header, err := codec.EncodeHeader(benchkit.Response.Header)
	if err != nil {
		b.Fatal(err)
	}

	benchkit.Run(b, benchkit.Target[pgx.Tx]{
		Open: func(b *testing.B, conc int) *benchkit.Pools[pgx.Tx] {
			b.Helper()
			pool := benchPGPool(ctx, b, url, schema, int32(conc)) //nolint:gosec // conc is one of benchkit's small concurrency levels
			store, err := idem.New(idempg.New(pool), nil)
			if err != nil {
				b.Fatal(err)
			}
			return &benchkit.Pools[pgx.Tx]{
				Store: store,
				PKSelect: func(ctx context.Context, scope, key string) error {
					var (
						status       int16
						fp, hdr, bdy []byte
						code         int32
					)
					return pool.QueryRow(ctx, benchPGSelect, scope, key).Scan(&status, &fp, &code, &hdr, &bdy)
				},
				Floor: func(ctx context.Context, business func(context.Context, pgx.Tx, string) error, scope, key string) error {
					return benchPGFloor(ctx, pool, business, header, scope, key)
				},
			}
		},
		Business: workload.PGBusiness,
		Counts: func(ctx context.Context) (c workload.Counts, err error) {
			err = admin.QueryRow(ctx, workload.CountsQuery(workload.Postgres)).Scan(&c.Orders, &c.Lines, &c.Stock, &c.Completed, &c.Pending)
			return c, err
		},
		Snapshot: func(ctx context.Context) error {
			_, err := admin.Exec(ctx, `CREATE TABLE bench_seed AS SELECT * FROM idempotency_keys`)
			return err
		},
		Reset: func(ctx context.Context) error {
			for _, q := range []string{
				`TRUNCATE idempotency_keys, orders, order_lines`,
				`INSERT INTO idempotency_keys SELECT * FROM bench_seed`,
				// The order shape's stock updates leave dead row versions.
				`VACUUM ANALYZE products`,
				`ANALYZE idempotency_keys, orders, order_lines`,
			} {
				if _, err := admin.Exec(ctx, q); err != nil {
					return err
				}
			}
			// Start every measurement with a clean WAL, like the lab did;
			// a role without the right to checkpoint just skips it.
			_, _ = admin.Exec(ctx, `CHECKPOINT`)
			return nil
		},
	})
}

// benchPGSelect is the replay baseline: what a replay needs to answer, read
// by primary key.
const benchPGSelect = `SELECT status, fingerprint, response_status, response_headers, response_body
FROM idempotency_keys WHERE scope = $1 AND idempotency_key = $2`

// benchPGFloorInsert writes a finished record in one plain INSERT: the
// floor's completion.
const benchPGFloorInsert = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at
) VALUES ($1, $2, $3, 2, $4, 1, now(), $5, $6, $7, now(), now(), now(), now() + interval '1 day')`

// benchPGFloor is the floor scenario (benchkit.Pools.Floor), pipelined as
// Do is: [BEGIN; read the key], the order, [insert the record; COMMIT].
func benchPGFloor(ctx context.Context, pool *pgxpool.Pool, insertOrder func(context.Context, pgx.Tx, string) error,
	header []byte, scope, key string,
) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(benchPGSelect, scope, key)
	br := conn.Conn().SendBatch(ctx, b)
	tx := br.Tx()
	_, err = br.Exec()
	if err == nil {
		var status int16
		err = br.QueryRow().Scan(&status, nil, nil, nil, nil)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			err = nil
		case err == nil:
			err = errors.New("floor: fresh key exists")
		}
	}
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	if err == nil {
		err = insertOrder(ctx, tx, scope)
	}
	if err != nil {
		_ = tx.Rollback(ctx)
		return err
	}
	fp := benchkit.Fingerprint
	b = &pgx.Batch{}
	b.Queue(benchPGFloorInsert, scope, key, fp[:], int64(1), int32(benchkit.Response.StatusCode), header, benchkit.Response.Body) //nolint:gosec // the workload's status code, 201
	b.Queue("COMMIT")
	return tx.SendBatch(ctx, b).Close()
}

// benchPGPool opens a pool of size conns (all opened at start, as in the
// lab) whose search_path is schema, closed when b ends.
func benchPGPool(ctx context.Context, b *testing.B, url, schema string, conns int32) *pgxpool.Pool {
	b.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns, cfg.MinConns = conns, conns
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}

func benchPGExec(ctx context.Context, b *testing.B, pool *pgxpool.Pool, sql string) {
	b.Helper()
	if _, err := pool.Exec(ctx, sql); err != nil {
		b.Fatal(err)
	}
}
