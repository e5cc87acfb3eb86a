//go:build faults

package faults

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestInstances is scenario 1 of docs/reliability.md: several orders
// processes on one database, clients that send each request to a random
// instance, give up on it after a short timeout and retry elsewhere while
// the original still runs, and send some requests twice at once to
// different instances. Every intent must end in one order (or one charge),
// every success of an intent must be the same bytes, and no answer may be
// other than 201, 201 replayed or a documented retryable code.
func TestInstances(t *testing.T) {
	t.Parallel()
	bin := procBuild(t)
	for _, d := range dialects(t) {
		t.Run(d, func(t *testing.T) {
			t.Parallel()
			instRun(t, bin, d)
		})
	}
}

func instRun(t *testing.T, bin, dialect string) {
	start := time.Now()
	db := procOpenDB(t, dialect)
	prov := procNewProvider(t, 40*time.Millisecond)
	args := append(db.args(),
		"-provider-url", prov.srv.URL,
		// The transaction stays open this long, so that retries and
		// duplicates meet an original in flight.
		"-handler-delay", "30ms",
		"-wait-timeout", "2s",
		"-lease", "10s",
	)
	n := scaled(3, 5)
	procs := make([]*procInstance, n)
	instances := make([]string, n)
	for i := range instances {
		// One after another: goose takes no lock on SQLite, so the first
		// instance migrates alone.
		procs[i] = procStart(t, bin, args...)
		instances[i] = procs[i].base
	}
	bases := func() []string { return instances }

	tenants := []string{"acme", "globex", "initech"}
	var jobs []procJob
	for i := range scaled(150, 5000) {
		tenant := tenants[i%len(tenants)]
		if i%4 == 3 {
			jobs = append(jobs, procJob{path: "/payments", tenant: tenant, key: fmt.Sprintf("inst-pay-%05d", i),
				body: fmt.Sprintf(`{"amount_cents":%d}`, 100+i)})
			continue
		}
		jobs = append(jobs, procJob{path: "/orders", tenant: tenant, key: fmt.Sprintf("inst-order-%05d", i),
			body: fmt.Sprintf(`{"sku":"sku-%d","qty":%d,"amount_cents":%d}`, i, 1+i%3, 100+i)})
	}

	y := newProcTally()
	var duplicates atomic.Int64 // extra copies sent at once
	work := make(chan procJob)
	var wg sync.WaitGroup
	deadline := time.Now().Add(scaled(60*time.Second, 10*time.Minute))
	for range scaled(8, 16) {
		wg.Go(func() {
			for j := range work {
				// One intent in three is sent two or three times at once,
				// the copies first to different instances, then each
				// retrying on its own, as clients that double submit or
				// run behind a retrying proxy do.
				copies := 1
				if rand.IntN(3) == 0 {
					copies = 2 + rand.IntN(2)
					duplicates.Add(int64(copies - 1))
				}
				var c sync.WaitGroup
				offset := rand.IntN(n)
				for i := range copies {
					c.Go(func() {
						procRetryUntilCreated(t.Context(), y, bases, j, offset+i, 20*time.Millisecond, 400*time.Millisecond, deadline)
					})
				}
				c.Wait()
			}
		})
	}
	for _, j := range jobs {
		work <- j
	}
	close(work)
	wg.Wait()

	v := y.check(t, db, prov, jobs)
	report(t, outcome{
		Scenario:   "many instances",
		Dialect:    dialect,
		Requests:   y.requests,
		Faults:     int(duplicates.Load()),
		FaultKind:  "concurrent duplicates",
		Duplicates: v.duplicates,
		Lost:       v.lost,
		Codes:      y.codes,
		Notes:      fmt.Sprintf("%d instances, %d intents (%d payments), client timeouts 20–400ms, %s", n, len(jobs), v.payments, time.Since(start).Round(time.Second)),
	})
	procLogFailures(t, procs)
}
