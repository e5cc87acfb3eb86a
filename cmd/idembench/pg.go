package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/workload"
	idempg "github.com/idemstore/idem/postgres"
)

// pgAdmin runs the tool's statements on a pgx pool.
type pgAdmin struct{ pool *pgxpool.Pool }

func (a pgAdmin) exec(ctx context.Context, q string, args ...any) error {
	_, err := a.pool.Exec(ctx, q, args...)
	return err
}

func (a pgAdmin) counts(ctx context.Context, q string) (c workload.Counts, err error) {
	err = a.pool.QueryRow(ctx, q).Scan(&c.Orders, &c.Lines, &c.Stock, &c.Completed, &c.Pending)
	return c, err
}

func (a pgAdmin) queryInt(ctx context.Context, q string, args ...any) (int64, error) {
	var n int64
	err := a.pool.QueryRow(ctx, q, args...).Scan(&n)
	return n, err
}

// pgSelect reads the six columns a replay reads (replayrow.Columns).
const pgSelect = `SELECT status, fingerprint, response_status, response_headers, response_body, expires_at
FROM idempotency_keys WHERE scope = $1 AND idempotency_key = $2`

// pgStatements: the namespace is a schema, reached through search_path.
var pgStatements = statements{
	snapshot: `CREATE TABLE idembench_seed AS SELECT * FROM idempotency_keys`,
	reset: []string{
		`TRUNCATE idempotency_keys, orders, order_lines, ` + floorTable,
		`INSERT INTO idempotency_keys SELECT * FROM idembench_seed`,
		floorSeed(""),
		// The order shape's stock updates leave dead row versions.
		`VACUUM ANALYZE products`,
		`ANALYZE idempotency_keys, orders, order_lines, ` + floorTable,
	},
	truncateOrders: []string{`TRUNCATE orders, order_lines`},
	// generate_series makes the rows in the server, in one statement per
	// chunk: no round trip per row, no data over the wire.
	fill: `INSERT INTO idempotency_keys (scope, idempotency_key, fingerprint, status, token, attempt,
		lease_expires_at, response_status, response_headers, response_body, created_at, updated_at,
		completed_at, expires_at)
	SELECT $1::text || lpad((g % 100)::text, 2, '0'), md5(g::text), t.fingerprint, t.status, t.token, t.attempt,
		t.lease_expires_at, t.response_status, t.response_headers, t.response_body, t.created_at, t.updated_at,
		t.completed_at, t.expires_at + $4::interval
	FROM generate_series($2::bigint, $3::bigint) AS g, idempotency_keys AS t
	WHERE t.scope = 'idembench-template' AND t.idempotency_key = 'template'`,
	fillArgs: func(prefix string, from, to int64, shift time.Duration) []any {
		return []any{prefix, from, to, fmt.Sprintf("%d seconds", int64(shift.Seconds()))}
	},
	countOrders:    `SELECT count(*) FROM orders WHERE tenant = $1`,
	countCompleted: `SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND status = 2`,
	deleteScope:    `DELETE FROM idempotency_keys WHERE scope LIKE $1`,
	analyze:        []string{`VACUUM ANALYZE idempotency_keys`},
	floorDone:      floorDoneWhere,
}

// pgFloorTable copies idempotency_keys' columns, constraints and indexes
// (the key digest's expression index and the partial index included).
const pgFloorTable = `CREATE TABLE ` + floorTable + ` (LIKE idempotency_keys INCLUDING ALL)`

// The floor scenarios' statements: the claim's primary-key read and the
// finished record's INSERT, with values from Go.
const (
	pgFloorRead = `SELECT ` + floorRecordColumns + `
FROM ` + floorTable + `
WHERE scope = $1 AND idempotency_key = $2`
	pgFloorInsert = `INSERT INTO ` + floorTable + ` (` + floorRecordColumns + `)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)`
)

// pgFloorTryLock is floorlock's lock on PostgreSQL: the transaction-level
// advisory lock on the key's hash that Do's deferred claim takes before its
// read (idem's postgres claimTryLock, without its look for a committed
// record and its clock), so that a second call of the key waits instead of
// running the callback too. A fresh key's lock is always free here.
const pgFloorTryLock = `SELECT pg_try_advisory_xact_lock(hashtextextended($2::text, hashtextextended($1::text, '` + floorTable + `'::regclass::oid::bigint)))`

