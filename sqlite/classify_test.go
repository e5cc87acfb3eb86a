package sqlite_test

import (
	"database/sql"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/idemstore/idem"
)

// TestClassify: the caller's own statements' real SQLite errors are
// classified by Store.Classify (the dialect's ErrorClassifier): a stale
// snapshot (SQLITE_BUSY_SNAPSHOT) is retryable, the write lock held past
// busy_timeout is an unavailable store, and anything else is returned
// unchanged.
func TestClassify(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, nil)
	var path string
	require.NoError(t, b.db.QueryRowContext(ctx, `SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&path))
	_, err := b.db.ExecContext(ctx, `CREATE TABLE stock (id INTEGER PRIMARY KEY, n INTEGER NOT NULL); INSERT INTO stock VALUES (1, 0)`)
	require.NoError(t, err)
	// A pool of the application's own: deferred transactions, a short busy timeout.
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(50)")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })

	// A deferred transaction reads, another writer commits, its write fails.
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	var n int
	require.NoError(t, tx.QueryRowContext(ctx, `SELECT n FROM stock WHERE id = 1`).Scan(&n))
	_, err = b.db.ExecContext(ctx, `UPDATE stock SET n = n + 1`)
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `UPDATE stock SET n = n + 1`)
	require.Equal(t, sqlite3.SQLITE_BUSY_SNAPSHOT, sqliteCode(err))
	got := b.store.Classify(err)
	require.ErrorIs(t, got, idem.ErrRetryable)
	require.NotErrorIs(t, got, idem.ErrStoreUnavailable)
	require.ErrorIs(t, got, err)
	require.Same(t, got, b.store.Classify(got), "classified once is classified")
	require.NoError(t, tx.Rollback())

	// The write lock held by another transaction past busy_timeout.
	holder := b.begin(ctx, t)
	_, err = holder.ExecContext(ctx, `UPDATE stock SET n = n + 1`)
	require.NoError(t, err)
	_, err = db.ExecContext(ctx, `UPDATE stock SET n = n + 1`)
	require.Equal(t, sqlite3.SQLITE_BUSY, sqliteCode(err)&0xff)
	got = b.store.Classify(err)
	require.ErrorIs(t, got, idem.ErrStoreUnavailable)
	require.NotErrorIs(t, got, idem.ErrRetryable)
	require.NoError(t, holder.Rollback())

	// Left alone: a constraint, a missing table, the application's own error.
	_, err = db.ExecContext(ctx, `INSERT INTO stock VALUES (1, 0)`)
	require.Error(t, err)
	require.True(t, err == b.store.Classify(err)) //nolint:errorlint // identity is the point
	_, err = db.ExecContext(ctx, `SELECT * FROM missing`)
	require.Error(t, err)
	require.True(t, err == b.store.Classify(err)) //nolint:errorlint // identity is the point
	own := errors.New("the application's own error")
	require.True(t, own == b.store.Classify(own)) //nolint:errorlint // identity is the point
	require.ErrorIs(t, b.store.Classify(sql.ErrConnDone), idem.ErrStoreUnavailable)
	require.NoError(t, b.store.Classify(nil))
}
