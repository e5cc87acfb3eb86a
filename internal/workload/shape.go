package workload

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Shape is the business transaction a request runs, the statements idem
// protects. The two shapes are those of the peer measurements
// (../shared/reference/peers.md), so that idem's figures sit beside theirs.
type Shape string

const (
	// Small inserts one order and reads its id back: 1 statement, 3 round
	// trips with BEGIN and COMMIT.
	Small Shape = "small"
	// Order locks a random product (SELECT … FOR UPDATE; SQLite has no FOR
	// UPDATE, its BEGIN IMMEDIATE holds the write lock), takes one unit of
	// its stock, inserts the order and reads its id back, and inserts 3
	// order lines referencing it: 6 statements, 8 round trips.
	Order Shape = "order"
)

// Shapes are the shapes, in the order the tools measure them.
var Shapes = []Shape{Small, Order}

// ParseShapes parses a comma-separated list of shapes ("small,order").
func ParseShapes(list string) ([]Shape, error) {
	var out []Shape
	for _, f := range strings.Split(list, ",") {
		s := Shape(strings.TrimSpace(f))
		if !slices.Contains(Shapes, s) {
			return nil, fmt.Errorf("unknown shape %q (want small or order)", f)
		}
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return out, nil
}

// Lines is the number of order lines the Order shape inserts per order.
const Lines = 3

// Products is the number of products Order picks from at random; with
// concurrent workers two orders rarely lock the same one.
const Products = 10_000

// InitialStock is every product's stock after FillProducts: enough that no
// run can exhaust it.
const InitialStock = 1_000_000_000

// ExpiredPrefix starts the scopes of the records the load tool seeds
// already expired for its reaper to delete; [Counts] leaves them out, so
// that the reaper's deletions do not hide or fake completions.
const ExpiredPrefix = "exp-"

// Dialect names the SQL dialect of a statement text.
type Dialect int

// The dialects.
const (
	Postgres Dialect = iota
	MySQL
	SQLite
)

// Tables returns the statements creating the tables every shape writes:
// orders (the only one Small writes), products and order_lines, in this
// order. orders is the table BenchmarkIdem has always used.
func Tables(d Dialect) []string {
	switch d {
	case Postgres:
		return []string{`CREATE TABLE orders (
		id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		tenant     text NOT NULL,
		amount     bigint NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now()
	)`, `CREATE TABLE products (
		id    bigint PRIMARY KEY,
		sku   text NOT NULL,
		price bigint NOT NULL,
		stock bigint NOT NULL
	)`, `CREATE TABLE order_lines (
		order_id   bigint NOT NULL REFERENCES orders (id),
		line_no    int NOT NULL,
		product_id bigint NOT NULL,
		sku        text NOT NULL,
		qty        int NOT NULL,
		price      bigint NOT NULL,
		PRIMARY KEY (order_id, line_no)
	)`}
	case MySQL:
		return []string{`CREATE TABLE orders (
		id         BIGINT AUTO_INCREMENT PRIMARY KEY,
		tenant     VARCHAR(255) NOT NULL,
		amount     BIGINT NOT NULL,
		created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
	) ENGINE = InnoDB`, `CREATE TABLE products (
		id    BIGINT PRIMARY KEY,
		sku   VARCHAR(64) NOT NULL,
		price BIGINT NOT NULL,
		stock BIGINT NOT NULL
	) ENGINE = InnoDB`, `CREATE TABLE order_lines (
		order_id   BIGINT NOT NULL,
		line_no    INT NOT NULL,
		product_id BIGINT NOT NULL,
		sku        VARCHAR(64) NOT NULL,
		qty        INT NOT NULL,
		price      BIGINT NOT NULL,
		PRIMARY KEY (order_id, line_no),
		FOREIGN KEY (order_id) REFERENCES orders (id)
	) ENGINE = InnoDB`}
	default:
		return []string{`CREATE TABLE orders (
		id         INTEGER PRIMARY KEY,
		tenant     TEXT NOT NULL,
		amount     INTEGER NOT NULL,
		created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP
	)`, `CREATE TABLE products (
		id    INTEGER PRIMARY KEY,
		sku   TEXT NOT NULL,
		price INTEGER NOT NULL,
		stock INTEGER NOT NULL
	)`, `CREATE TABLE order_lines (
		order_id   INTEGER NOT NULL REFERENCES orders (id),
		line_no    INTEGER NOT NULL,
		product_id INTEGER NOT NULL,
		sku        TEXT NOT NULL,
		qty        INTEGER NOT NULL,
		price      INTEGER NOT NULL,
		PRIMARY KEY (order_id, line_no)
	)`}
	}
}

// FillProducts inserts the Products products, with InitialStock each,
// through exec (the pool's or a connection's ExecContext), 1000 rows per
// statement.
func FillProducts(ctx context.Context, d Dialect, exec func(ctx context.Context, query string, args ...any) error) error {
	const chunk = 1000
	for lo := 1; lo <= Products; lo += chunk {
		var (
			q    strings.Builder
			args []any
		)
		q.WriteString("INSERT INTO products (id, sku, price, stock) VALUES ")
		for id := lo; id < lo+chunk && id <= Products; id++ {
			if id > lo {
				q.WriteString(", ")
			}
			if d == Postgres {
				n := len(args)
				fmt.Fprintf(&q, "($%d, $%d, $%d, $%d)", n+1, n+2, n+3, n+4)
			} else {
				q.WriteString("(?, ?, ?, ?)")
			}
			args = append(args, int64(id), fmt.Sprintf("SKU-%05d", id), int64(100+id%900), int64(InitialStock))
		}
		if err := exec(ctx, q.String(), args...); err != nil {
			return fmt.Errorf("fill products: %w", err)
		}
	}
	return nil
}

// Counts are what a write measurement is checked with: the orders, order
// lines and total stock written, and the idempotency records completed and
// not completed (records with an ExpiredPrefix scope left out).
type Counts struct {
	Orders, Lines, Stock, Completed, Pending int64
}

// CountsQuery returns the one statement reading [Counts] (no arguments;
// scan the columns in the order of the struct's fields).
func CountsQuery(d Dialect) string {
	sum := "COALESCE(SUM(stock), 0)"
	switch d {
	case Postgres:
		sum += "::bigint"
	case MySQL:
		sum = "CAST(" + sum + " AS SIGNED)"
	}
	return `SELECT (SELECT COUNT(*) FROM orders), (SELECT COUNT(*) FROM order_lines),
	(SELECT ` + sum + ` FROM products),
	(SELECT COUNT(*) FROM idempotency_keys WHERE status = 2 AND scope NOT LIKE '` + ExpiredPrefix + `%'),
	(SELECT COUNT(*) FROM idempotency_keys WHERE status <> 2 AND scope NOT LIKE '` + ExpiredPrefix + `%')`
}

// CheckWrites compares the counts after a measurement with those before
// it: the measurement made orders successful business transactions of
// shape s, and completed keys idempotency records (orders, or 0 when no
// record is written, as for the bare transaction). Every order must be
// there once, with its lines and its stock unit, each completion must
// match an order, and no record may be left pending. The error says what
// differs.
func CheckWrites(s Shape, before, after Counts, orders, keys int64) error {
	d := Counts{
		Orders: after.Orders - before.Orders, Lines: after.Lines - before.Lines,
		Stock: before.Stock - after.Stock, Completed: after.Completed - before.Completed, Pending: after.Pending,
	}
	wantLines, wantStock := int64(0), int64(0)
	if s == Order {
		wantLines, wantStock = Lines*orders, orders
	}
	var errs []error
	if d.Orders != orders {
		errs = append(errs, fmt.Errorf("%d orders written for %d successful operations", d.Orders, orders))
	}
	if d.Lines != wantLines {
		errs = append(errs, fmt.Errorf("%d order lines written, want %d", d.Lines, wantLines))
	}
	if d.Stock != wantStock {
		errs = append(errs, fmt.Errorf("stock went down by %d, want %d", d.Stock, wantStock))
	}
	if d.Completed != keys {
		errs = append(errs, fmt.Errorf("%d idempotency records completed, want %d", d.Completed, keys))
	}
	if d.Pending != 0 {
		errs = append(errs, fmt.Errorf("%d idempotency records left not completed", d.Pending))
	}
	if len(errs) > 0 {
		return fmt.Errorf("exactly-once check (%s): %w", s, errors.Join(errs...))
	}
	return nil
}

// product picks the product an order takes.
func product() int64 { return 1 + rand.Int64N(Products) } //nolint:gosec // G404: workload randomness

// PGBusiness returns shape s's statements for PostgreSQL, run in tx for
// tenant.
func PGBusiness(s Shape) func(ctx context.Context, tx pgx.Tx, tenant string) error {
	if s == Small {
		return func(ctx context.Context, tx pgx.Tx, tenant string) error {
			var id int64
			return tx.QueryRow(ctx, `INSERT INTO orders (tenant, amount) VALUES ($1, 1999) RETURNING id`, tenant).Scan(&id)
		}
	}
	return func(ctx context.Context, tx pgx.Tx, tenant string) error {
		pid := product()
		var (
			sku          string
			price, stock int64
		)
		if err := tx.QueryRow(ctx, `SELECT sku, price, stock FROM products WHERE id = $1 FOR UPDATE`, pid).Scan(&sku, &price, &stock); err != nil {
			return fmt.Errorf("order: lock product: %w", err)
		}
		if stock < 1 {
			return errors.New("order: out of stock")
		}
		if _, err := tx.Exec(ctx, `UPDATE products SET stock = stock - 1 WHERE id = $1`, pid); err != nil {
			return fmt.Errorf("order: stock: %w", err)
		}
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO orders (tenant, amount) VALUES ($1, $2) RETURNING id`, tenant, Lines*price).Scan(&id); err != nil {
			return fmt.Errorf("order: insert: %w", err)
		}
		for line := 1; line <= Lines; line++ {
			if _, err := tx.Exec(ctx, `INSERT INTO order_lines (order_id, line_no, product_id, sku, qty, price) VALUES ($1, $2, $3, $4, 1, $5)`,
				id, line, pid, sku, price); err != nil {
				return fmt.Errorf("order: line: %w", err)
			}
		}
		return nil
	}
}

// SQLBusiness returns shape s's statements for MySQL/MariaDB or SQLite
// (database/sql), run in tx for tenant.
func SQLBusiness(s Shape, d Dialect) func(ctx context.Context, tx *sql.Tx, tenant string) error {
	if s == Small {
		return func(ctx context.Context, tx *sql.Tx, tenant string) error {
			res, err := tx.ExecContext(ctx, `INSERT INTO orders (tenant, amount) VALUES (?, 1999)`, tenant)
			if err != nil {
				return err
			}
			_, err = res.LastInsertId()
			return err
		}
	}
	lock := `SELECT sku, price, stock FROM products WHERE id = ? FOR UPDATE`
	if d == SQLite {
		// BEGIN IMMEDIATE already holds the database's write lock.
		lock = `SELECT sku, price, stock FROM products WHERE id = ?`
	}
	return func(ctx context.Context, tx *sql.Tx, tenant string) error {
		pid := product()
		var (
			sku          string
			price, stock int64
		)
		if err := tx.QueryRowContext(ctx, lock, pid).Scan(&sku, &price, &stock); err != nil {
			return fmt.Errorf("order: lock product: %w", err)
		}
		if stock < 1 {
			return errors.New("order: out of stock")
		}
		if _, err := tx.ExecContext(ctx, `UPDATE products SET stock = stock - 1 WHERE id = ?`, pid); err != nil {
			return fmt.Errorf("order: stock: %w", err)
		}
		res, err := tx.ExecContext(ctx, `INSERT INTO orders (tenant, amount) VALUES (?, ?)`, tenant, Lines*price)
		if err != nil {
			return fmt.Errorf("order: insert: %w", err)
		}
		id, err := res.LastInsertId()
		if err != nil {
			return fmt.Errorf("order: insert: %w", err)
		}
		for line := 1; line <= Lines; line++ {
			if _, err := tx.ExecContext(ctx, `INSERT INTO order_lines (order_id, line_no, product_id, sku, qty, price) VALUES (?, ?, ?, ?, 1, ?)`,
				id, line, pid, sku, price); err != nil {
				return fmt.Errorf("order: line: %w", err)
			}
		}
		return nil
	}
}
