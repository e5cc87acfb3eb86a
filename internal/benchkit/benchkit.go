// Package benchkit runs the same idempotency benchmarks against every
// dialect, so that their figures compare: each dialect's bench_test.go
// supplies the connections and the few statements that differ (a business
// insert, a primary-key read, a reset), and [Run] defines the scenarios.
//
// Every scenario runs as a sub-benchmark of one benchmark, serially
// (BenchmarkIdem/c=1/...) and from about 8 goroutines (BenchmarkIdem/c=8/...;
// other levels through [LevelsEnv]); the writing scenarios once per
// business shape (BenchmarkIdem/c=8/small/<scenario>,
// BenchmarkIdem/c=8/order/<scenario>; [ShapesEnv] picks them), the reads
// once (BenchmarkIdem/c=8/read/<scenario>). So one `go test -bench` run
// measures the bare business transaction next to each idempotent variant
// and the ratio can be read directly (each scenario reports it as the
// x_bare or x_pk_select metric, and internal/cmd/benchratio prints the
// tables). Every writing measurement ends with the exactly-once check of
// workload.CheckWrites.
// docs/performance.md describes the scenarios and the results.
package benchkit

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/workload"
)

// defaultLevels are the concurrency levels measured by default: serial,
// and about 8 goroutines (pool size 8).
var defaultLevels = []int{1, 8}

// LevelsEnv names the environment variable that replaces the default
// concurrency levels with a comma-separated list, such as "1,8,32". c=32 is
// not a default: its pools hold 32 connections per dialect for the whole
// run (plus the other levels'), which a shared server with PostgreSQL's
// default max_connections of 100 may not have to spare.
const LevelsEnv = "IDEM_BENCH_CONC"

// ShapesEnv names the environment variable that replaces the default
// business shapes ("small,order", see workload.Shape) of the writing
// scenarios with a comma-separated list.
const ShapesEnv = "IDEM_BENCH_SHAPES"

// shapes returns the business shapes to measure.
func shapes() ([]workload.Shape, error) {
	v := os.Getenv(ShapesEnv)
	if v == "" {
		return workload.Shapes, nil
	}
	s, err := workload.ParseShapes(v)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", ShapesEnv, err)
	}
	return s, nil
}

// levels returns the concurrency levels to measure.
func levels() ([]int, error) {
	v := os.Getenv(LevelsEnv)
	if v == "" {
		return defaultLevels, nil
	}
	var out []int
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > 256 {
			return nil, fmt.Errorf("%s=%q: want comma-separated concurrency levels from 1 to 256", LevelsEnv, v)
		}
		out = append(out, n)
	}
	return out, nil
}

// Sizes of the workload, as in the lab measurements of issue 5.
const (
	tenants = workload.Tenants // scopes
	seeds   = 1000             // completed keys that replay and mismatch read
)

// Pools is what a benchmark at one concurrency level runs on. Pool sizes
// equal the concurrency level.
type Pools[TTx any] struct {
	// Store runs the writing scenarios (bare, tx, do, separate_tx, leased).
	// Its dialect's Begin starts every business transaction.
	Store *idem.Store[TTx]
	// ReadStore runs replay and mismatch; nil means Store. SQLite uses a
	// single-connection pool for writes and a pool of its own for reads.
	ReadStore *idem.Store[TTx]
	// PKSelect reads the stored response of (scope, key) with one plain
	// primary-key SELECT on ReadStore's pool: the baseline of replay.
	PKSelect func(ctx context.Context, scope, key string) error
	// Floor is the least any design with the protocol's semantics must do
	// for a new key, written by hand with the dialect's cheapest statements
	// and without idem: the business transaction (begun as Store's dialect
	// begins it, with business for tenant scope) plus one primary-key
	// read of the key before the business write and one insert of the
	// finished record after it, batched like Do batches where the driver
	// can. It takes no lock and decides nothing, so it is not safe (two
	// concurrent duplicates would both write); its throughput bounds what
	// idem's transactional path can reach on this machine.
	Floor func(ctx context.Context, business func(context.Context, TTx, string) error, scope, key string) error
}

