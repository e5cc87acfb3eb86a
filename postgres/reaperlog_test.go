package postgres_test

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

// TestReaperLogsNoDriverText: a reaper pass that fails on a server error
// quoting the record's key and scope (a trigger raising unique_violation
// with them in its message, as MySQL's "Duplicate entry '…'" does) logs the
// error's class, SQLSTATE and the key's digest, never the text.
func TestReaperLogsNoDriverText(t *testing.T) {
	t.Parallel()
	ctx, b := setup(t, defaultMode)
	const scope, key = "tenant-acme-secret/orders", "order-key-collides-0123456789"
	_, err := b.pool.Exec(ctx, `
		CREATE FUNCTION `+b.schema+`.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			RAISE EXCEPTION 'Key (scope, idempotency_key)=(%, %) collides', OLD.scope, OLD.idempotency_key
				USING ERRCODE = 'unique_violation';
		END $$;
		CREATE TRIGGER refuse BEFORE DELETE ON `+b.schema+`.idempotency_keys
			FOR EACH ROW EXECUTE FUNCTION `+b.schema+`.refuse()`)
	require.NoError(t, err)

	rec := logscan.New()
	rec.Secret("key", key)
	rec.Secret("scope", scope)
	var clock atomic.Pointer[time.Time]
	clock.Store(new(time.Now().Add(-48 * time.Hour)))
	s, err := idem.New(b.dialect, &idem.Config{Logger: rec.Logger(), Now: func() time.Time { return *clock.Load() }})
	require.NoError(t, err)
	_, err = s.Claim(ctx, scope, key, idem.NewFingerprint([]byte("x")))
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
	require.Contains(t, failed[0], `"error_code":"23505"`)
	require.Contains(t, failed[0], `"step":"delete expired"`)
	rec.Check(t)
}
