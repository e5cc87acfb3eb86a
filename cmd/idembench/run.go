package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemstore/idem/internal/workload"
)

// runBackend measures every selected scenario on b, cfg.reps times in
// turn, and returns the samples by scenario and worker count.
func runBackend[TTx any](ctx context.Context, cfg *config, b *backend[TTx], log io.Writer) (res *dialectResult, err error) {
	res = &dialectResult{Dialect: b.name, base: make(map[string]string)}
	if res.Server, err = b.version(ctx); err != nil {
		return nil, fmt.Errorf("server version: %w", err)
	}
	fmt.Fprintf(log, "%s: %s\n", b.name, res.Server)

	// Main namespace: created for this run, dropped at the end unless -keep.
	ns := "idembench_" + cfg.runID
	// A bounded setup: Migrate takes a server-wide lock on MySQL, and a
	// tool stuck holding it would stall every other migration on the server.
	setupCtx, cancel := context.WithTimeout(ctx, time.Minute)
	_, err = b.create(setupCtx, ns)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("create namespace: %w", err)
	}
	res.Namespaces = append(res.Namespaces, ns)
	defer func() {
		if cfg.keep {
			fmt.Fprintf(log, "%s: kept namespace %s\n", b.name, ns)
			return
		}
		if derr := b.drop(context.WithoutCancel(ctx), ns); derr != nil {
			err = errors.Join(err, fmt.Errorf("drop namespace: %w", derr))
		}
	}()
	seedP, err := b.open(ctx, ns, 8, "")
	if err != nil {
		return nil, err
	}
	keys, err := seedKeys(ctx, seedP.store, b.business(workload.Small), cfg.seeds)
	if err == nil {
		err = seedP.admin.exec(ctx, b.sql.snapshot)
	}
	seedP.close()
	if err != nil {
		return nil, err
	}

	// Prefilled namespace.
	var pfNS string
	if cfg.wants("prefill") {
		pfNS = "idembench_" + cfg.runID + "_prefill"
		if cfg.reusePrefill {
			pfNS = fmt.Sprintf("idembench_prefill_%d", cfg.prefill)
		} else {
			// Dropped even when the fill fails half-way.
			defer func() {
				if cfg.keep {
					return
				}
				if derr := b.drop(context.WithoutCancel(ctx), pfNS); derr != nil {
					err = errors.Join(err, fmt.Errorf("drop prefill namespace: %w", derr))
				}
			}()
		}
		if err := preparePrefill(ctx, cfg, b, pfNS, log); err != nil {
			return nil, err
		}
		res.Namespaces = append(res.Namespaces, pfNS)
	}

	// One proxy per server and delayed RTT, for the whole run.
	proxies := make(map[rttSetting]*proxySet)
	defer func() {
		for _, ps := range proxies {
			ps.close()
		}
	}()
	for _, r := range cfg.rtts {
		if r.direct {
			continue
		}
		ps := &proxySet{}
		proxies[r] = ps
		if b.serverAddr != "" {
			if ps.db, err = startProxy(b.serverAddr, r.rtt); err != nil {
				return nil, err
			}
		}
		if cfg.wants("redis") {
			if ps.redis, err = startProxy(cfg.redisAddr, r.rtt); err != nil {
				return nil, err
			}
		}
	}

	res.samples = make(map[sampleKey][]*sample)
	hotDone := make(map[string]bool)
	var gen atomic.Int64
	for rep := 1; rep <= cfg.reps; rep++ {
		for _, r := range cfg.rtts {
			for _, workers := range cfg.workers {
				lv := &level[TTx]{cfg: cfg, b: b, seeds: keys, workers: workers, runID: cfg.runID, ns: ns, pfNS: pfNS, gen: &gen}
				if err := runLevel(ctx, lv, res, rep, r, proxies[r], hotDone, log); err != nil {
					return nil, err
				}
			}
		}
	}
	return res, nil
}

// proxySet is the latency proxies of one RTT (nil when not needed).
type proxySet struct{ db, redis *proxy }

func (ps *proxySet) turns() int64 {
	var n int64
	for _, p := range []*proxy{ps.db, ps.redis} {
		if p != nil {
			n += p.Turns()
		}
	}
	return n
}

func (ps *proxySet) close() {
	for _, p := range []*proxy{ps.db, ps.redis} {
		if p != nil {
			_ = p.Close()
		}
	}
}

