//go:build faults

package faults

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemstore/idem/idemhttp"
	"github.com/idemstore/idem/internal/testdb"
)

// Scenario 5, soak: a mixed load (new keys, replays of recent keys,
// concurrent duplicates, keys reused with another body) on the in-process
// service, with the reaper running and a short retention, sampling the
// idempotency_keys row count, the goroutines, the heap and the latency. A
// leak or an unbounded table shows as growth between the first and the last
// quarter; the bounds are loose enough for a busy 2-core machine and tight
// enough for a leak of one goroutine or one kilobyte per request.
//
// The dialects run at the same time, so the bounded version costs one
// duration of wall time. They run as goroutines of one test rather than as
// t.Parallel subtests: go test runs GOMAXPROCS parallel subtests at a time
// (2 on the CI machine), which would run the third dialect after the others.
// Goroutines and heap are the process's, shared by the concurrent runs,
// which start and stop together so that every quarter holds the same mix.
// Each dialect then gets a subtest that checks and reports its samples.

// soakRetention is the service's retention: short, so that the reaper's
// work is part of the soak and the table's steady size is small, yet well
// above soakRecent plus the slowest request. At 5s a reuse sent 2s after
// its key's 201 and queued 3s behind SQLite's single writer on a loaded
// machine found the record expired, was executed as a new request, and
// wrote a second order: the behaviour Config.Retention documents, and what a
// retention shorter than the clients' retry window costs.
const soakRetention = 10 * time.Second

// soakReapInterval is the reaper's interval.
const soakReapInterval = time.Second

// soakRate is the operations per second sent to each dialect. A fixed rate
// (rather than as fast as possible) keeps the table's expected size and the
// latency comparable across windows.
const soakRate = 40

// soakRecent is how old an acknowledged key may be to be replayed or reused
// with another body: well inside the retention, so that the record is still
// there when the request arrives, even after a stall.
const soakRecent = 2 * time.Second

func TestSoak(t *testing.T) {
	duration := scaled(50*time.Second, 10*time.Minute)
	every := scaled(2500*time.Millisecond, 10*time.Second)
	names := dialects(t)
	cfg := inprocConfig{Retention: soakRetention, ReapInterval: soakReapInterval, Lease: 5 * time.Second}
	svcs := make([]*inprocService, len(names))
	for i, d := range names {
		switch d {
		case dialectSQLite:
			svcs[i], _ = inprocOpenSQLite(t, t.TempDir(), cfg)
		case dialectPostgres:
			svcs[i] = inprocOpenPostgres(t, testdb.PostgresURL(t), true, cfg)
		case dialectMySQL:
			svcs[i], _ = inprocOpenMySQL(t, testdb.MySQLDSN(t, inprocMySQLAddr), cfg)
		}
	}
	runs := make([]*soakState, len(names))
	var wg sync.WaitGroup
	for i, svc := range svcs {
		wg.Go(func() { runs[i] = soakRun(t.Context(), svc, duration, every) })
	}
	wg.Wait()
	for i, d := range names {
		t.Run(d, func(t *testing.T) { soakFinish(t, runs[i]) })
	}
}

// soakSample is one sampling point.
type soakSample struct {
	At         time.Duration // since the load started
	Rows       int           // idempotency_keys rows
	Goroutines int
	HeapInuse  uint64        // bytes, after a GC
	P99        time.Duration // of the requests answered in the window
	Requests   int           // answered in the window
	NewKeys    int64         // new keys sent so far
}

// soakEntry is the ledger's record of one key.
type soakEntry struct {
	acked     bool
	payment   bool
	recovered bool
}

// soakTenants are the tenants keys are spread over, by key number.
var soakTenants = [...]string{"acme", "globex", "initech"}

// soakKey returns the key numbered n on route: the tenant and the key text
// derive from n, so the ledger need not store them.
func soakKey(route string, n int64) inprocKey {
	return inprocKey{Route: route, Tenant: soakTenants[n%int64(len(soakTenants))], Key: fmt.Sprintf("soak-%012d", n)}
}

// soakAcked is an acknowledged key, for replays and reuses.
type soakAcked struct {
	k      inprocKey
	amount int64
	body   inprocBody
	at     time.Time
}