// Target is one dialect under benchmark, on a namespace (schema, database
// or file) of its own that already holds the migrated idempotency_keys
// table and the tables of workload.Tables, with the products of
// workload.FillProducts.
type Target[TTx any] struct {
	// Open returns pools of size conc on the namespace, closed when b ends.
	Open func(b *testing.B, conc int) *Pools[TTx]
	// Business returns the statements of shape s, run in tx for tenant
	// (workload.PGBusiness or workload.SQLBusiness).
	Business func(s workload.Shape) func(ctx context.Context, tx TTx, tenant string) error
	// Snapshot copies the seeded idempotency records aside; Reset empties
	// the orders, order_lines and idempotency_keys tables, restores the
	// copy, refreshes the planner statistics and checkpoints, so that
	// every measurement starts from the same state.
	Snapshot func(ctx context.Context) error
	Reset    func(ctx context.Context) error
	// Counts reads workload.CountsQuery on the namespace.
	Counts func(ctx context.Context) (workload.Counts, error)
}

// Response is what every completion stores (workload.Response).
var Response = workload.Response

// Fingerprint is the fingerprint of every fresh request (workload.Fingerprint).
var Fingerprint = workload.Fingerprint

var (
	fingerprint = workload.Fingerprint
	// otherFingerprint is a different request presented with a seeded key.
	otherFingerprint = idem.NewFingerprint([]byte("POST /orders"), []byte(`{"amount":1}`))
	scopes           = workload.Scopes
)

type seedKey struct{ scope, key string }

// scenario is one sub-benchmark: op performs one operation.
type scenario struct {
	name string
	op   func(ctx context.Context) error
	// keys is whether each operation completes an idempotency record;
	// reads are not checked.
	keys, read bool
}

// Run runs every scenario at every concurrency level against t.
func Run[TTx any](b *testing.B, t Target[TTx]) {
	b.Helper()
	ctx := context.Background()
	concs, err := levels()
	if err != nil {
		b.Fatal(err)
	}
	shapes, err := shapes()
	if err != nil {
		b.Fatal(err)
	}
	pools := make([]*Pools[TTx], len(concs))
	for i, c := range concs {
		pools[i] = t.Open(b, c)
	}

	// Seed the replay targets through the library itself, then keep them.
	keys := make([]seedKey, seeds)
	for i := range keys {
		keys[i] = seedKey{scope: scopes[i%tenants], key: workload.NewKey()}
	}
	if err := seed(ctx, pools[len(pools)-1].Store, t.Business(workload.Small), keys); err != nil {
		b.Fatalf("seed: %v", err)
	}
	if err := t.Snapshot(ctx); err != nil {
		b.Fatalf("snapshot: %v", err)
	}

	for i, c := range concs {
		b.Run("c="+strconv.Itoa(c), func(b *testing.B) {
			for _, shape := range shapes {
				b.Run(string(shape), func(b *testing.B) {
					var base baselines
					for _, s := range writeScenarios(pools[i], t.Business(shape)) {
						b.Run(s.name, func(b *testing.B) {
							measure(b, t, shape, c, s)
							base.report(b, s.name)
						})
					}
				})
			}
			b.Run("read", func(b *testing.B) {
				var base baselines
				for _, s := range readScenarios(pools[i], keys) {
					b.Run(s.name, func(b *testing.B) {
						measure(b, t, "", c, s)
						base.report(b, s.name)
					})
				}
			})
		})
	}
}

// baselines keeps the ns/op of bare and pk_select, measured earlier in the
// same run at the same concurrency, so that every other scenario reports its
// throughput ratio to its baseline as a metric of its own: `go test -bench`
// prints the ratio directly ("x_bare", "x_pk_select"; above 1 is faster than
// the baseline), and benchstat compares it like ns/op.
type baselines struct{ bare, pkSelect, floor float64 }