// runLevel measures every scenario of every shape once at one worker count
// and RTT setting (ps nil: direct).
func runLevel[TTx any](ctx context.Context, l *level[TTx], res *dialectResult, rep int, r rttSetting, ps *proxySet,
	hotDone map[string]bool, log io.Writer,
) error {
	cfg, b, workers := l.cfg, l.b, l.workers
	redisAddr := cfg.redisAddr
	if ps != nil {
		if ps.db != nil {
			l.via = ps.db.Addr()
		}
		if ps.redis != nil {
			redisAddr = ps.redis.Addr()
		}
	}
	var err error
	if l.p, err = b.open(ctx, l.ns, workers, l.via); err != nil {
		return err
	}
	l.p.close = sync.OnceFunc(l.p.close) // prefill closes it early
	defer l.p.close()
	if cfg.wants("redis") {
		l.redis = newRedisClient(redisAddr, workers)
		defer func() { _ = l.redis.Close() }()
		l.redisAdmin = newRedisClient(cfg.redisAddr, 1)
		defer func() { _ = l.redisAdmin.Close() }()
	}
	if cfg.wants("http") || cfg.wants("httpopt") || cfg.wants("httpplain") || cfg.wants("httppk") || cfg.wants("httpreplay") {
		srv, err := newHTTPServer(l.p.store, l.p.optStore, b.business, l.p.storePKSelect)
		if err != nil {
			return err
		}
		l.httpSrv = srv
		defer l.httpSrv.Close()
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConns, tr.MaxIdleConnsPerHost = workers, workers
		l.httpCli = &http.Client{Transport: tr, Timeout: time.Minute}
		defer tr.CloseIdleConnections()
	}
	var all []*scenario
	for _, shape := range cfg.shapes {
		// hotkeys runs once per repetition, RTT and shape, with its own
		// worker count.
		hk := fmt.Sprintf("%d/%s/%s", rep, r, shape)
		l.hotTurn = cfg.wants("hotkeys") && !hotDone[hk]
		hotDone[hk] = true
		all = append(all, l.scenarios(shape)...)
	}
	all = append(all, l.readScenarios()...)
	if cfg.alternate && rep%2 == 0 {
		slices.Reverse(all)
	}
	if l.pfNS != "" {
		for _, shape := range cfg.shapes {
			all = append(all, l.prefillScenario(shape))
		}
	}
	for _, sc := range all {
		w := workers
		if sc.workers != 0 {
			w = sc.workers
		}
		s, err := runScenario(ctx, cfg, b, l, sc, w, ps)
		if err != nil {
			return fmt.Errorf("%s %s %s w=%d: %w", r, sc.shape, sc.name, w, err)
		}
		s.rep = rep
		k := sampleKey{rtt: r.String(), shape: string(sc.shape), scenario: sc.name, workers: w}
		if _, seen := res.samples[k]; !seen {
			res.order = append(res.order, k)
			res.base[sc.name] = sc.base
		}
		res.samples[k] = append(res.samples[k], s)
		rt := ""
		if s.roundTrips > 0 {
			rt = fmt.Sprintf("%.2f rt/op", s.roundTrips)
		}
		fmt.Fprintf(log, "%s rep %d %-6s %-5s %-9s w=%-3d %8.0f ops/s  p50 %-8s p99 %-8s p999 %-8s %-11s %s\n", b.name, rep, r, sc.shape, sc.name, w,
			s.opsPerSec(), fmtDur(s.hist.quantile(0.5)), fmtDur(s.hist.quantile(0.99)), fmtDur(s.hist.quantile(0.999)), rt, s.note)
	}
	return nil
}

// runScenario resets the namespace, measures sc with w workers, counts
// the round trips through ps (nil: direct) and checks what sc wrote.
func runScenario[TTx any](ctx context.Context, cfg *config, b *backend[TTx], l *level[TTx], sc *scenario, w int, ps *proxySet) (*sample, error) {
	if sc.setup != nil {
		teardown, err := sc.setup(ctx)
		if err != nil {
			return nil, fmt.Errorf("%s: setup: %w", sc.name, err)
		}
		defer teardown()
	}
	a := l.p.admin
	if sc.admin != nil {
		a = sc.admin()
	}
	if err := reset(ctx, b, a, sc.name == "prefill"); err != nil {
		return nil, fmt.Errorf("%s: reset: %w", sc.name, err)
	}
	if sc.prepare != nil {
		if err := sc.prepare(ctx); err != nil {
			return nil, fmt.Errorf("%s: prepare: %w", sc.name, err)
		}
	}
	var before workload.Counts
	if sc.writes != writesNothing {
		var err error
		if before, err = a.counts(ctx, workload.CountsQuery(b.dialect)); err != nil {
			return nil, fmt.Errorf("%s: counts: %w", sc.name, err)
		}
	}
	var turns func() int64
	if ps != nil {
		turns = ps.turns
	}
	s, err := measure(ctx, sc, w, cfg.warmup, cfg.duration, turns)
	if err != nil {
		return nil, err
	}
	if err := checkWrites(ctx, b, a, sc, before, s.total); err != nil {
		return nil, fmt.Errorf("%s: %w", sc.name, err)
	}
	if sc.check != nil {
		note, extra, err := sc.check(ctx)
		if err != nil {
			return nil, err
		}
		s.note, s.extra = note, extra
	}
	return s, nil
}

