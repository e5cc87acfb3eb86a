//go:build faults

package faults

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestKillBodyWrite is the body store's row of scenario 2 of
// docs/reliability.md: the orders process keeps every response body by
// reference (-inline-body-max 16, so even POST /orders' JSON goes to the
// body store) and is killed with SIGKILL by its own hook once the body
// object is written and before the record that names it commits
// (X-Fault-Crash: after-body-write), with each built-in body store: a
// directory (-bodies DIR) and the database's table (-bodies table). After
// a restart the client's retry must run the order again (its transaction
// died with the process), exactly one order must exist per key, and every
// record must replay its body byte for byte: no record without its object.
// The directory keeps one orphan object per kill, for the sweep; the table
// keeps none.
func TestKillBodyWrite(t *testing.T) {
	t.Parallel()
	bin := procBuild(t)
	for _, d := range dialects(t) {
		t.Run(d, func(t *testing.T) {
			t.Parallel()
			for _, store := range []string{"dir", "table"} {
				t.Run(store, func(t *testing.T) { killBodyWrite(t, bin, d, store) })
			}
		})
	}
}

func killBodyWrite(t *testing.T, bin, dialect, store string) {
	start := time.Now()
	db := procOpenDB(t, dialect)
	bodies := "table"
	if store == "dir" {
		bodies = filepath.Join(t.TempDir(), "bodies")
	}
	args := append(db.args(), "-fault-injection", "-bodies", bodies, "-inline-body-max", "16", "-reap-interval", "1h")
	inst := procStart(t, bin, args...)
	started := []*procInstance{inst}
	defer func() { procLogFailures(t, started) }()
	y := newProcTally()
	var jobs []procJob
	rounds := scaled(5, 30)
	for i := range rounds {
		j := procJob{path: "/orders", tenant: "acme", key: fmt.Sprintf("kill-body-%03d", i),
			body: fmt.Sprintf(`{"sku":"sku-%d","qty":1,"amount_cents":%d}`, i, 100+i)}
		jobs = append(jobs, j)
		a := procSend(t.Context(), inst.base, j.path, j.tenant, j.key, j.body, "after-body-write", 10*time.Second)
		y.add(j, a)
		require.Equal(t, procConnError, a.label, "the request must die with the process, got %s", a.body)
		require.True(t, inst.diedOfSIGKILL(), "the process must have killed itself")
		inst = procStart(t, bin, args...)
		started = append(started, inst)

		retry := procSend(t.Context(), inst.base, j.path, j.tenant, j.key, j.body, "", 10*time.Second)
		y.add(j, retry)
		require.Equal(t, http.StatusCreated, retry.status, "%s %s", retry.label, retry.body)
		assert.False(t, retry.replayed, "the killed attempt's transaction rolled back: the retry runs")
		again := procSend(t.Context(), inst.base, j.path, j.tenant, j.key, j.body, "", 10*time.Second)
		y.add(j, again)
		require.Equal(t, "201 replayed", again.label, "the record's body object is there: %s", again.body)
	}
	v := y.check(t, db, nil, jobs)

	var records, objects int
	require.NoError(t, db.sql.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+db.table("idempotency_keys")).Scan(&records))
	require.Equal(t, rounds, records)
	var orphans string
	if store == "dir" {
		entries, err := os.ReadDir(bodies)
		require.NoError(t, err)
		for _, e := range entries {
			if !strings.HasPrefix(e.Name(), ".") {
				objects++
			}
		}
		require.Equal(t, 2*rounds, objects, "one object per record and one orphan per kill")
		orphans = fmt.Sprintf("%d orphan objects left for the sweep", objects-records)
	} else {
		require.NoError(t, db.sql.QueryRowContext(t.Context(),
			"SELECT COUNT(*) FROM "+db.table("idempotency_bodies")+" WHERE seq = 0").Scan(&objects))
		require.Equal(t, rounds, objects, "one object per record: the killed transactions left no rows")
		orphans = "no orphan: the killed transactions' rows rolled back"
	}
	report(t, outcome{
		Scenario:   "kill -9 between body write and commit (" + store + " store)",
		Dialect:    dialect,
		Requests:   y.requests,
		Faults:     rounds,
		FaultKind:  "SIGKILL at after-body-write",
		Duplicates: v.duplicates,
		Lost:       v.lost,
		Codes:      y.codes,
		Notes:      fmt.Sprintf("%d rounds, every body by reference; %s; %s", rounds, orphans, time.Since(start).Round(time.Second)),
	})
}