func (base *baselines) report(b *testing.B, scenario string) {
	b.Helper()
	if b.N == 0 || b.Elapsed() <= 0 {
		return
	}
	ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	switch scenario {
	case "bare":
		base.bare = ns
	case "pk_select":
		base.pkSelect = ns
	case "floor":
		base.floor = ns
		if base.bare > 0 {
			b.ReportMetric(base.bare/ns, "x_bare")
		}
	case "replay", "mismatch":
		if base.pkSelect > 0 {
			b.ReportMetric(base.pkSelect/ns, "x_pk_select")
		}
	default:
		if base.bare > 0 {
			b.ReportMetric(base.bare/ns, "x_bare")
		}
		if base.floor > 0 && (scenario == "tx" || scenario == "do") {
			b.ReportMetric(base.floor/ns, "x_floor")
		}
	}
}

// measure resets the tables, then runs s.op b.N times: in a loop when conc
// is 1, otherwise from about conc goroutines; then, for a writing scenario,
// checks that every successful operation wrote its order (of shape) once
// and, with s.keys, completed its record.
func measure[TTx any](b *testing.B, t Target[TTx], shape workload.Shape, conc int, s scenario) {
	b.Helper()
	ctx := context.Background()
	if err := t.Reset(ctx); err != nil {
		b.Fatalf("reset: %v", err)
	}
	var before workload.Counts
	if !s.read {
		var err error
		if before, err = t.Counts(ctx); err != nil {
			b.Fatalf("counts: %v", err)
		}
	}
	var ops atomic.Int64
	op := func(ctx context.Context) error {
		err := s.op(ctx)
		if err == nil {
			ops.Add(1)
		}
		return err
	}
	defer func() {
		if s.read || b.Failed() {
			return
		}
		b.StopTimer()
		after, err := t.Counts(ctx)
		if err != nil {
			b.Fatalf("counts: %v", err)
		}
		keys := int64(0)
		if s.keys {
			keys = ops.Load()
		}
		if err := workload.CheckWrites(shape, before, after, ops.Load(), keys); err != nil {
			b.Fatal(err)
		}
	}()
	b.ReportAllocs()
	if conc == 1 {
		for b.Loop() {
			if err := op(ctx); err != nil {
				b.Fatal(err)
			}
		}
		return
	}
	// RunParallel starts parallelism × GOMAXPROCS goroutines: 8 on 2 cores.
	b.SetParallelism((conc + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
	var (
		once  sync.Once
		first error
	)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := op(ctx); err != nil {
				once.Do(func() { first = err })
				return
			}
		}
	})
	if first != nil {
		b.Fatal(first)
	}
}