// checkWrites is the exactly-once check after a writing measurement: the
// orders, lines, stock and completed records against the operations that
// succeeded (ops) and the counts taken before.
func checkWrites[TTx any](ctx context.Context, b *backend[TTx], a admin, sc *scenario, before workload.Counts, ops int64) error {
	if sc.writes == writesNothing {
		return nil
	}
	after, err := a.counts(ctx, workload.CountsQuery(b.dialect))
	if err != nil {
		return fmt.Errorf("counts: %w", err)
	}
	orders, keys := ops, ops
	if sc.expect != nil {
		orders, keys = sc.expect(ops)
	}
	if sc.writes != writesIdem {
		keys = 0
	}
	errs := []error{workload.CheckWrites(sc.shape, before, after, orders, keys)}
	if sc.writes == writesFloor {
		errs = append(errs, checkFloor(ctx, b, a, orders))
	}
	if sc.writes == writesFloorLock {
		errs = append(errs, checkFloorLock(ctx, a, floorResponsesTable, orders))
	}
	if sc.writes == writesFloorResp {
		errs = append(errs, checkFloorLock(ctx, a, floorRespTable, orders))
	}
	if sc.writes == writesRedis {
		done, pending, err := sc.redisKeys(ctx)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("count Redis keys: %w", err))
		case done != orders || pending != 0:
			errs = append(errs, fmt.Errorf("exactly-once check (redis): %d keys hold the response and %d do not, for %d orders", done, pending, orders))
		}
	}
	return errors.Join(errs...)
}

// reset empties the main namespace's tables and restores the seeded
// records; in the prefilled namespace it only removes what measurements
// added, which leaves the prefilled records in place.
func reset[TTx any](ctx context.Context, b *backend[TTx], a admin, prefilled bool) error {
	if prefilled {
		if err := a.exec(ctx, b.sql.deleteScope, "tenant-%"); err != nil {
			return err
		}
		for _, q := range b.sql.truncateOrders {
			if err := a.exec(ctx, q); err != nil {
				return err
			}
		}
		return nil
	}
	for _, q := range b.sql.reset {
		if err := a.exec(ctx, q); err != nil {
			return err
		}
	}
	return nil
}

// preparePrefill makes namespace ns hold cfg.prefill live records, unless
// an earlier run with -reuse-prefill completed it.
func preparePrefill[TTx any](ctx context.Context, cfg *config, b *backend[TTx], ns string, log io.Writer) error {
	existed, err := b.create(ctx, ns)
	if err != nil {
		return fmt.Errorf("create prefill namespace: %w", err)
	}
	p, err := b.open(ctx, ns, 8, "")
	if err != nil {
		return err
	}
	defer p.close()
	if existed {
		// A marker row, written last, says an earlier fill completed.
		n, err := p.admin.queryInt(ctx, b.sql.countCompleted, doneScope+"01")
		if err == nil && n == 1 {
			fmt.Fprintf(log, "%s: reusing %s (%d records)\n", b.name, ns, cfg.prefill)
			return nil
		}
		return fmt.Errorf("prefill namespace %s exists but its fill never completed: drop it and run again", ns)
	}
	t0 := time.Now()
	// Only the template: the prefill scenario reads no seeded key.
	if _, err := seedKeys(ctx, p.store, b.business(workload.Small), 0); err != nil {
		return err
	}
	if err := fill(ctx, b, p.admin, prefillScope, 1, int64(cfg.prefill), 10*365*24*time.Hour); err != nil {
		return err
	}
	for _, q := range b.sql.analyze {
		if err := p.admin.exec(ctx, q); err != nil {
			return fmt.Errorf("analyze: %w", err)
		}
	}
	if err := fill(ctx, b, p.admin, doneScope, 1, 1, 10*365*24*time.Hour); err != nil {
		return err
	}
	fmt.Fprintf(log, "%s: filled %s with %d records in %.1fs\n", b.name, ns, cfg.prefill, time.Since(t0).Seconds())
	return nil
}
