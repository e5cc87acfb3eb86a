package mysql

import (
	"context"
	"database/sql/driver"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"
)

// refusingConn is a driver connection whose prepares all fail with
// prepareErr: a server cannot be made to refuse here without changing its
// global max_prepared_stmt_count, nor to report a rolled-back transaction
// at a prepare without a Galera cluster (TestGaleraCrossNodeRace has one).
type refusingConn struct {
	driverConn // nil: only the methods below are called
	prepareErr error
	prepares   int
	execs      int
}

func (c *refusingConn) PrepareContext(context.Context, string) (driver.Stmt, error) {
	c.prepares++
	return nil, c.prepareErr
}

func (c *refusingConn) ExecContext(context.Context, string, []driver.NamedValue) (driver.Result, error) {
	c.execs++
	return driver.RowsAffected(1), nil
}

func (c *refusingConn) QueryContext(context.Context, string, []driver.NamedValue) (driver.Rows, error) {
	c.execs++
	return nil, nil
}

// A statement marked preparedKey whose prepare the server refused goes as
// text, and the connection does not try to prepare it again; unmarked
// statements are never prepared.
func TestPreparedAfterRefusalSendsText(t *testing.T) {
	for _, number := range []uint16{erUnsupportedPS, erMaxPreparedStmts} {
		inner := &refusingConn{prepareErr: &gomysql.MySQLError{Number: number}}
		c := &pipeConn{driverConn: inner}
		marked := context.WithValue(context.Background(), preparedKey{}, true)
		for range 3 {
			_, err := c.ExecContext(marked, "UPDATE t SET a = ?", nil)
			require.NoError(t, err)
		}
		_, err := c.QueryContext(marked, "SELECT a FROM t", nil)
		require.NoError(t, err)
		require.Equal(t, 2, inner.prepares, "%d: a refused prepare is not tried again on its connection", number)
		require.Equal(t, 4, inner.execs, "%d: the text is sent instead", number)
		_, err = c.ExecContext(context.Background(), "UPDATE t SET b = ?", nil)
		require.NoError(t, err)
		require.Equal(t, 2, inner.prepares, "%d: an unmarked statement is not prepared", number)
		require.Equal(t, 5, inner.execs)
	}
}

// Any other prepare failure is the statement's: the text must not be sent
// after it. A deadlock victim's transaction (on Galera, one a replicated
// write set aborted) is reported at the first command after the abort,
// which may be this prepare; the server has rolled the transaction back,
// and the text would run outside it (a completion matching no row, a
// business statement committing on its own).
func TestPreparedFailureIsTheStatements(t *testing.T) {
	deadlock := &gomysql.MySQLError{Number: erLockDeadlock}
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"deadlock", deadlock},
		{"bad connection", driver.ErrBadConn},
		{"context", context.Canceled},
	} {
		inner := &refusingConn{prepareErr: tc.err}
		c := &pipeConn{driverConn: inner}
		marked := context.WithValue(context.Background(), preparedKey{}, true)
		_, err := c.ExecContext(marked, "UPDATE t SET a = ?", nil)
		require.ErrorIs(t, err, tc.err, tc.name)
		_, err = c.QueryContext(marked, "SELECT a FROM t", nil)
		require.ErrorIs(t, err, tc.err, tc.name)
		require.Zero(t, inner.execs, "%s: no text after a failed prepare", tc.name)
		_, err = c.ExecContext(marked, "UPDATE t SET a = ?", nil)
		require.ErrorIs(t, err, tc.err, tc.name)
		require.Equal(t, 3, inner.prepares, "%s: a failed prepare is not remembered: the next call prepares again", tc.name)
	}
}
