package mysql_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	idemmysql "github.com/idemstore/idem/mysql"
)

func TestClassify(t *testing.T) {
	t.Parallel()
	own := errors.New("the application's own error")
	for _, tc := range []struct {
		err  error
		want error // nil: returned unchanged
	}{
		{&gomysql.MySQLError{Number: 1213, Message: "Deadlock found when trying to get lock; try restarting transaction"}, idem.ErrRetryable},
		{&gomysql.MySQLError{Number: 1205}, idem.ErrRetryable},
		{&gomysql.MySQLError{Number: 1020}, idem.ErrRetryable},
		{&gomysql.MySQLError{Number: 1047, Message: "WSREP has not yet prepared node for application use"}, idem.ErrStoreUnavailable},
		{&gomysql.MySQLError{Number: 1180, Message: `Got error 6 "No such device or address" during COMMIT`}, idem.ErrStoreUnavailable},
		{&gomysql.MySQLError{Number: 1290}, idem.ErrStoreUnavailable},
		{&gomysql.MySQLError{Number: 1040}, idem.ErrStoreUnavailable},
		{&gomysql.MySQLError{Number: 1053}, idem.ErrStoreUnavailable},
		{&gomysql.MySQLError{Number: 1927}, idem.ErrStoreUnavailable},
		{fmt.Errorf("exec: %w", &gomysql.MySQLError{Number: 1213}), idem.ErrRetryable},
		{driver.ErrBadConn, idem.ErrStoreUnavailable},
		{gomysql.ErrInvalidConn, idem.ErrStoreUnavailable},
		{sql.ErrConnDone, idem.ErrStoreUnavailable},
		{&net.OpError{Op: "read", Err: errors.New("connection reset by peer")}, idem.ErrStoreUnavailable},
		// Left alone: the caller's own errors and server errors of no class.
		{own, nil},
		{&gomysql.MySQLError{Number: 1062, Message: "Duplicate entry"}, nil},
		{&gomysql.MySQLError{Number: 1146}, nil},
		{context.Canceled, nil},
		{context.DeadlineExceeded, nil},
		{sql.ErrNoRows, nil},
	} {
		got := idemmysql.Classify(tc.err)
		require.ErrorIs(t, got, tc.err, "%v", tc.err)
		if tc.want == nil {
			require.True(t, tc.err == got, "%v must be returned unchanged", tc.err) //nolint:errorlint // identity is the point
			continue
		}
		require.ErrorIs(t, got, tc.want, "%v", tc.err)
		other := idem.ErrStoreUnavailable
		if tc.want == idem.ErrStoreUnavailable {
			other = idem.ErrRetryable
		}
		require.NotErrorIs(t, got, other, "%v", tc.err)
		var myErr *gomysql.MySQLError
		require.Equal(t, errors.As(tc.err, &myErr), errors.As(got, &myErr))
		// Classified once is classified: no double wrapping.
		require.Same(t, got, idemmysql.Classify(got))
	}
	require.NoError(t, idemmysql.Classify(nil))

	// The Store exposes the dialect's classifier to ClaimTx callers.
	s, err := idem.New(idemmysql.New(&sql.DB{}), nil)
	require.NoError(t, err)
	require.ErrorIs(t, s.Classify(&gomysql.MySQLError{Number: 1213}), idem.ErrRetryable)
	require.True(t, own == s.Classify(own)) //nolint:errorlint // identity is the point
	require.NoError(t, s.Classify(nil))
}

// TestDoRetriesDeadlockOfCallback: a deadlock met by the callback's own
// statements (two Do calls locking two rows in opposite orders) is retried
// by Do, so both calls succeed, each effect exactly once. Before the
// dialect classified callback errors, the victim got a raw 1213.
func TestDoRetriesDeadlockOfCallback(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, newPlain, true)
	_, err := b.db.ExecContext(ctx, `CREATE TABLE stock (id INT PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB`)
	require.NoError(t, err)
	_, err = b.db.ExecContext(ctx, `INSERT INTO stock VALUES (1, 0), (2, 0)`)
	require.NoError(t, err)
	s := b.store(t, &idem.Config{MaxTxRetries: 5})

	// Both callbacks hold their first row before either asks for its
	// second, on the first try only, so the deadlock is certain.
	var ready sync.WaitGroup
	ready.Add(2)
	tries := [2]int{}
	do := func(i int, first, second int) error {
		_, err := s.Do(ctx, "deadlock", fmt.Sprintf("k%d", i), idem.Fingerprint{}, func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
			tries[i]++
			if _, err := tx.ExecContext(ctx, `UPDATE stock SET n = n + 1 WHERE id = ?`, first); err != nil {
				return nil, err
			}
			if tries[i] == 1 {
				ready.Done()
				ready.Wait()
			}
			if _, err := tx.ExecContext(ctx, `UPDATE stock SET n = n + 1 WHERE id = ?`, second); err != nil {
				return nil, err
			}
			if _, err := tx.ExecContext(ctx, `INSERT INTO orders (ref) VALUES (?)`, fmt.Sprintf("k%d", i)); err != nil {
				return nil, err
			}
			return &idem.Response{StatusCode: 201}, nil
		})
		return err
	}
	errs := make(chan error, 2)
	go func() { errs <- do(0, 1, 2) }()
	go func() { errs <- do(1, 2, 1) }()
	for range 2 {
		select {
		case err := <-errs:
			require.NoError(t, err)
		case <-time.After(60 * time.Second):
			t.Fatal("Do calls did not finish")
		}
	}
	require.Equal(t, 3, tries[0]+tries[1], "exactly one of the two callbacks ran again after the deadlock")
	for _, ref := range []string{"k0", "k1"} {
		n, err := b.countOrders(ctx, ref)
		require.NoError(t, err)
		require.Equal(t, 1, n, ref)
	}
	var total int
	require.NoError(t, b.db.QueryRowContext(ctx, `SELECT SUM(n) FROM stock`).Scan(&total))
	require.Equal(t, 4, total, "each callback's two updates committed once")
}
