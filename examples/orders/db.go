package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemstore/idem"
	idemmysql "github.com/idemstore/idem/mysql"
	idempg "github.com/idemstore/idem/postgres"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

const (
	dialectSQLite   = "sqlite"
	dialectPostgres = "postgres"
	dialectMySQL    = "mysql"
)

// database is an opened, migrated database, whatever its dialect.
type database struct {
	dialect  string
	describe string // for the ready line; never holds a password
	close    func()
	// service builds the API over this database: the idem store, its
	// reaper and the routes.
	service func(ctx context.Context, o *options, logger *slog.Logger) (*service, error)
	// countOrders counts a tenant's orders, for the demo's table.
	countOrders func(ctx context.Context, tenant string) (int, error)
}

// service is the API, ready to serve.
type service struct {
	handler http.Handler
	// token returns a bearer token for a tenant (auth.go).
	token func(tenant string) string
	// reap runs the reaper until ctx ends.
	reap func(ctx context.Context)
	// providerCalls counts the payment provider's charge calls, for the
	// demo's table.
	providerCalls func() int
}

// openDatabase opens the database named by spec (see the -db flag), applies
// idem's migrations and creates the orders table if it is missing. schema
// (the -schema flag) names the PostgreSQL schema of every table; empty: the
// tables the connection's search_path finds.
func openDatabase(ctx context.Context, spec, schema string) (*database, error) {
	isPostgres := strings.HasPrefix(spec, "postgres://") || strings.HasPrefix(spec, "postgresql://")
	if schema != "" && !isPostgres {
		return nil, errors.New("-schema: only for a postgres:// -db")
	}
	switch {
	case isPostgres:
		return openPostgres(ctx, spec, schema)
	case strings.HasPrefix(spec, "mysql://"):
		return openMySQL(ctx, strings.TrimPrefix(spec, "mysql://"))
	case spec == "":
		dir, err := os.MkdirTemp("", "idem-orders-")
		if err != nil {
			return nil, err
		}
		db, err := openSQLite(ctx, filepath.Join(dir, "orders.db"))
		if err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
		closeDB := db.close
		db.close = func() { closeDB(); _ = os.RemoveAll(dir) }
		return db, nil
	default:
		return openSQLite(ctx, spec)
	}
}

func openSQLite(ctx context.Context, path string) (*database, error) {
	db, err := idemsqlite.Open(path)
	if err != nil {
		return nil, err
	}
	if err := prepare(ctx, func() error { return idemsqlite.Migrate(ctx, db) }, func(q string) error {
		_, err := db.ExecContext(ctx, q)
		return err
	}, sqliteSchema, sqlitePayments); err != nil {
		_ = db.Close()
		return nil, err
	}
	table, err := idemsqlite.NewTableBodyStore(db, nil)
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	return newDatabase(dialectSQLite, "SQLite file "+path, idemsqlite.New(db), table, &sqlOrders{db: db}, func() { _ = db.Close() }), nil
}

// openPostgres opens a pgx URL. Its default_query_exec_mode parameter
// picks pgx's exec mode: through a transaction pooler such as PgBouncer it
// must be one that keeps no prepared statement across transactions
// (simple_protocol or exec; see the postgres package's documentation). With
// a schema, idem's table and the service's own are all named in it, so no
// search_path (which a transaction pooler does not keep) decides which
// tables the service writes.
func openPostgres(ctx context.Context, url, schema string) (*database, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("-db: %w", err)
	}
	var opts []idempg.Option
	if schema != "" {
		opts = append(opts, idempg.WithSchema(schema))
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	orders := newPGOrders(pool, schema)
	if err := prepare(ctx, func() error { return idempg.Migrate(ctx, pool, opts...) }, func(q string) error {
		_, err := pool.Exec(ctx, q)
		return err
	}, fmt.Sprintf(postgresSchema, orders.orders), fmt.Sprintf(postgresPayments, orders.payments)); err != nil {
		pool.Close()
		return nil, err
	}
	describe := fmt.Sprintf("PostgreSQL %s:%d/%s", cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Database)
	if schema != "" {
		describe += ", schema " + schema
	}
	table, err := idempg.NewTableBodyStore(pool, nil, opts...)
	if err != nil {
		pool.Close()
		return nil, err
	}
	return newDatabase(dialectPostgres, describe, idempg.New(pool, opts...), table, orders, pool.Close), nil
}

