package postgres_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// TestCompleteCommitFenced: a completion whose token no longer matches
// commits nothing, neither the claim nor the business row written in the
// same transaction, and returns ErrFenced; the connection goes back to the
// pool and a later Rollback is harmless.
func TestCompleteCommitFenced(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		_, err := b.pool.Exec(ctx, `CREATE TABLE `+b.orders()+` (id bigint PRIMARY KEY)`)
		require.NoError(t, err)

		p := claimParams(newKey())
		tx, res, err := b.dialect.BeginClaim(ctx, p)
		require.NoError(t, err)
		require.True(t, res.Created)
		_, err = tx.Exec(ctx, `INSERT INTO `+b.orders()+` (id) VALUES (1)`)
		require.NoError(t, err)

		err = b.dialect.CompleteCommit(ctx, tx, &idem.CompleteParams{
			Scope: p.Scope, Key: p.Key, Token: p.Token + 1, Status: idem.StatusSucceeded,
			Response: &idem.Response{StatusCode: 201, Body: []byte("x")}, Retention: time.Hour,
		})
		require.ErrorIs(t, err, idem.ErrFenced)
		require.NoError(t, b.dialect.Rollback(ctx, tx), "a Rollback after CompleteCommit is harmless")

		var n int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM `+b.orders()).Scan(&n))
		require.Zero(t, n, "the business row rolled back")
		_, err = b.dialect.DB().Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key})
		require.ErrorIs(t, err, idem.ErrNotFound, "the claim rolled back")
		require.Zero(t, b.pool.Stat().AcquiredConns(), "the connection went back to the pool")
	})
}

// TestCompleteCommit: the completion and the business row commit together,
// and the transaction is closed afterwards.
func TestCompleteCommit(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		_, err := b.pool.Exec(ctx, `CREATE TABLE `+b.orders()+` (id bigint PRIMARY KEY)`)
		require.NoError(t, err)

		p := claimParams(newKey())
		tx, res, err := b.dialect.BeginClaim(ctx, p)
		require.NoError(t, err)
		require.True(t, res.Created)
		_, err = tx.Exec(ctx, `INSERT INTO `+b.orders()+` (id) VALUES (1)`)
		require.NoError(t, err)
		require.NoError(t, b.dialect.CompleteCommit(ctx, tx, &idem.CompleteParams{
			Scope: p.Scope, Key: p.Key, Token: p.Token, Status: idem.StatusSucceeded,
			Response: &idem.Response{StatusCode: 201, Body: []byte("x")}, Retention: time.Hour,
		}))
		_, err = tx.Exec(ctx, `SELECT 1`)
		require.ErrorIs(t, err, pgx.ErrTxClosed)
		require.NoError(t, b.dialect.Rollback(ctx, tx))
		require.Zero(t, b.pool.Stat().AcquiredConns())

		var n int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM `+b.orders()).Scan(&n))
		require.Equal(t, 1, n)
		rec, err := b.dialect.DB().Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key})
		require.NoError(t, err)
		require.Equal(t, idem.StatusSucceeded, rec.Status)
		require.Equal(t, 201, rec.Response.StatusCode)

		// A second claim of the key, pipelined, replays.
		p2 := claimParams(p.Key)
		tx2, res2, err := b.dialect.BeginClaim(ctx, p2)
		require.NoError(t, err)
		require.False(t, res2.Created)
		require.Equal(t, idem.StatusSucceeded, res2.Record.Status)
		require.NoError(t, b.dialect.Rollback(context.WithoutCancel(ctx), tx2))
		require.Zero(t, b.pool.Stat().AcquiredConns())
	})
}

// TestCompleteCommitCanceled: a CompleteCommit whose context has ended
// commits nothing, reports the cancellation and frees the connection.
func TestCompleteCommitCanceled(t *testing.T) {
	t.Parallel()
	forEachMode(t, func(t *testing.T, mode pgx.QueryExecMode) {
		ctx, b := setup(t, mode)
		p := claimParams(newKey())
		tx, _, err := b.dialect.BeginClaim(ctx, p)
		require.NoError(t, err)
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		err = b.dialect.CompleteCommit(cctx, tx, &idem.CompleteParams{
			Scope: p.Scope, Key: p.Key, Token: p.Token, Status: idem.StatusSucceeded,
			Response: &idem.Response{StatusCode: 201}, Retention: time.Hour,
		})
		require.ErrorIs(t, err, context.Canceled)
		require.NoError(t, b.dialect.Rollback(ctx, tx))
		require.Zero(t, b.pool.Stat().AcquiredConns())
		_, err = b.dialect.DB().Get(ctx, &idem.GetParams{Scope: p.Scope, Key: p.Key})
		require.ErrorIs(t, err, idem.ErrNotFound)
	})
}
