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
// with the completion (see [Dialect.BeginClaim]). On MySQL and MariaDB
// alike, the claims and completions that cannot travel with BEGIN or COMMIT
// run prepared, once per connection (see the package documentation). Every
// other statement, the caller's included, goes to the driver unchanged.
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
	// preparedKey marks a statement to run prepared on its connection
	// (see pipeConn.prepared).
	preparedKey struct{}
)

// maxConnStmts bounds the statements a connection keeps prepared: idem
// marks two texts for it (the claim's, one per wait bound in use, and the
// completion's), so the bound is only a guard.
const maxConnStmts = 8

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
	// stmts are the preparedKey statements prepared on this connection, by
	// text. The server drops them with the connection.
	stmts map[string]driver.Stmt
}

// prepared returns query prepared on this connection when ctx marks it
// with preparedKey, preparing it on first use, and nil otherwise (then the
// text is sent as before). The statements marked are the claims and
// completions that cannot travel with BEGIN or COMMIT (ClaimTx's and
// CompleteTx's in a caller's transaction, the pool's leased claims and
// completions): in the text protocol the server parses each of them on
// every call (docs/performance-history.md, rounds 8 and 9).
//
// Only a server's refusal to prepare (isPrepareRefused) lets the text go
// instead, and the connection does not try that text again: a server that
// refuses costs one round trip per connection, not one per call. Any other
// failure is the statement's and is returned: the prepare is the first
// command the server sees after the statements before it, so it is where a
// transaction that was rolled back meanwhile, between two commands (on
// Galera, one that another node's write set aborted), reports it. Sending the text after
// that would run it outside the caller's transaction, which no longer
// exists: a completion would match no row and be reported fenced, a
// business statement would commit on its own.
func (c *pipeConn) prepared(ctx context.Context, query string) (driver.Stmt, error) {
	if ctx.Value(preparedKey{}) == nil {
		return nil, nil
	}
	if st, ok := c.stmts[query]; ok {
		return st, nil // nil after a refusal: the text, without trying again
	}
	if len(c.stmts) >= maxConnStmts {
		return nil, nil
	}
	st, err := c.driverConn.PrepareContext(ctx, query)
	if err != nil {
		if !isPrepareRefused(err) {
			return nil, err
		}
		st = nil
	}
	if c.stmts == nil {
		c.stmts = make(map[string]driver.Stmt, 2)
	}
	c.stmts[query] = st
	return st, nil
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
	if !begins {
		st, err := c.prepared(ctx, q)
		if err != nil {
			return nil, err
		}
		if st, ok := st.(driver.StmtQueryContext); ok {
			return st.QueryContext(ctx, args)
		}
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
	if !begins && ctx.Value(commitsKey{}) == nil {
		st, err := c.prepared(ctx, q)
		if err != nil {
			return nil, err
		}
		if st, ok := st.(driver.StmtExecContext); ok {
			return st.ExecContext(ctx, args)
		}
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
