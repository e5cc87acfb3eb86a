package mysql

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"

	gomysql "github.com/go-sql-driver/mysql"
)

// NewConnector returns a connector for [database/sql.OpenDB] that opens the
// connections cfg describes (interpolateParams turned on in a copy; cfg is
// not changed) through a thin layer of this package. On MariaDB, a [Dialect]
// over such a pool saves two round trips in every [idem.Store.Do]: the
// transaction's START TRANSACTION travels with the claim, and its COMMIT
// with the completion (see [Dialect.BeginClaim]). Every other statement,
// the caller's included, goes to the driver unchanged; MySQL gains nothing
// and loses nothing.
//
// database/sql sends START TRANSACTION by itself when a transaction begins
// and COMMIT when it commits, one round trip each, with nothing a library
// can attach to them: the pool must be opened through this connector for
// those two round trips to carry idem's statements.
func NewConnector(cfg *gomysql.Config) (driver.Connector, error) {
	c := cfg.Clone()
	// The statements that carry BEGIN or COMMIT are MariaDB compound
	// statements, which the server cannot prepare: their parameters are
	// interpolated by the driver, which escapes them.
	c.InterpolateParams = true
	inner, err := gomysql.NewConnector(c)
	if err != nil {
		return nil, fmt.Errorf("idem: mysql: %w", err)
	}
	return &connector{inner: inner}, nil
}

// connector opens pipeConns.
type connector struct{ inner driver.Connector }

func (c *connector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.inner.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return wrapConn(conn)
}

func (c *connector) Driver() driver.Driver { return pipeDriver{inner: c.inner.Driver()} }

// pipeDriver is the Driver of a pool opened with NewConnector: New
// recognises the pool by it.
type pipeDriver struct{ inner driver.Driver }

func (d pipeDriver) Open(name string) (driver.Conn, error) {
	conn, err := d.inner.Open(name)
	if err != nil {
		return nil, err
	}
	return wrapConn(conn)
}

// driverConn is every interface of go-sql-driver's connection, which
// pipeConn forwards so that database/sql treats it exactly as the driver's.
type driverConn interface {
	driver.Conn
	driver.ConnBeginTx
	driver.ConnPrepareContext
	driver.ExecerContext
	driver.QueryerContext
	driver.Pinger
	driver.SessionResetter
	driver.Validator
	driver.NamedValueChecker
}

func wrapConn(conn driver.Conn) (driver.Conn, error) {
	dc, ok := conn.(driverConn)
	if !ok {
		_ = conn.Close()
		return nil, fmt.Errorf("idem: mysql: the driver's connection %T lacks methods database/sql uses", conn)
	}
	return &pipeConn{driverConn: dc}, nil
}

// Context keys of the pipelined statements (see Dialect.BeginClaim).
type (
	// lazyBeginKey marks the BeginTx of a transaction whose START
	// TRANSACTION is to travel with its first statement.
	lazyBeginKey struct{}
	// firstStatementKey holds, for a statement, the text to send instead
	// when it is the first of a lazily begun transaction: the statement
	// and START TRANSACTION in one.
	firstStatementKey struct{}
	// commitsKey marks a statement that commits the transaction.
	commitsKey struct{}
)

// errNoCompound is returned for a statement that commits when the driver
// cannot send it as text (its interpolated text would exceed
// max_allowed_packet): it must not be prepared, the server cannot prepare
// it. The caller sends the completion and COMMIT apart instead.
var errNoCompound = errors.New("idem: mysql: statement too large to send with COMMIT")

// pipeConn is a driver connection whose transactions can be begun lazily:
// BeginTx with lazyBeginKey sends nothing, and the transaction's first
// statement either carries START TRANSACTION (its firstStatementKey text)
// or is preceded by it. database/sql never uses a connection from two
// goroutines at once, so its fields need no lock.
type pipeConn struct {
	driverConn
	// lazy: a transaction was begun and START TRANSACTION not yet sent.
	lazy bool
	// committed: a statement with commitsKey committed the transaction.
	committed bool
}

func (c *pipeConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	if ctx.Value(lazyBeginKey{}) == nil || opts != (driver.TxOptions{}) {
		return c.driverConn.BeginTx(ctx, opts)
	}
	c.lazy, c.committed = true, false
	return (*pipeTx)(c), nil
}

// beginPlain sends START TRANSACTION if a lazy transaction has not been
// begun yet.
func (c *pipeConn) beginPlain(ctx context.Context) error {
	if !c.lazy {
		return nil
	}
	c.lazy = false
	_, err := c.driverConn.ExecContext(ctx, "START TRANSACTION", nil)
	return err
}

// first returns the text to send for query and whether it is the text of
// firstStatementKey, which begins the transaction.
func (c *pipeConn) first(ctx context.Context, query string) (string, bool, error) {
	if c.lazy {
		if alt, ok := ctx.Value(firstStatementKey{}).(string); ok {
			c.lazy = false
			return alt, true, nil
		}
	}
	return query, false, c.beginPlain(ctx)
}

func (c *pipeConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	q, begins, err := c.first(ctx, query)
	if err != nil {
		return nil, err
	}
	rows, err := c.driverConn.QueryContext(ctx, q, args)
	if begins && errors.Is(err, driver.ErrSkip) {
		// Nothing was sent: database/sql prepares query, and
		// PrepareContext sends START TRANSACTION first.
		c.lazy = true
	}
	return rows, err
}

func (c *pipeConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	q, begins, err := c.first(ctx, query)
	if err != nil {
		return nil, err
	}
	res, err := c.driverConn.ExecContext(ctx, q, args)
	switch {
	case begins && errors.Is(err, driver.ErrSkip):
		c.lazy = true
	case ctx.Value(commitsKey{}) == nil:
	case errors.Is(err, driver.ErrSkip):
		return nil, errNoCompound
	case err == nil:
		c.committed = true
	}
	return res, err
}

func (c *pipeConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	if err := c.beginPlain(ctx); err != nil {
		return nil, err
	}
	return c.driverConn.PrepareContext(ctx, query)
}

func (c *pipeConn) ResetSession(ctx context.Context) error {
	c.lazy, c.committed = false, false
	return c.driverConn.ResetSession(ctx)
}

// pipeTx is the transaction of a lazy BeginTx.
type pipeTx pipeConn

// Commit sends COMMIT unless the transaction was never begun or a
// statement committed it already.
func (t *pipeTx) Commit() error { return t.end("COMMIT") }

// Rollback sends ROLLBACK unless the transaction was never begun or a
// statement committed it already.
func (t *pipeTx) Rollback() error { return t.end("ROLLBACK") }

func (t *pipeTx) end(stmt string) error {
	c := (*pipeConn)(t)
	skip := c.lazy || c.committed
	c.lazy, c.committed = false, false
	if skip {
		return nil
	}
	_, err := c.driverConn.ExecContext(context.Background(), stmt, nil)
	return err
}
