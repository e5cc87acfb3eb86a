package idem_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/sqlite"
)

// TestKeepAliveStopCancelsRenewalInFlight: a renewal waiting for a pool
// connection held by the business transaction must not keep stop from
// returning.
func TestKeepAliveStopCancelsRenewalInFlight(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, sqlite.Migrate(ctx, db))
	db.SetMaxOpenConns(1)
	d := sqlite.New(db)
	store, err := idem.New(d, &idem.Config{LeaseDuration: 60 * time.Millisecond})
	require.NoError(t, err)

	l, err := store.Acquire(ctx, "t1/pay", "k1", idem.NewFingerprint([]byte("x")))
	require.NoError(t, err)
	_, stop := l.KeepAlive(ctx)
	tx, err := d.Begin(ctx) // takes the only connection
	require.NoError(t, err)
	time.Sleep(50 * time.Millisecond) // a renewal ticks and waits for a connection

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	select {
	case err := <-stopped:
		require.NoError(t, err, "a renewal cancelled by stop is not a failure")
	case <-time.After(3 * time.Second):
		_ = d.Rollback(context.Background(), tx)
		err := <-stopped
		t.Fatalf("stop waited for a renewal it should have cancelled (then returned %v)", err)
	}
	require.NoError(t, l.CompleteTx(ctx, tx, &idem.Response{StatusCode: 200}))
	require.NoError(t, d.Commit(ctx, tx))
}

// TestKeepAliveDocumentedPattern follows the KeepAlive doc: outside work with
// workCtx, stop, then the business transaction with the parent context.
func TestKeepAliveDocumentedPattern(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	d := newSQLiteDialect(t)
	store, err := idem.New(d, &idem.Config{LeaseDuration: 90 * time.Millisecond})
	require.NoError(t, err)
	l, err := store.Acquire(ctx, "t1/pay", "k1", idem.NewFingerprint([]byte("x")))
	require.NoError(t, err)

	workCtx, stop := l.KeepAlive(ctx)
	select { // the outside call, longer than two leases
	case <-time.After(250 * time.Millisecond):
	case <-workCtx.Done():
		t.Fatalf("work cancelled: %v", context.Cause(workCtx))
	}
	require.NoError(t, stop())
	require.Error(t, workCtx.Err(), "stop ends the work context")

	tx, err := d.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, l.CompleteTx(ctx, tx, &idem.Response{StatusCode: 200}))
	require.NoError(t, d.Commit(ctx, tx))
	rec, err := store.Get(ctx, "t1/pay", "k1")
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
}
