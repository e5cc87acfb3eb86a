package sqlite_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/logscan"
)

// TestReaperLogsNoDriverText: a reaper pass that fails on an SQLite error
// quoting the record's key and scope (a trigger raising one, as MySQL's
// "Duplicate entry '…'" does) logs the error's class and result code,
// never the text.
func TestReaperLogsNoDriverText(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, nil)
	const scope, key = "tenant-acme-secret/orders", "order-key-collides-0123456789"
	_, err := b.db.ExecContext(ctx, `CREATE TRIGGER refuse BEFORE DELETE ON idempotency_keys
		BEGIN SELECT RAISE(ABORT, 'Duplicate entry ''`+scope+`-`+key+`'' for key'); END`)
	require.NoError(t, err)

	rec := logscan.New()
	rec.Secret("key", key)
	rec.Secret("scope", scope)
	var clock atomic.Pointer[time.Time]
	clock.Store(new(time.Now().Add(-48 * time.Hour)))
	s, err := idem.New(b.dialect, &idem.Config{Logger: rec.Logger(), Now: func() time.Time { return *clock.Load() }})
	require.NoError(t, err)
	_, err = s.Claim(ctx, scope, key, fp("x"))
	require.NoError(t, err)
	clock.Store(new(time.Now()))

	r, err := idem.NewReaper(s, &idem.ReaperConfig{Interval: time.Hour})
	require.NoError(t, err)
	_, err = r.RunOnce(ctx)
	require.ErrorContains(t, err, key, "the setup must produce a driver error quoting the key")
	runCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	require.NoError(t, r.Run(runCtx))

	var failed []string
	for _, l := range rec.Lines() {
		if strings.Contains(l, "reaper pass failed") {
			failed = append(failed, l)
		}
	}
	require.NotEmpty(t, failed, "the failed pass is logged")
	require.Contains(t, failed[0], `"error_class":"other"`)
	require.Contains(t, failed[0], `"error_code":"`)
	require.Contains(t, failed[0], `"step":"delete expired"`)
	rec.Check(t)
}