// soakState is what the workers share.
type soakState struct {
	svc *inprocService

	mu         sync.Mutex
	codes      map[string]int
	unexpected map[string]int // "op: answer" → count
	// ledger holds what was acknowledged for each new key, indexed by the
	// key's number. It is the one thing the soak keeps per request, so it
	// is kept small: a map of whole answers grew the heap by 16 MiB in ten
	// minutes and failed the heap bound by itself.
	ledger   []soakEntry
	recent   []soakAcked // newest last
	window   []time.Duration
	requests int
	// shed counts 503 idempotency_store_unavailable answers: under
	// overload a request can wait out the store's lock timeouts (SQLite's
	// 5s busy timeout), which is back-pressure, not an error, as long as
	// it stays rare.
	shed    int
	newKeys atomic.Int64 // keys numbered so far

	// Set when the run ends.
	samples []soakSample
	elapsed time.Duration
	errs    []error
}

// soakRun drives the load on svc for duration, sampling every every.
func soakRun(ctx context.Context, svc *inprocService, duration, every time.Duration) *soakState {
	st := &soakState{svc: svc, codes: map[string]int{}, unexpected: map[string]int{}}

	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	tick := time.NewTicker(time.Second / soakRate)
	defer tick.Stop()
	var workers sync.WaitGroup
	for range 8 { // enough to keep the rate while a few requests wait on a lock
		workers.Go(func() {
			for {
				select {
				case <-loadCtx.Done():
					return
				case <-tick.C:
					st.op(loadCtx)
				}
			}
		})
	}

	start := time.Now()
	sampler := time.NewTicker(every)
	defer sampler.Stop()
	for time.Since(start) < duration && ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case <-sampler.C:
			s, err := st.sample(ctx, time.Since(start))
			if err != nil {
				st.errs = append(st.errs, fmt.Errorf("sample: %w", err))
				continue
			}
			st.samples = append(st.samples, s)
		}
	}
	stopLoad()
	workers.Wait()
	st.elapsed = time.Since(start)
	if ctx.Err() != nil {
		st.errs = append(st.errs, fmt.Errorf("the test ended early: %w", ctx.Err()))
	}
	return st
}

// soakFinish checks one dialect's run and reports it.
func soakFinish(t *testing.T, st *soakState) {
	svc := st.svc
	for _, err := range st.errs {
		t.Errorf("soak on %s: %v", svc.Dialect, err)
	}
	dups, lost, err := inprocCheck(t.Context(), svc, st.acked())
	if err != nil {
		t.Fatalf("soak: %v", err)
	}
	for what, n := range st.unexpected {
		t.Errorf("soak on %s: unexpected answer %s (%d times)", svc.Dialect, what, n)
	}
	if st.shed*100 > st.requests {
		t.Errorf("soak on %s: %d of %d requests got 503 %s; more than 1%% is not back-pressure but an unavailable store",
			svc.Dialect, st.shed, st.requests, idemhttp.CodeStoreUnavailable)
	}
	notes := soakAssert(t, svc.Dialect, st.samples)
	notes = fmt.Sprintf("%s; %s at %d ops/s, retention %s, reaper every %s deleted %d (%d errors)", notes,
		st.elapsed.Round(time.Second), soakRate, soakRetention, soakReapInterval, svc.Reaped.Load(), svc.ReapErrors.Load())
	report(t, outcome{
		Scenario:   "soak",
		Dialect:    svc.Dialect,
		Requests:   st.requests,
		Codes:      st.codes,
		Duplicates: dups,
		Lost:       lost,
		Notes:      notes,
	})
}