// pgFloorScan scans a row of pgFloorRead, for a fresh key none: nil then.
func pgFloorScan(row pgx.Row) error {
	var (
		scope, key                       string
		fp, hdr, body                    []byte
		status                           int16
		token                            int64
		attempt                          int32
		code                             *int32
		lease, created, updated, expires time.Time
		completed                        *time.Time
	)
	err := row.Scan(&scope, &key, &fp, &status, &token, &attempt, &lease, &code, &hdr, &body, &created, &updated, &completed, &expires)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil
	case err == nil:
		return errFloorKeyFound
	}
	return fmt.Errorf("floor: read: %w", err)
}

// pgFloor runs the floor scenarios on pool, whose Store is s. floor sends
// what Do sends for a fresh key: BEGIN and the read in one batch (Do's
// BEGIN and deferred claim), the shape, then the INSERT and COMMIT in one
// batch (Do's completion). floorlock is the same with the key's advisory
// lock taken in the first batch, before the read, as Do's claim takes it.
func pgFloor(pool *pgxpool.Pool, s *idem.Store[pgx.Tx]) *floorRunner[pgx.Tx] {
	return &floorRunner[pgx.Tx]{do: pgFloorDo(pool, false), lock: pgFloorDo(pool, true), tx: pgFloorTx(s), close: func() {}}
}

// pgFloorDo is floor's operation on pool, floorlock's with lock.
func pgFloorDo(pool *pgxpool.Pool, lock bool) func(ctx context.Context, insert func(context.Context, pgx.Tx, string) error, scope string) error {
	return func(ctx context.Context, insert func(context.Context, pgx.Tx, string) error, scope string) (err error) {
		r := newFloorRow(scope, workload.NewKey())
		conn, err := pool.Acquire(ctx)
		if err != nil {
			return fmt.Errorf("floor: acquire: %w", err)
		}
		defer conn.Release()
		b := &pgx.Batch{}
		b.BeginTx(pgx.TxOptions{})
		if lock {
			b.Queue(pgFloorTryLock, r.scope, r.key)
		}
		b.Queue(pgFloorRead, r.scope, r.key)
		br := conn.Conn().SendBatch(ctx, b)
		tx := br.Tx()
		_, err = br.Exec()
		if err == nil && lock {
			var locked bool
			if err = br.QueryRow().Scan(&locked); err == nil && !locked {
				err = errors.New("floorlock: a fresh key's lock is held")
			}
		}
		if err == nil {
			err = pgFloorScan(br.QueryRow())
		}
		if cerr := br.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("floor: begin: %w", cerr)
		}
		committed := false
		defer func() {
			if !committed {
				_ = tx.Rollback(context.WithoutCancel(ctx))
			}
		}()
		if err != nil {
			return err
		}
		if err := insert(ctx, tx, scope); err != nil {
			return err
		}
		b = &pgx.Batch{}
		b.Queue(pgFloorInsert, r.args()...)
		b.Queue("COMMIT")
		br = tx.SendBatch(ctx, b)
		_, err = br.Exec()
		var tag pgconn.CommandTag
		if err == nil {
			tag, err = br.Exec()
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err == nil && tag.String() != "COMMIT" {
			err = fmt.Errorf("floor: commit: %s", tag)
		}
		if err != nil {
			return fmt.Errorf("floor: complete: %w", err)
		}
		// COMMIT ran on the server; pgx's transaction, which does not
		// know it, is dropped, and the idle connection released.
		committed = true
		return nil
	}
}

// pgFloorTx is floortx's operation on s.
func pgFloorTx(s *idem.Store[pgx.Tx]) func(ctx context.Context, insert func(context.Context, pgx.Tx, string) error, scope string) error {
	return floorTxOp(s,
		func(ctx context.Context, tx pgx.Tx, r *floorRow) error {
			return pgFloorScan(tx.QueryRow(ctx, pgFloorRead, r.scope, r.key))
		},
		func(ctx context.Context, tx pgx.Tx, r *floorRow) error {
			_, err := tx.Exec(ctx, pgFloorInsert, r.args()...)
			return err
		})
}

