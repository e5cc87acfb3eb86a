//go:build faults

package faults

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestKill is scenario 2 of docs/reliability.md: the orders process is
// killed with SIGKILL at each stage of a request, by its own
// fault-injection hooks (-fault-injection, X-Fault-Crash), then restarted,
// and the client retries; then it is killed from outside at random times
// under load. Each order must exist once, retries after a rolled-back
// attempt must run it again, retries after a commit must replay it, and a
// payment whose holder died must be resolved by the status check without a
// second charge.
func TestKill(t *testing.T) {
	t.Parallel()
	bin := procBuild(t)
	for _, d := range dialects(t) {
		t.Run(d, func(t *testing.T) {
			t.Parallel()
			t.Run("stages", func(t *testing.T) { killStages(t, bin, d) })
			t.Run("random", func(t *testing.T) { killRandom(t, bin, d) })
		})
	}
}

// killLease is the lease of the stage runs: a payment whose holder was
// killed is resolved this long after its last renewal.
const killLease = time.Second

// killStage is one crash point and what the client's retry must get.
type killStage struct {
	name string // the X-Fault-Crash stage
	path string
	// replayed: the retry replays the stored answer (the attempt
	// committed) rather than running the request again.
	replayed bool
	// recovered: the answer is the charge the status check found at the
	// provider, not a response the killed process stored.
	recovered bool
}

var killStageList = []killStage{
	{name: "before-claim", path: "/orders"},
	{name: "after-claim", path: "/orders"},
	{name: "after-commit", path: "/orders", replayed: true},
	{name: "before-provider-call", path: "/payments"},
	{name: "during-provider-call", path: "/payments", replayed: true, recovered: true},
}

