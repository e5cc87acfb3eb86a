package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/internal/testdb"
)

// TestRoundTripsThroughTheProxy runs the bare transaction of both shapes
// on PostgreSQL and MariaDB through the proxy without delay: the counted
// round trips per operation must be the statements the shapes send, BEGIN
// and COMMIT included (3 for small, 8 for order), and the exactly-once
// check must pass on a real server.
func TestRoundTripsThroughTheProxy(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, db string }{
		{"postgres", testdb.PostgresURL(t)},
		{"mysql", "mysql://" + testdb.MySQLDSN(t, func(dsn string) (string, error) {
			cfg, err := gomysql.ParseDSN(dsn)
			if err != nil {
				return "", err
			}
			return cfg.Addr, nil
		})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			jsonPath := filepath.Join(t.TempDir(), "out.json")
			var stdout, stderr bytes.Buffer
			err := run(t.Context(), []string{
				"-db", tc.db, "-scenarios", "bare", "-workers", "1", "-warmup", "300ms", "-duration", "700ms", "-reps", "1",
				"-seeds", "10", "-rtt", "0", "-json", jsonPath,
			}, &stdout, &stderr)
			require.NoError(t, err, "stderr:\n%s", stderr.String())
			raw, err := os.ReadFile(jsonPath)
			require.NoError(t, err)
			var rep report
			require.NoError(t, json.Unmarshal(raw, &rep))
			require.Len(t, rep.Dialects, 1)
			want := map[string]float64{"small": 3, "order": 8}
			for _, r := range rep.Dialects[0].Rows {
				require.Equal(t, "proxy0", r.RTT)
				// The warm-up absorbs what a connection does once (pgx
				// prepares each statement, a pool pings a connection idle
				// for a second); the operation in flight when it ends may
				// add up to one operation's round trips to the window's.
				ops := r.OpsPerSec * 0.7
				require.InDelta(t, want[r.Shape], r.RoundTrips, 0.01+want[r.Shape]/ops, "%s (%.0f operations)", r.Shape, ops)
				delete(want, r.Shape)
			}
			require.Empty(t, want, "shapes not measured")
		})
	}
}
