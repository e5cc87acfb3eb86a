package mysql

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"math"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
)

// TestInterpretError covers the classes the public API cannot provoke: a
// duplicate key (the claim absorbs them) and client-side errors.
func TestInterpretError(t *testing.T) {
	t.Parallel()
	dsn := testdb.MySQLDSN(t, func(dsn string) (string, error) {
		cfg, err := gomysql.ParseDSN(dsn)
		if err != nil {
			return "", err
		}
		return cfg.Addr, nil
	})
	db, err := sql.Open("mysql", dsn)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	ctx := t.Context()
	conn, err := db.Conn(ctx) // temporary tables live on one connection
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	_, err = conn.ExecContext(ctx, "CREATE TEMPORARY TABLE idem_dup (k VARBINARY(64) PRIMARY KEY)")
	require.NoError(t, err)
	const rawKey = "raw-key-4711"
	_, err = conn.ExecContext(ctx, "INSERT INTO idem_dup VALUES (?), (?)", rawKey, rawKey)
	require.Error(t, err)
	require.True(t, isDupEntry(err))
	require.False(t, isDupEntry(interpretError(sql.ErrNoRows)))

	dup := interpretError(err)
	require.NotContains(t, dup.Error(), rawKey, "the server's message quotes the key")
	require.ErrorIs(t, dup, errUniqueViolation)
	require.NotErrorIs(t, dup, idem.ErrRetryable)
	require.NotErrorIs(t, dup, idem.ErrStoreUnavailable)
	var myErr *gomysql.MySQLError
	require.ErrorAs(t, dup, &myErr)
	require.EqualValues(t, erDupEntry, myErr.Number)

	require.ErrorIs(t, interpretError(sql.ErrNoRows), idem.ErrNotFound)
	require.NoError(t, interpretError(nil))
	for _, err := range []error{driver.ErrBadConn, gomysql.ErrInvalidConn, sql.ErrConnDone, context.DeadlineExceeded, errors.New("sql: database is closed")} {
		got := interpretError(err)
		require.ErrorIs(t, got, idem.ErrStoreUnavailable, "%v", err)
		require.ErrorIs(t, got, err)
	}
	for _, err := range []error{context.Canceled, sql.ErrTxDone} {
		got := interpretError(err)
		require.ErrorIs(t, got, err)
		require.NotErrorIs(t, got, idem.ErrStoreUnavailable, "%v", err)
	}
}

func TestLockWaitSeconds(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   time.Duration
		want int
	}{
		{0, 1},
		{-time.Second, 1},
		{time.Millisecond, 1},
		{time.Second, 1},
		{time.Second + time.Nanosecond, 2},
		{1500 * time.Millisecond, 2},
		{10 * time.Second, 10},
		{time.Duration(math.MaxInt64), 1073741824},
	} {
		require.Equal(t, tc.want, lockWaitSeconds(tc.in), "%v", tc.in)
	}
}