func killStages(t *testing.T, bin, dialect string) {
	start := time.Now()
	db := procOpenDB(t, dialect)
	prov := procNewProvider(t, 20*time.Millisecond)
	args := append(db.args(),
		"-provider-url", prov.srv.URL,
		"-fault-injection",
		"-lease", killLease.String(),
		// The reaper's first pass runs at start-up; its later passes
		// would race with the retries this test makes on purpose.
		"-reap-interval", "1h",
	)
	inst := procStart(t, bin, args...)
	started := []*procInstance{inst}
	defer func() { procLogFailures(t, started) }()
	y := newProcTally()
	var jobs []procJob
	kills := 0
	for i := range scaled(2, 30) {
		for _, s := range killStageList {
			j := procJob{path: s.path, tenant: "acme", key: fmt.Sprintf("kill-%s-%03d", s.name, i)}
			j.body = fmt.Sprintf(`{"sku":"sku-%d","qty":1,"amount_cents":%d}`, i, 100+i)
			if s.path == "/payments" {
				j.body = fmt.Sprintf(`{"amount_cents":%d}`, 100+i)
			}
			jobs = append(jobs, j)

			a := procSend(t.Context(), inst.base, j.path, j.tenant, j.key, j.body, s.name, 10*time.Second)
			y.add(j, a)
			require.Equal(t, procConnError, a.label, "%s: the request must die with the process, got %s", s.name, a.body)
			require.True(t, inst.diedOfSIGKILL(), "%s: the process must have killed itself", s.name)
			kills++
			inst = procStart(t, bin, args...)
			started = append(started, inst)

			// Retry as a client would, until an answer that is not
			// "try again": before the lease runs out the payments get 409
			// in progress.
			var final procAnswer
			deadline := time.Now().Add(killLease + 15*time.Second)
			for time.Now().Before(deadline) {
				final = procSend(t.Context(), inst.base, j.path, j.tenant, j.key, j.body, "", 10*time.Second)
				y.add(j, final)
				if !procRetryable(final) {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			require.Equal(t, http.StatusCreated, final.status, "%s: %s %s", s.name, final.label, final.body)
			assert.Equal(t, s.replayed, final.replayed, "%s: replayed", s.name)
			var got procPay
			require.NoError(t, json.Unmarshal(final.body, &got))
			assert.Equal(t, s.recovered, got.Recovered, "%s: recovered by the status check", s.name)
			if s.path == "/payments" {
				c, calls, ok := prov.lookup(procTK{j.tenant, j.key})
				require.True(t, ok, "%s: the provider has the charge", s.name)
				assert.Equal(t, 1, calls, "%s: the provider was asked once", s.name)
				assert.Equal(t, c.ID, got.ChargeID, "%s: the answer carries the provider's charge", s.name)
			}
			// And once more: the stored answer, byte for byte.
			again := procSend(t.Context(), inst.base, j.path, j.tenant, j.key, j.body, "", 10*time.Second)
			y.add(j, again)
			require.Equal(t, "201 replayed", again.label, "%s", s.name)
		}
	}
	v := y.check(t, db, prov, jobs)
	report(t, outcome{
		Scenario:   "kill -9 at each stage",
		Dialect:    dialect,
		Requests:   y.requests,
		Faults:     kills,
		FaultKind:  "SIGKILL at a hook",
		Duplicates: v.duplicates,
		Lost:       v.lost,
		Codes:      y.codes,
		Notes:      fmt.Sprintf("%d rounds of %d stages, lease %s, %s", len(jobs)/len(killStageList), len(killStageList), killLease, time.Since(start).Round(time.Second)),
	})
}

// killRandom kills instances with SIGKILL from outside at random moments
// while clients send orders and payments to them, restarts each at once on
// a new port, and checks the invariants once every client got its 201.
func killRandom(t *testing.T, bin, dialect string) {
	start := time.Now()
	db := procOpenDB(t, dialect)
	prov := procNewProvider(t, 40*time.Millisecond)
	args := append(db.args(),
		"-provider-url", prov.srv.URL,
		"-handler-delay", "20ms",
		"-wait-timeout", "2s",
		// Long enough that a live holder under load always renews in
		// time (every lease/3); short enough that a killed holder's
		// payment is resolved within the test.
		"-lease", "2s",
		"-reap-interval", "500ms",
	)
	var mu sync.Mutex
	instances := []*procInstance{procStart(t, bin, args...), procStart(t, bin, args...)}
	started := append([]*procInstance(nil), instances...) // every process, killed or not, for procLogFailures
	bases := func() []string {
		mu.Lock()
		defer mu.Unlock()
		out := make([]string, len(instances))
		for i, p := range instances {
			out[i] = p.base
		}
		return out
	}

	// The intents: a third of them payments. The feeder keeps sending new
	// ones until the killer is done and at least minIntents were sent, so
	// that every kill lands under load.
	minIntents := scaled(200, 5000)
	intent := func(i int) procJob {
		if i%3 == 2 {
			return procJob{path: "/payments", tenant: "acme", key: fmt.Sprintf("rnd-pay-%05d", i),
				body: fmt.Sprintf(`{"amount_cents":%d}`, 100+i)}
		}
		return procJob{path: "/orders", tenant: "acme", key: fmt.Sprintf("rnd-order-%05d", i),
			body: fmt.Sprintf(`{"sku":"sku-%d","qty":1,"amount_cents":%d}`, i, 100+i)}
	}

	y := newProcTally()
	work := make(chan procJob)
	var clients sync.WaitGroup
	deadline := time.Now().Add(scaled(60*time.Second, 15*time.Minute))
	for range scaled(6, 12) {
		clients.Go(func() {
			for j := range work {
				procRetryUntilCreated(t.Context(), y, bases, j, -1, 200*time.Millisecond, time.Second, deadline)
			}
		})
	}

	// The killer: SIGKILL a random instance, restart it at once, pause a
	// random 100–500ms, again.
	var kills atomic.Int64
	killerDone := make(chan struct{})
	go func() {
		defer close(killerDone)
		for range scaled(10, 300) {
			time.Sleep(100*time.Millisecond + rand.N(400*time.Millisecond))
			if t.Context().Err() != nil {
				return
			}
			i := rand.IntN(2)
			mu.Lock()
			victim := instances[i]
			mu.Unlock()
			victim.kill()
			kills.Add(1)
			next, err := procTryStart(t, bin, args...)
			if err != nil {
				t.Errorf("restart after kill %d: %v", kills.Load(), err)
				return
			}
			mu.Lock()
			instances[i] = next
			started = append(started, next)
			mu.Unlock()
		}
	}()
	var jobs []procJob
feed:
	for i := 0; ; i++ {
		if i >= minIntents {
			select {
			case <-killerDone:
				break feed
			default:
			}
		}
		j := intent(i)
		jobs = append(jobs, j)
		work <- j
	}
	close(work)
	clients.Wait()

	v := y.check(t, db, prov, jobs)
	report(t, outcome{
		Scenario:   "kill -9 at random",
		Dialect:    dialect,
		Requests:   y.requests,
		Faults:     int(kills.Load()),
		FaultKind:  "SIGKILL from outside",
		Duplicates: v.duplicates,
		Lost:       v.lost,
		Codes:      y.codes,
		Notes: fmt.Sprintf("2 instances under load, %d intents (%d payments, %d of them recovered by the status check), lease 2s, %s",
			len(jobs), v.payments, v.recovered, time.Since(start).Round(time.Second)),
	})
	procLogFailures(t, started) // the killer is done: nobody appends any more
}
