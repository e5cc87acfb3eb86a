package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"
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
	seedP, err := b.open(ctx, ns, 8)
	if err != nil {
		return nil, err
	}
	keys, err := seedKeys(ctx, seedP.store, b.insert, cfg.seeds)
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

	res.samples = make(map[sampleKey][]*sample)
	hotDone := make(map[int]bool)
	for rep := 1; rep <= cfg.reps; rep++ {
		for _, workers := range cfg.workers {
			if err := runLevel(ctx, cfg, b, res, rep, workers, ns, pfNS, keys, hotDone, log); err != nil {
				return nil, err
			}
		}
	}
	return res, nil
}

// runLevel measures every scenario once at one worker count.
func runLevel[TTx any](ctx context.Context, cfg *config, b *backend[TTx], res *dialectResult, rep, workers int,
	ns, pfNS string, keys []seedKey, hotDone map[int]bool, log io.Writer,
) error {
	l := &level[TTx]{cfg: cfg, b: b, seeds: keys, workers: workers, runID: cfg.runID, ns: ns, pfNS: pfNS}
	var err error
	if l.p, err = b.open(ctx, ns, workers); err != nil {
		return err
	}
	l.p.close = sync.OnceFunc(l.p.close) // prefill closes it early
	defer l.p.close()
	// hotkeys runs once per repetition, with its own worker count.
	if cfg.wants("hotkeys") && !hotDone[rep] {
		hotDone[rep] = true
		l.hotTurn = true
	}
	if cfg.wants("redis") {
		l.redis = newRedisClient(cfg.redisAddr, workers)
		defer l.redis.Close()
	}
	if cfg.wants("http") || cfg.wants("httpplain") {
		srv, err := newHTTPServer(l.p.store, b.insert)
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
	for _, sc := range l.scenarios() {
		w := workers
		if sc.workers != 0 {
			w = sc.workers
		}
		s, err := runScenario(ctx, cfg, b, l, sc, w)
		if err != nil {
			return err
		}
		s.rep = rep
		k := sampleKey{scenario: sc.name, workers: w}
		if _, seen := res.samples[k]; !seen {
			res.order = append(res.order, k)
			res.base[sc.name] = sc.base
		}
		res.samples[k] = append(res.samples[k], s)
		fmt.Fprintf(log, "%s rep %d %-9s w=%-3d %8.0f ops/s  p50 %-8s p99 %-8s p999 %-8s %s\n", b.name, rep, sc.name, w,
			s.opsPerSec(), fmtDur(s.hist.quantile(0.5)), fmtDur(s.hist.quantile(0.99)), fmtDur(s.hist.quantile(0.999)), s.note)
	}
	return nil
}

// runScenario resets the namespace and measures sc with w workers.
func runScenario[TTx any](ctx context.Context, cfg *config, b *backend[TTx], l *level[TTx], sc *scenario, w int) (*sample, error) {
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
	s, err := measure(ctx, sc, w, cfg.warmup, cfg.duration)
	if err != nil {
		return nil, err
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

// reset empties the main namespace's tables and restores the seeded
// records; in the prefilled namespace it only removes what measurements
// added, which leaves the prefilled records in place.
func reset[TTx any](ctx context.Context, b *backend[TTx], a admin, prefilled bool) error {
	if prefilled {
		return a.exec(ctx, b.sql.deleteScope, "tenant-%")
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
	p, err := b.open(ctx, ns, 8)
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
	if _, err := seedKeys(ctx, p.store, b.insert, 0); err != nil {
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