// openMySQL opens a go-sql-driver DSN, adding the parameters idem needs:
// parseTime=true and loc=UTC, plus interpolateParams=true to save a round
// trip per statement.
func openMySQL(ctx context.Context, dsn string) (*database, error) {
	cfg, err := gomysql.ParseDSN(dsn)
	if err != nil {
		return nil, fmt.Errorf("-db: %w", err)
	}
	if cfg.DBName == "" {
		return nil, errors.New("-db: the mysql:// DSN must name a database, as in mysql://root@tcp(127.0.0.1:3306)/shop")
	}
	cfg.ParseTime = true
	cfg.Loc = time.UTC
	cfg.InterpolateParams = true
	// idem's connector: on MariaDB, Do's BEGIN travels with its claim and
	// its COMMIT with its completion (two round trips fewer per request).
	conn, err := idemmysql.NewConnector(cfg)
	if err != nil {
		return nil, err
	}
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(10)
	db.SetMaxIdleConns(10)
	if err := prepare(ctx, func() error { return idemmysql.Migrate(ctx, db) }, func(q string) error {
		_, err := db.ExecContext(ctx, q)
		return err
	}, mysqlSchema, mysqlPayments); err != nil {
		_ = db.Close()
		return nil, err
	}
	table, err := idemmysql.NewTableBodyStore(db, nil)
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	return newDatabase(dialectMySQL, "MySQL/MariaDB "+cfg.Addr+"/"+cfg.DBName, idemmysql.New(db), table, &sqlOrders{db: db}, func() { _ = db.Close() }), nil
}

// prepare applies idem's migrations, then the service's tables.
func prepare(ctx context.Context, migrate func() error, exec func(string) error, tables ...string) error {
	if err := migrate(); err != nil {
		return fmt.Errorf("migrate idem's table: %w", err)
	}
	for _, t := range tables {
		if err := exec(t); err != nil {
			return fmt.Errorf("create the service's tables: %w", err)
		}
	}
	return ctx.Err()
}

// newDatabase ties a dialect, whose transaction type is TTx, to the orders
// table on the same database; table is the dialect's table body store
// (-bodies table).
func newDatabase[TTx any](dialect, describe string, d idem.Dialect[TTx], table idem.BodyStore, orders orderRepo[TTx], closeFn func()) *database {
	return &database{
		dialect:  dialect,
		describe: describe,
		close:    closeFn,
		service: func(ctx context.Context, o *options, logger *slog.Logger) (*service, error) {
			prov := newProvider(o.providerDelay, o.providerURL)
			bodies, err := openBodyStore(o.bodyDir, table)
			if err != nil {
				return nil, err
			}
			if o.faultInjection {
				bodies = crashAfterPut[TTx](bodies) // test aid, see faults.go
			}
			store, err := idem.New(d, &idem.Config{
				// POST /exports' CSV, once over InlineBodyMax, is kept
				// in the body store; the record holds its address and
				// SHA-256, and the reaper sweeps it after the record.
				BodyStore:     bodies,
				InlineBodyMax: o.inlineBodyMax,
				LeaseDuration: o.lease,
				Retention:     o.retention,
				WaitTimeout:   o.waitTimeout,
				Logger:        logger,
				// A POST /payments whose holder crashed is resolved by
				// asking the provider, on the client's retry or by the
				// reaper.
				StatusCheck: prov.paymentStatus,
			})
			if err != nil {
				return nil, err
			}
			reaper, err := idem.NewReaper(store, &idem.ReaperConfig{Interval: o.reapInterval, BodySweepEvery: o.retention})
			if err != nil {
				return nil, err
			}
			auth := newAuthenticator(o.tokenSecret)
			a := &api[TTx]{orders: orders, delay: o.handlerDelay, provider: prov, auth: auth}
			handler, err := a.routes(store, logger)
			if err != nil {
				return nil, err
			}
			return &service{
				token:         auth.token,
				handler:       handler,
				reap:          func(ctx context.Context) { _ = reaper.Run(ctx) },
				providerCalls: prov.callCount,
			}, nil
		},
		countOrders: orders.count,
	}
}