// writeScenarios are the scenarios writing an order with insert.
func writeScenarios[TTx any](p *Pools[TTx], insert func(context.Context, TTx, string) error) []scenario {
	s, d := p.Store, p.Store.Dialect()
	// One Do callback per tenant, built once, so that Do's figures carry
	// no allocation of the benchmark's own.
	callbacks := make([]func(context.Context, TTx) (*idem.Response, error), tenants)
	for i := range callbacks {
		tenant := scopes[i]
		callbacks[i] = func(ctx context.Context, tx TTx) (*idem.Response, error) {
			if err := insert(ctx, tx, tenant); err != nil {
				return nil, err
			}
			return Response, nil
		}
	}
	// inTx runs fn in a business transaction and commits it.
	inTx := func(ctx context.Context, fn func(tx TTx) error) error {
		tx, err := d.Begin(ctx)
		if err != nil {
			return err
		}
		if err := fn(tx); err != nil {
			_ = d.Rollback(ctx, tx)
			return err
		}
		return d.Commit(ctx, tx)
	}
	return []scenario{
		{"bare", func(ctx context.Context) error {
			tenant := scopes[rand.IntN(tenants)] //nolint:gosec // not security-sensitive: benchmark workload randomness
			return inTx(ctx, func(tx TTx) error { return insert(ctx, tx, tenant) })
		}, false, false},
		{"floor", func(ctx context.Context) error {
			return p.Floor(ctx, insert, scopes[rand.IntN(tenants)], workload.NewKey()) //nolint:gosec // not security-sensitive: benchmark workload randomness
		}, true, false},
		{"tx", func(ctx context.Context) error {
			scope, key := scopes[rand.IntN(tenants)], workload.NewKey() //nolint:gosec // not security-sensitive: benchmark workload randomness
			return inTx(ctx, func(tx TTx) error {
				c, err := s.ClaimTx(ctx, tx, scope, key, fingerprint)
				if err != nil {
					return err
				}
				if !c.Acquired() {
					return errors.New("tx: fresh key not acquired")
				}
				if err := insert(ctx, tx, scope); err != nil {
					return err
				}
				return s.CompleteTx(ctx, tx, c, Response)
			})
		}, true, false},
		{"do", func(ctx context.Context) error {
			i := rand.IntN(tenants) //nolint:gosec // not security-sensitive: benchmark workload randomness
			res, err := s.Do(ctx, scopes[i], workload.NewKey(), fingerprint, callbacks[i])
			if err == nil && res.Replayed {
				err = errors.New("do: fresh key replayed")
			}
			return err
		}, true, false},
		{"separate_tx", func(ctx context.Context) error {
			scope, key := scopes[rand.IntN(tenants)], workload.NewKey() //nolint:gosec // not security-sensitive: benchmark workload randomness
			c, err := s.Claim(ctx, scope, key, fingerprint)
			if err != nil {
				return err
			}
			if !c.Acquired() {
				return errors.New("separate_tx: fresh key not acquired")
			}
			return inTx(ctx, func(tx TTx) error {
				if err := insert(ctx, tx, scope); err != nil {
					return err
				}
				return s.CompleteTx(ctx, tx, c, Response)
			})
		}, true, false},
		{"leased", func(ctx context.Context) error {
			scope, key := scopes[rand.IntN(tenants)], workload.NewKey() //nolint:gosec // not security-sensitive: benchmark workload randomness
			l, err := s.Acquire(ctx, scope, key, fingerprint)
			if err != nil {
				return err
			}
			if !l.Acquired() {
				return errors.New("leased: fresh key not acquired")
			}
			return inTx(ctx, func(tx TTx) error {
				if err := insert(ctx, tx, scope); err != nil {
					return err
				}
				return l.CompleteTx(ctx, tx, Response)
			})
		}, true, false},
	}
}

// readScenarios are the scenarios reading the seeded keys.
func readScenarios[TTx any](p *Pools[TTx], keys []seedKey) []scenario {
	rs := p.ReadStore
	if rs == nil {
		rs = p.Store
	}
	seeded := func() seedKey { return keys[rand.IntN(len(keys))] } //nolint:gosec // not security-sensitive: benchmark workload randomness
	return []scenario{
		{"pk_select", func(ctx context.Context) error {
			k := seeded()
			return p.PKSelect(ctx, k.scope, k.key)
		}, false, true},
		{"replay", func(ctx context.Context) error {
			k := seeded()
			c, err := rs.Claim(ctx, k.scope, k.key, fingerprint)
			if err == nil && c.Replay == nil {
				err = errors.New("replay: seeded key acquired")
			}
			return err
		}, false, true},
		{"mismatch", func(ctx context.Context) error {
			k := seeded()
			_, err := rs.Claim(ctx, k.scope, k.key, otherFingerprint)
			if !errors.Is(err, idem.ErrFingerprint) {
				return fmt.Errorf("mismatch: want ErrFingerprint, got %v", err) //nolint:errorlint // err may be nil (%w would print %!w(<nil>)); it is only reported
			}
			return nil
		}, false, true},
	}
}

// seed completes keys through s.Do from 8 goroutines.
func seed[TTx any](ctx context.Context, s *idem.Store[TTx], insert func(context.Context, TTx, string) error, keys []seedKey) error {
	return workload.Complete(ctx, s, insert, len(keys), func(i int) (string, string) { return keys[i].scope, keys[i].key })
}
