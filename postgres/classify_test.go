package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	idempg "github.com/idemstore/idem/postgres"
)

func TestClassify(t *testing.T) {
	t.Parallel()
	own := errors.New("the application's own error")
	for _, tc := range []struct {
		err  error
		want error // nil: returned unchanged
	}{
		{&pgconn.PgError{Code: "40001", Message: "could not serialize access due to concurrent update"}, idem.ErrRetryable},
		{&pgconn.PgError{Code: "40P01", Message: "deadlock detected"}, idem.ErrRetryable},
		{&pgconn.PgError{Code: "55P03"}, idem.ErrRetryable},
		{fmt.Errorf("exec: %w", &pgconn.PgError{Code: "40P01"}), idem.ErrRetryable},
		{&pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}, idem.ErrStoreUnavailable},
		{&pgconn.PgError{Code: "57P02"}, idem.ErrStoreUnavailable},
		{&pgconn.PgError{Code: "57P03", Message: "the database system is starting up"}, idem.ErrStoreUnavailable},
		{&pgconn.PgError{Code: "25006", Message: "cannot execute UPDATE in a read-only transaction"}, idem.ErrStoreUnavailable},
		{&pgconn.PgError{Code: "53300"}, idem.ErrStoreUnavailable},
		{&pgconn.PgError{Code: "08006"}, idem.ErrStoreUnavailable},
		{&net.OpError{Op: "read", Err: errors.New("connection reset by peer")}, idem.ErrStoreUnavailable},
		{fmt.Errorf("commit: %w", io.ErrUnexpectedEOF), idem.ErrStoreUnavailable},
		// Left alone: the caller's own errors and server errors of no class.
		{own, nil},
		{&pgconn.PgError{Code: "23505", Detail: "Key (ref)=(secret) already exists."}, nil},
		{&pgconn.PgError{Code: "42P01"}, nil},
		{&pgconn.PgError{Code: "08P01", Message: "unsupported startup parameter: search_path"}, nil},
		{context.Canceled, nil},
		{context.DeadlineExceeded, nil},
		{pgx.ErrNoRows, nil},
		{pgx.ErrTxClosed, nil},
	} {
		got := idempg.Classify(tc.err)
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
		require.Same(t, got, idempg.Classify(got), "classified once is classified")
	}
	require.NoError(t, idempg.Classify(nil))

	// The Store exposes the dialect's classifier to ClaimTx callers.
	s, err := idem.New(idempg.New(nil), nil)
	require.NoError(t, err)
	require.ErrorIs(t, s.Classify(&pgconn.PgError{Code: "40001"}), idem.ErrRetryable)
	require.True(t, own == s.Classify(own)) //nolint:errorlint // identity is the point
}

// TestDoRetriesDeadlockOfCallback: a deadlock met by the callback's own
// statements (two Do calls updating two rows in opposite orders) is retried
// by Do, so both calls succeed, each effect exactly once. Before the
// dialect classified callback errors, the victim got a raw 40P01.
func TestDoRetriesDeadlockOfCallback(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, defaultMode)
	stock, orders := b.schema+".stock", b.schema+".orders"
	_, err := b.pool.Exec(ctx, `CREATE TABLE `+stock+` (id int PRIMARY KEY, n int NOT NULL);
		INSERT INTO `+stock+` VALUES (1, 0), (2, 0);
		CREATE TABLE `+orders+` (ref text NOT NULL)`)
	require.NoError(t, err)
	s, err := idem.New(b.dialect, &idem.Config{MaxTxRetries: 5})
	require.NoError(t, err)

	// Both callbacks hold their first row before either asks for its
	// second, on the first try only, so the deadlock is certain.
	var ready sync.WaitGroup
	ready.Add(2)
	tries := [2]int{}
	do := func(i int, first, second int) error {
		_, err := s.Do(ctx, "deadlock", fmt.Sprintf("k%d", i), idem.Fingerprint{}, func(ctx context.Context, tx pgx.Tx) (*idem.Response, error) {
			tries[i]++
			if _, err := tx.Exec(ctx, `UPDATE `+stock+` SET n = n + 1 WHERE id = $1`, first); err != nil {
				return nil, err
			}
			if tries[i] == 1 {
				ready.Done()
				ready.Wait()
			}
			if _, err := tx.Exec(ctx, `UPDATE `+stock+` SET n = n + 1 WHERE id = $1`, second); err != nil {
				return nil, err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO `+orders+` (ref) VALUES ($1)`, fmt.Sprintf("k%d", i)); err != nil {
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
		var n int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM `+orders+` WHERE ref = $1`, ref).Scan(&n))
		require.Equal(t, 1, n, ref)
	}
	var total int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT sum(n) FROM `+stock).Scan(&total))
	require.Equal(t, 4, total, "each callback's two updates committed once")
}