// soakAssert checks the samples and summarises them for the notes column.
func soakAssert(t *testing.T, dialect string, samples []soakSample) string {
	t.Helper()
	if len(samples) < 8 {
		t.Errorf("soak on %s: only %d samples; the bounds need at least 8", dialect, len(samples))
		return fmt.Sprintf("%d samples", len(samples))
	}
	q := len(samples) / 4
	first, last := samples[:q], samples[len(samples)-q:]
	secondHalf := samples[len(samples)/2:]

	// The table's steady size is about the new-key rate times how long a
	// record lives: the retention, plus up to one reaper interval (and its
	// jitter) before the pass that deletes it. The bound allows half as
	// much again, plus a little for the replays' and duplicates' bursts.
	s0, s1 := secondHalf[0], secondHalf[len(secondHalf)-1]
	rate := float64(s1.NewKeys-s0.NewKeys) / (s1.At - s0.At).Seconds()
	life := soakRetention + soakReapInterval*11/10 + time.Second
	rowBound := int(rate*life.Seconds()*1.5) + 20
	maxRows := soakMax(secondHalf, func(s soakSample) int { return s.Rows })
	if maxRows > rowBound {
		t.Errorf("soak on %s: idempotency_keys grew to %d rows in the second half; at %.0f new keys/s and records living %s it should stay under %d",
			dialect, maxRows, rate, life, rowBound)
	}

	// Goroutines: the load is steady, so the count is too, give or take
	// requests in flight and idle connections; a leak of one per request
	// would add hundreds per quarter.
	g0 := soakMax(first, func(s soakSample) int { return s.Goroutines })
	g1 := soakMax(last, func(s soakSample) int { return s.Goroutines })
	if g1 > g0+g0/2+30 {
		t.Errorf("soak on %s: goroutines grew from at most %d in the first quarter to %d in the last", dialect, g0, g1)
	}

	// Heap in use after a GC: bounded growth, half as much again plus
	// 4 MiB. Between the first and the last quarter the process serves
	// about 5,000 requests in the bounded run (three dialects), 60,000 in
	// the full one: a leak of a few kilobytes per request fails the first,
	// of a few hundred bytes the second.
	h0 := soakMax(first, func(s soakSample) int { return int(s.HeapInuse) })
	h1 := soakMax(last, func(s soakSample) int { return int(s.HeapInuse) })
	if h1 > h0+h0/2+4<<20 {
		t.Errorf("soak on %s: heap in use grew from at most %.1f MiB in the first quarter to %.1f MiB in the last", dialect, soakMiB(h0), soakMiB(h1))
	}

	// Latency: the median p99 of the last quarter's windows against the
	// first quarter's, with a generous factor and floor: one window can
	// catch a stall of the shared 2-core machine, a quarter's median cannot.
	p0, p1 := soakMedianP99(first), soakMedianP99(last)
	if p1 > 5*p0+200*time.Millisecond {
		var all []string
		for _, s := range samples {
			all = append(all, s.P99.Round(time.Millisecond).String())
		}
		t.Errorf("soak on %s: p99 drifted from %s (first quarter's median) to %s (last quarter's); windows: %s",
			dialect, p0, p1, strings.Join(all, " "))
	}
	return fmt.Sprintf("%d samples: rows max %d in 2nd half (bound %d at %.0f new keys/s); goroutines max %d→%d, heap max %.1f→%.1f MiB, median p99 %s→%s (first→last quarter)",
		len(samples), maxRows, rowBound, rate, g0, g1, soakMiB(h0), soakMiB(h1), p0.Round(time.Millisecond), p1.Round(time.Millisecond))
}

// soakShed reports whether a is the store's 503: no verdict on the
// operation, counted apart.
func soakShed(a inprocAnswer) bool {
	return a.Err == nil && a.Status == http.StatusServiceUnavailable && a.Code == idemhttp.CodeStoreUnavailable
}

func soakMedianP99(ss []soakSample) time.Duration {
	p := make([]time.Duration, 0, len(ss))
	for _, s := range ss {
		p = append(p, s.P99)
	}
	slices.Sort(p)
	return p[len(p)/2]
}

func soakMax(ss []soakSample, f func(soakSample) int) int {
	m := 0
	for _, s := range ss {
		m = max(m, f(s))
	}
	return m
}

func soakMiB(b int) float64 { return float64(b) / (1 << 20) }