// The orders table, with its own unique constraint on (tenant,
// idempotency_key): the business backstop, so that even a bug above it could
// not write a second order for one key. PostgreSQL's takes the table's
// (sanitised, possibly schema-qualified) name as %s.
const (
	postgresSchema = `CREATE TABLE IF NOT EXISTS %s (
	id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	tenant          text NOT NULL,
	idempotency_key text NOT NULL,
	sku             text NOT NULL,
	qty             bigint NOT NULL CHECK (qty > 0),
	amount_cents    bigint NOT NULL CHECK (amount_cents > 0),
	created_at      timestamptz NOT NULL,
	UNIQUE (tenant, idempotency_key)
)`
	mysqlSchema = `CREATE TABLE IF NOT EXISTS orders (
	id              BIGINT AUTO_INCREMENT PRIMARY KEY,
	tenant          VARCHAR(255) NOT NULL,
	idempotency_key VARBINARY(255) NOT NULL,
	sku             VARCHAR(255) NOT NULL,
	qty             BIGINT NOT NULL CHECK (qty > 0),
	amount_cents    BIGINT NOT NULL CHECK (amount_cents > 0),
	created_at      DATETIME(6) NOT NULL,
	UNIQUE KEY orders_tenant_key (tenant, idempotency_key)
) ENGINE = InnoDB`
	sqliteSchema = `CREATE TABLE IF NOT EXISTS orders (
	id              INTEGER PRIMARY KEY,
	tenant          TEXT NOT NULL,
	idempotency_key TEXT NOT NULL,
	sku             TEXT NOT NULL,
	qty             INTEGER NOT NULL CHECK (qty > 0),
	amount_cents    INTEGER NOT NULL CHECK (amount_cents > 0),
	created_at      DATETIME NOT NULL,
	UNIQUE (tenant, idempotency_key)
)`
)

// The payments table, with the same backstop.
const (
	postgresPayments = `CREATE TABLE IF NOT EXISTS %s (
	id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	tenant          text NOT NULL,
	idempotency_key text NOT NULL,
	charge_id       text NOT NULL,
	amount_cents    bigint NOT NULL CHECK (amount_cents > 0),
	created_at      timestamptz NOT NULL,
	UNIQUE (tenant, idempotency_key)
)`
	mysqlPayments = `CREATE TABLE IF NOT EXISTS payments (
	id              BIGINT AUTO_INCREMENT PRIMARY KEY,
	tenant          VARCHAR(255) NOT NULL,
	idempotency_key VARBINARY(255) NOT NULL,
	charge_id       VARCHAR(255) NOT NULL,
	amount_cents    BIGINT NOT NULL CHECK (amount_cents > 0),
	created_at      DATETIME(6) NOT NULL,
	UNIQUE KEY payments_tenant_key (tenant, idempotency_key)
) ENGINE = InnoDB`
	sqlitePayments = `CREATE TABLE IF NOT EXISTS payments (
	id              INTEGER PRIMARY KEY,
	tenant          TEXT NOT NULL,
	idempotency_key TEXT NOT NULL,
	charge_id       TEXT NOT NULL,
	amount_cents    INTEGER NOT NULL CHECK (amount_cents > 0),
	created_at      DATETIME NOT NULL,
	UNIQUE (tenant, idempotency_key)
)`
)

// order is one row of the orders table, and its JSON form.
type order struct {
	ID          int64     `json:"id"`
	Tenant      string    `json:"tenant"`
	SKU         string    `json:"sku"`
	Qty         int64     `json:"qty"`
	AmountCents int64     `json:"amount_cents"`
	CreatedAt   time.Time `json:"created_at"`
}

// errNoOrder is returned when a tenant has no order with the ID asked for.
var errNoOrder = errors.New("no such order")

// orderRepo reads and writes orders, and writes payments; the inserts run
// on the transaction the middleware gives the handler.
type orderRepo[TTx any] interface {
	insert(ctx context.Context, tx TTx, key string, o *order) error
	insertPayment(ctx context.Context, tx TTx, key string, p *payment) error
	get(ctx context.Context, tenant string, id int64) (*order, error)
	list(ctx context.Context, tenant string) ([]order, error)
	count(ctx context.Context, tenant string) (int, error)
}

// pgOrders is orderRepo on PostgreSQL.
type pgOrders struct {
	pool *pgxpool.Pool
	// orders and payments are the tables' names, sanitised identifiers
	// (quoted; schema-qualified with -schema), safe to put in SQL text.
	orders, payments string
}

// newPGOrders names the tables in schema, or unqualified when it is empty.
func newPGOrders(pool *pgxpool.Pool, schema string) *pgOrders {
	name := func(table string) string {
		if schema == "" {
			return pgx.Identifier{table}.Sanitize()
		}
		return pgx.Identifier{schema, table}.Sanitize()
	}
	return &pgOrders{pool: pool, orders: name("orders"), payments: name("payments")}
}

func (p *pgOrders) insert(ctx context.Context, tx pgx.Tx, key string, o *order) error {
	return tx.QueryRow(ctx, `INSERT INTO `+p.orders+` (tenant, idempotency_key, sku, qty, amount_cents, created_at)
		VALUES ($1, $2, $3, $4, $5, $6) RETURNING id`,
		o.Tenant, key, o.SKU, o.Qty, o.AmountCents, o.CreatedAt).Scan(&o.ID)
}

