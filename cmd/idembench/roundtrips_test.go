package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/internal/testdb"
)

// TestRoundTripsThroughTheProxy runs the bare transaction, Do and the
// floors of both shapes on PostgreSQL and MariaDB through the proxy without
// delay: the counted round trips per operation of the bare transaction must
// be the statements the shapes send, BEGIN and COMMIT included (3 for
// small, 8 for order), Do's the same (PostgreSQL's pgx batches; MariaDB's
// compound statements of idemmysql.NewConnector carry BEGIN and COMMIT),
// floor's those of Do, measured in the same run (on MariaDB also the
// optimistic Store's, alone and under the middleware, and floorlock's,
// floorlockbound's and floorresp's),
// floortx's 2 more (the read
// and the INSERT, each alone in a caller's transaction), and the
// exactly-once checks must pass on a real server.
func TestRoundTripsThroughTheProxy(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, db string
		// extra are the dialect's own scenarios with Do's round trips.
		extra []string
	}{
		{name: "postgres", db: testdb.PostgresURL(t), extra: []string{"floorlock"}},
		{name: "mysql", db: "mysql://" + testdb.MySQLDSN(t, func(dsn string) (string, error) {
			cfg, err := gomysql.ParseDSN(dsn)
			if err != nil {
				return "", err
			}
			return cfg.Addr, nil
		}), extra: []string{"doopt", "httpopt", "floorlock", "floorlockbound", "floorresp"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			jsonPath := filepath.Join(t.TempDir(), "out.json")
			var stdout, stderr bytes.Buffer
			err := run(t.Context(), []string{
				"-db", tc.db, "-scenarios", strings.Join(append([]string{"bare", "do", "floor", "floortx"}, tc.extra...), ","), "-workers", "1", "-warmup", "300ms", "-duration", "700ms", "-reps", "1",
				"-seeds", "10", "-rtt", "0", "-json", jsonPath,
			}, &stdout, &stderr)
			require.NoError(t, err, "stderr:\n%s", stderr.String())
			raw, err := os.ReadFile(jsonPath)
			require.NoError(t, err)
			var rep report
			require.NoError(t, json.Unmarshal(raw, &rep))
			require.Len(t, rep.Dialects, 1)
			rts := map[string]float64{"small": 3, "order": 8}
			want := map[string]float64{}
			for _, sc := range append([]string{"bare", "do", "floor"}, tc.extra...) {
				for shape, n := range rts {
					want[sc+"/"+shape] = n
				}
			}
			for shape, n := range rts {
				want["floortx/"+shape] = n + 2
			}
			rows := map[string]row{}
			for _, r := range rep.Dialects[0].Rows {
				rows[r.Scenario+"/"+r.Shape] = r
			}
			for shape, n := range rts {
				do, floor := rows["do/"+shape], rows["floor/"+shape]
				// Each may be off by one operation in flight (see below).
				tol := 0.01 + n/(do.OpsPerSec*0.7) + n/(floor.OpsPerSec*0.7)
				require.InDelta(t, do.RoundTrips, floor.RoundTrips, tol, "floor's round trips are Do's (%s)", shape)
			}
			for _, r := range rep.Dialects[0].Rows {
				require.Equal(t, "proxy0", r.RTT)
				name := r.Scenario + "/" + r.Shape
				// The warm-up absorbs what a connection does once (pgx
				// prepares each statement, a pool pings a connection idle
				// for a second); the operation in flight when it ends may
				// add up to one operation's round trips to the window's.
				ops := r.OpsPerSec * 0.7
				require.Contains(t, want, name)
				require.InDelta(t, want[name], r.RoundTrips, 0.01+want[name]/ops, "%s (%.0f operations)", name, ops)
				delete(want, name)
			}
			require.Empty(t, want, "scenarios not measured")
		})
	}
}