// sample takes one sampling point and starts a new latency window.
func (st *soakState) sample(ctx context.Context, at time.Duration) (soakSample, error) {
	rows, err := st.svc.keyRows(ctx)
	if err != nil {
		return soakSample{}, err
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	st.mu.Lock()
	window := st.window
	st.window = nil
	st.mu.Unlock()
	slices.Sort(window)
	var p99 time.Duration
	if len(window) > 0 {
		p99 = window[min(len(window)-1, len(window)*99/100)]
	}
	return soakSample{
		At: at, Rows: rows, Goroutines: runtime.NumGoroutine(), HeapInuse: ms.HeapInuse,
		P99: p99, Requests: len(window), NewKeys: st.newKeys.Load(),
	}, nil
}

// op sends one operation of the mix.
func (st *soakState) op(ctx context.Context) {
	switch r := rand.IntN(100); {
	case r < 50:
		st.fresh(ctx, inprocOrders)
	case r < 60:
		st.fresh(ctx, inprocPayments)
	case r < 75:
		st.replay(ctx)
	case r < 87:
		st.duplicates(ctx)
	default:
		st.reuse(ctx)
	}
}

// send posts and records the answer; a transport error after the load
// stopped (ctx cancelled) is not an answer and not counted.
func (st *soakState) send(ctx context.Context, k inprocKey, amount int64) (inprocAnswer, bool) {
	a := st.svc.post(ctx, k, amount)
	if a.Err != nil && ctx.Err() != nil {
		return a, false
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	st.requests++
	st.codes[a.Label()]++
	if soakShed(a) {
		st.shed++
	}
	st.window = append(st.window, a.Latency)
	return a, true
}

// acked rebuilds the acknowledged keys from the ledger, for inprocCheck.
func (st *soakState) acked() map[inprocKey]inprocAnswer {
	st.mu.Lock()
	defer st.mu.Unlock()
	out := map[inprocKey]inprocAnswer{}
	for n, e := range st.ledger {
		if !e.acked {
			continue
		}
		route := inprocOrders
		if e.payment {
			route = inprocPayments
		}
		out[soakKey(route, int64(n))] = inprocAnswer{Status: http.StatusCreated, Body: inprocBody{Recovered: e.recovered}}
	}
	return out
}

func (st *soakState) fresh(ctx context.Context, route string) {
	n := st.newKeys.Add(1) - 1
	k := soakKey(route, n)
	amount := 1 + rand.Int64N(10_000)
	a, ok := st.send(ctx, k, amount)
	if !ok || soakShed(a) {
		return
	}
	if a.Status != http.StatusCreated || a.Replayed {
		st.unexpect("new key", a)
		return
	}
	st.ack(k, n, amount, a)
}

func (st *soakState) ack(k inprocKey, n, amount int64, a inprocAnswer) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for int64(len(st.ledger)) <= n {
		st.ledger = append(st.ledger, soakEntry{})
	}
	st.ledger[n] = soakEntry{acked: true, payment: k.Route == inprocPayments, recovered: a.Body.Recovered}
	now := time.Now()
	st.recent = append(st.recent, soakAcked{k: k, amount: amount, body: a.Body, at: now})
	// Drop what is too old to replay; the slice stays short.
	i := 0
	for i < len(st.recent) && now.Sub(st.recent[i].at) > soakRecent {
		i++
	}
	st.recent = st.recent[i:]
}

func (st *soakState) pickRecent() (soakAcked, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for len(st.recent) > 0 && time.Since(st.recent[0].at) > soakRecent {
		st.recent = st.recent[1:]
	}
	if len(st.recent) == 0 {
		return soakAcked{}, false
	}
	return st.recent[rand.IntN(len(st.recent))], true
}

func (st *soakState) unexpect(op string, a inprocAnswer) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.unexpected[op+": "+a.Label()]++
}

// replay resends a recent key with its body: the stored 201, replayed.
func (st *soakState) replay(ctx context.Context) {
	r, ok := st.pickRecent()
	if !ok {
		st.fresh(ctx, inprocOrders)
		return
	}
	a, ok := st.send(ctx, r.k, r.amount)
	if !ok || soakShed(a) {
		return
	}
	if a.Status != http.StatusCreated || !a.Replayed || a.Body.ID != r.body.ID || a.Body.ChargeID != r.body.ChargeID {
		st.unexpect("replay", a)
	}
}

// reuse resends a recent key with another body: a conflict, and the record
// unchanged (later replays of the key still get the original).
func (st *soakState) reuse(ctx context.Context) {
	r, ok := st.pickRecent()
	if !ok {
		st.fresh(ctx, inprocOrders)
		return
	}
	a, ok := st.send(ctx, r.k, r.amount+1)
	if !ok || soakShed(a) {
		return
	}
	if a.Status != http.StatusConflict || a.Code != idemhttp.CodeKeyReused {
		st.unexpect("reused key", a)
	}
}

// duplicates sends one new key twice at once: one runs, the other waits
// for it and replays, or is told the key is in progress.
func (st *soakState) duplicates(ctx context.Context) {
	route := inprocOrders
	if rand.IntN(3) == 0 {
		route = inprocPayments
	}
	n := st.newKeys.Add(1) - 1
	k := soakKey(route, n)
	amount := 1 + rand.Int64N(10_000)
	var answers [2]inprocAnswer
	var sent [2]bool
	var wg sync.WaitGroup
	for i := range answers {
		wg.Go(func() { answers[i], sent[i] = st.send(ctx, k, amount) })
	}
	wg.Wait()
	if !sent[0] || !sent[1] {
		return
	}
	fresh, shed := 0, 0
	for _, a := range answers {
		switch {
		case soakShed(a):
			shed++
		case a.Status == http.StatusCreated && !a.Replayed:
			fresh++
			st.ack(k, n, amount, a)
		case a.Status == http.StatusCreated && a.Replayed:
		case a.Status == http.StatusConflict && a.Code == idemhttp.CodeInProgress:
		default:
			st.unexpect("concurrent duplicate", a)
		}
	}
	// One ran, unless the store shed it; never two.
	if fresh > 1 || fresh == 0 && shed == 0 {
		st.unexpect(fmt.Sprintf("concurrent duplicate (%d fresh 201s)", fresh), answers[0])
	}
}