// newPGBackend returns the PostgreSQL backend on the server of url; each
// namespace is a schema in url's database.
func newPGBackend(ctx context.Context, url string) (*backend[pgx.Tx], error) {
	server, err := pgPool(ctx, url, "", 2, "")
	if err != nil {
		return nil, err
	}
	b := &backend[pgx.Tx]{
		name:       "postgres",
		dialect:    workload.Postgres,
		sql:        pgStatements,
		serverAddr: net.JoinHostPort(server.Config().ConnConfig.Host, strconv.Itoa(int(server.Config().ConnConfig.Port))),
		business:   workload.PGBusiness,
		close:      server.Close,
		version: func(ctx context.Context) (string, error) {
			var v string
			err := server.QueryRow(ctx, `SHOW server_version`).Scan(&v)
			return "PostgreSQL " + v, err
		},
		create: func(ctx context.Context, ns string) (bool, error) {
			// Names are made by the tool (idembench_ and hex or digits),
			// never by user input; identifiers cannot be parameters.
			_, err := server.Exec(ctx, "CREATE SCHEMA "+ns)
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42P06" { // duplicate_schema
				return true, nil
			}
			if err != nil {
				return false, err
			}
			p, err := pgPool(ctx, url, ns, 2, "")
			if err != nil {
				return false, err
			}
			defer p.Close()
			if err := idempg.Migrate(ctx, p); err != nil {
				return false, fmt.Errorf("migrate: %w", err)
			}
			for _, q := range append(workload.Tables(workload.Postgres), pgFloorTable) {
				if _, err := p.Exec(ctx, q); err != nil {
					return false, err
				}
			}
			return false, workload.FillProducts(ctx, workload.Postgres, pgAdmin{p}.exec)
		},
		drop: func(ctx context.Context, ns string) error {
			_, err := server.Exec(ctx, "DROP SCHEMA IF EXISTS "+ns+" CASCADE")
			return err
		},
	}
	b.open = func(ctx context.Context, ns string, conns int, via string) (*pools[pgx.Tx], error) {
		pool, err := pgPool(ctx, url, ns, conns, via)
		if err != nil {
			return nil, err
		}
		adm, err := pgPool(ctx, url, ns, 1, "")
		if err != nil {
			pool.Close()
			return nil, err
		}
		store, err := idem.New(idempg.New(pool), b.storeCfg)
		if err != nil {
			pool.Close()
			adm.Close()
			return nil, err
		}
		pkSelect := func(ctx context.Context, scope, key string) error {
			var (
				status       int16
				fp, hdr, bdy []byte
				code         int32
				expires      time.Time
			)
			return pool.QueryRow(ctx, pgSelect, scope, key).Scan(&status, &fp, &code, &hdr, &bdy, &expires)
		}
		return &pools[pgx.Tx]{
			store: store, readStore: store, admin: pgAdmin{adm}, floorKeyLock: true,
			pkSelect: pkSelect, storePKSelect: pkSelect,
			openFloor: func(context.Context, bool) (*floorRunner[pgx.Tx], error) { return pgFloor(pool, store), nil },
			close:     func() { pool.Close(); adm.Close() },
		}, nil
	}
	return b, nil
}

// pgPool opens a pool of conns connections whose search_path is schema
// (the server's default when empty), all connected before it returns so
// that no measurement pays for a connection; via, when not empty, is the
// host:port to connect to instead of the server's (the latency proxy).
func pgPool(ctx context.Context, url, schema string, conns int, via string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	if via != "" {
		host, port, err := net.SplitHostPort(via)
		if err != nil {
			return nil, fmt.Errorf("postgres: proxy: %w", err)
		}
		n, err := strconv.ParseUint(port, 10, 16)
		if err != nil {
			return nil, fmt.Errorf("postgres: proxy: %w", err)
		}
		cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(n)
		cfg.ConnConfig.Fallbacks = nil
	}
	cfg.MaxConns, cfg.MinConns = int32(conns), int32(conns) //nolint:gosec // small worker counts
	if schema != "" {
		cfg.ConnConfig.RuntimeParams["search_path"] = schema
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	held := make([]*pgxpool.Conn, 0, conns)
	defer func() {
		for _, c := range held {
			c.Release()
		}
	}()
	for range conns {
		c, err := pool.Acquire(ctx)
		if err != nil {
			pool.Close()
			return nil, fmt.Errorf("postgres: connect: %w", err)
		}
		held = append(held, c)
	}
	return pool, nil
}