func (p *pgOrders) insertPayment(ctx context.Context, tx pgx.Tx, key string, pm *payment) error {
	return tx.QueryRow(ctx, `INSERT INTO `+p.payments+` (tenant, idempotency_key, charge_id, amount_cents, created_at)
		VALUES ($1, $2, $3, $4, $5) RETURNING id`,
		pm.Tenant, key, pm.ChargeID, pm.AmountCents, pm.CreatedAt).Scan(&pm.ID)
}

func (p *pgOrders) get(ctx context.Context, tenant string, id int64) (*order, error) {
	o := &order{}
	err := p.pool.QueryRow(ctx, `SELECT id, tenant, sku, qty, amount_cents, created_at
		FROM `+p.orders+` WHERE tenant = $1 AND id = $2`, tenant, id).
		Scan(&o.ID, &o.Tenant, &o.SKU, &o.Qty, &o.AmountCents, &o.CreatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errNoOrder
	}
	o.CreatedAt = o.CreatedAt.UTC()
	return o, err
}

func (p *pgOrders) list(ctx context.Context, tenant string) ([]order, error) {
	rows, err := p.pool.Query(ctx, `SELECT id, tenant, sku, qty, amount_cents, created_at
		FROM `+p.orders+` WHERE tenant = $1 ORDER BY id`, tenant)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (order, error) {
		var o order
		err := row.Scan(&o.ID, &o.Tenant, &o.SKU, &o.Qty, &o.AmountCents, &o.CreatedAt)
		o.CreatedAt = o.CreatedAt.UTC()
		return o, err
	})
}

func (p *pgOrders) count(ctx context.Context, tenant string) (int, error) {
	var n int
	err := p.pool.QueryRow(ctx, `SELECT count(*) FROM `+p.orders+` WHERE tenant = $1`, tenant).Scan(&n)
	return n, err
}

// sqlOrders is orderRepo on database/sql, for MySQL and SQLite. Both
// drivers read a DATETIME column back into a time.Time.
type sqlOrders struct{ db *sql.DB }

func (s *sqlOrders) insert(ctx context.Context, tx *sql.Tx, key string, o *order) error {
	res, err := tx.ExecContext(ctx, `INSERT INTO orders (tenant, idempotency_key, sku, qty, amount_cents, created_at)
		VALUES (?, ?, ?, ?, ?, ?)`, o.Tenant, key, o.SKU, o.Qty, o.AmountCents, o.CreatedAt)
	if err != nil {
		return err
	}
	o.ID, err = res.LastInsertId()
	return err
}

func (s *sqlOrders) insertPayment(ctx context.Context, tx *sql.Tx, key string, p *payment) error {
	res, err := tx.ExecContext(ctx, `INSERT INTO payments (tenant, idempotency_key, charge_id, amount_cents, created_at)
		VALUES (?, ?, ?, ?, ?)`, p.Tenant, key, p.ChargeID, p.AmountCents, p.CreatedAt)
	if err != nil {
		return err
	}
	p.ID, err = res.LastInsertId()
	return err
}

func (s *sqlOrders) get(ctx context.Context, tenant string, id int64) (*order, error) {
	o := &order{}
	err := s.db.QueryRowContext(ctx, `SELECT id, tenant, sku, qty, amount_cents, created_at
		FROM orders WHERE tenant = ? AND id = ?`, tenant, id).
		Scan(&o.ID, &o.Tenant, &o.SKU, &o.Qty, &o.AmountCents, &o.CreatedAt)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, errNoOrder
	}
	o.CreatedAt = o.CreatedAt.UTC()
	return o, err
}

func (s *sqlOrders) list(ctx context.Context, tenant string) ([]order, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT id, tenant, sku, qty, amount_cents, created_at
		FROM orders WHERE tenant = ? ORDER BY id`, tenant)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := []order{}
	for rows.Next() {
		var o order
		if err := rows.Scan(&o.ID, &o.Tenant, &o.SKU, &o.Qty, &o.AmountCents, &o.CreatedAt); err != nil {
			return nil, err
		}
		o.CreatedAt = o.CreatedAt.UTC()
		out = append(out, o)
	}
	return out, rows.Err()
}

func (s *sqlOrders) count(ctx context.Context, tenant string) (int, error) {
	var n int
	err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM orders WHERE tenant = ?`, tenant).Scan(&n)
	return n, err
}
