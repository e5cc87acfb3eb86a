package workload_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/internal/workload"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

func TestParseShapes(t *testing.T) {
	t.Parallel()
	s, err := workload.ParseShapes("order, small,order")
	require.NoError(t, err)
	require.Equal(t, []workload.Shape{workload.Order, workload.Small}, s)
	_, err = workload.ParseShapes("small,big")
	require.ErrorContains(t, err, `unknown shape "big"`)
}

// TestShapesWriteWhatCheckWritesExpects runs both shapes on SQLite and
// checks the counts with CheckWrites, which must also catch a lost, a
// duplicated and an unrecorded order.
func TestShapesWriteWhatCheckWritesExpects(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "w.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemsqlite.Migrate(ctx, db))
	for _, q := range workload.Tables(workload.SQLite) {
		_, err := db.ExecContext(ctx, q)
		require.NoError(t, err)
	}
	require.NoError(t, workload.FillProducts(ctx, workload.SQLite, func(ctx context.Context, q string, args ...any) error {
		_, err := db.ExecContext(ctx, q, args...)
		return err
	}))
	counts := func() workload.Counts {
		var c workload.Counts
		require.NoError(t, db.QueryRowContext(ctx, workload.CountsQuery(workload.SQLite)).Scan(&c.Orders, &c.Lines, &c.Stock, &c.Completed, &c.Pending))
		return c
	}
	start := counts()
	require.Equal(t, workload.Counts{Stock: workload.Products * workload.InitialStock}, start)

	for _, shape := range workload.Shapes {
		before := counts()
		run := workload.SQLBusiness(shape, workload.SQLite)
		for range 5 {
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			require.NoError(t, run(ctx, tx, "tenant-01"))
			require.NoError(t, tx.Commit())
		}
		// A rolled-back order leaves nothing behind.
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		require.NoError(t, run(ctx, tx, "tenant-01"))
		require.NoError(t, tx.Rollback())

		after := counts()
		require.NoError(t, workload.CheckWrites(shape, before, after, 5, 0), shape)
		require.ErrorContains(t, workload.CheckWrites(shape, before, after, 6, 0), "5 orders written for 6 successful operations")
		require.ErrorContains(t, workload.CheckWrites(shape, before, after, 4, 0), "5 orders written for 4 successful operations")
		require.ErrorContains(t, workload.CheckWrites(shape, before, after, 5, 5), "0 idempotency records completed, want 5")
		if shape == workload.Order {
			require.Equal(t, int64(15), after.Lines-before.Lines)
			require.Equal(t, int64(5), before.Stock-after.Stock)
		} else {
			require.Equal(t, before.Lines, after.Lines)
			require.Equal(t, before.Stock, after.Stock)
		}
	}
}
