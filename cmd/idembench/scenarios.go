package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
	"github.com/idemstore/idem/internal/workload"
)

// tenants is the number of scopes, as in internal/benchkit and the lab runs of issue 5.
const tenants = workload.Tenants

// Scopes of the rows the tool writes with SQL rather than through idem.
const (
	templateScope = "idembench-template" // the record the fills copy
	templateKey   = "template"
	prefillScope  = "pf-"  // prefix of prefilled records (live)
	expiredScope  = "exp-" // prefix of records seeded for the reaper (expired)
	hotScope      = "hot"  // the scope of the hotkeys scenario
	// doneScope+"01" marks a completed fill of a reusable prefilled namespace.
	doneScope = "idembench-done-"
)

// response is what every completion stores, fingerprint its request's:
// those of internal/benchkit (package workload), so that the figures compare
// with BenchmarkIdem's.
var (
	response    = workload.Response
	fingerprint = workload.Fingerprint
	scopes      = workload.Scopes
)

func randomScope() string { return scopes[rand.IntN(tenants)] } //nolint:gosec // workload randomness

type seedKey struct{ scope, key string }

// pools are the connections of one worker count on one namespace.
type pools[TTx any] struct {
	// store runs the writes; its dialect begins the business transactions.
	store *idem.Store[TTx]
	// readStore runs replay and get: store, except on SQLite, where
	// writes go through one connection and reads through their own pool.
	readStore *idem.Store[TTx]
	// pkSelect reads what a replay needs by primary key on readStore's pool.
	pkSelect func(ctx context.Context, scope, key string) error
	// storePKSelect is pkSelect on store's pool, the one the middleware
	// replays from: the baseline of httpreplay (on SQLite, the writers' one
	// connection; elsewhere pkSelect).
	storePKSelect func(ctx context.Context, scope, key string) error
	// optStore is store with optimistic claims in Do
	// (idemmysql.WithOptimisticDo), on the same pool; nil on the dialects
	// that have none.
	optStore *idem.Store[TTx]
	// floorLock: openFloor's runner measures floorlock, floorlockbound and
	// floorresp (MariaDB).
	floorLock bool
	// floorKeyLock: openFloor's runner measures floorlock, the floor with
	// the key's advisory lock (PostgreSQL).
	floorKeyLock bool
	// admin runs the tool's own statements on the namespace.
	admin admin
	// openFloor opens the floor scenarios' runner on these pools, for
	// floortx (callerTx) or floor.
	openFloor func(ctx context.Context, callerTx bool) (*floorRunner[TTx], error)
	close     func()
}

// admin runs statements of the tool itself (resets, fills, counts),
// always on a direct connection, never through the latency proxy.
type admin interface {
	exec(ctx context.Context, query string, args ...any) error
	queryInt(ctx context.Context, query string, args ...any) (int64, error)
	// counts reads workload.CountsQuery.
	counts(ctx context.Context, query string) (workload.Counts, error)
}

// statements are the SQL texts that differ between dialects.
type statements struct {
	snapshot string   // copies the seeded records aside
	reset    []string // empties the tables and restores the copy
	// truncateOrders empties the orders and order_lines tables (in the
	// prefilled namespace, whose records only lose the tenants' scopes).
	truncateOrders []string
	// fill copies the template record into keys from..to of the scopes
	// prefix+"00".."99", its retention deadline moved by shift; fillArgs
	// orders and converts the arguments for it.
	fill     string
	fillPrep []string // run before fill's chunks
	fillArgs func(prefix string, from, to int64, shift time.Duration) []any
	// countOrders counts the orders of one tenant; countCompleted the
	// succeeded records of one scope; deleteScope deletes records of
	// a scope prefix (arg: the prefix followed by the LIKE wildcard).
	countOrders    string
	countCompleted string
	deleteScope    string
	// analyze refreshes the planner statistics after a fill.
	analyze []string
	// floorDone is the WHERE clause of floorTable's finished rows.
	floorDone string
}

// backend is one dialect's side of the tool: how to create, open and drop a
// namespace, and the statements that differ.
type backend[TTx any] struct {
	name    string
	dialect workload.Dialect
	sql     statements
	// serverAddr is the host:port the latency proxy forwards to ("" for
	// SQLite, which runs in the process).
	serverAddr string
	// version returns the server version.
	version func(ctx context.Context) (string, error)
	// create creates namespace ns, migrated with the shipped migrations and
	// holding an orders table, unless it exists; it reports whether it did.
	create func(ctx context.Context, ns string) (existed bool, err error)
	drop   func(ctx context.Context, ns string) error
	// open opens pools of conns connections on ns; via, when not empty,
	// is the host:port of the proxy the measured pools (not the admin
	// one) connect through.
	open func(ctx context.Context, ns string, conns int, via string) (*pools[TTx], error)
	// business returns shape's statements, run in tx for tenant.
	business func(shape workload.Shape) func(ctx context.Context, tx TTx, tenant string) error
	close    func()
	// storeCfg is the Config of the Stores open makes (nil: the defaults).
	storeCfg *idem.Config
}

// inTx runs fn in a business transaction of s's dialect and commits it.
func inTx[TTx any](ctx context.Context, s *idem.Store[TTx], fn func(tx TTx) error) error {
	d := s.Dialect()
	tx, err := d.Begin(ctx)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	if err := fn(tx); err != nil {
		_ = d.Rollback(ctx, tx)
		return err
	}
	if err := d.Commit(ctx, tx); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

var errNotAcquired = errors.New("fresh key not acquired")

// level is what the scenarios of one worker count and RTT setting run on.
type level[TTx any] struct {
	cfg        *config
	b          *backend[TTx]
	p          *pools[TTx]   // main namespace
	ns         string        // main namespace
	pfNS       string        // prefilled namespace, "" without prefill
	hotTurn    bool          // hotkeys runs at this worker count
	redis      *redis.Client // nil without the redis scenario; through the proxy
	redisAdmin *redis.Client // direct, for the exactly-once check
	via        string        // the database proxy's address, "" for direct
	seeds      []seedKey
	workers    int
	runID      string
	httpSrv    *httptest.Server
	httpCli    *http.Client
	gen        *atomic.Int64 // numbers measurements, for Redis key prefixes
}

// readScenarios returns the selected scenarios that only read the seeded
// keys (no shape), in the order they run.
func (l *level[TTx]) readScenarios() []*scenario {
	rs := l.p.readStore
	seeded := func() seedKey { return l.seeds[rand.IntN(len(l.seeds))] } //nolint:gosec // workload randomness
	// cachedreplay's Store: the read Store's dialect with Config.ReplayCache
	// holding every seed.
	cached := sync.OnceValues(func() (*idem.Store[TTx], error) {
		var cfg idem.Config
		if l.b.storeCfg != nil {
			cfg = *l.b.storeCfg
		}
		cfg.ReplayCache = &idem.ReplayCacheConfig{MaxEntries: len(l.seeds) + 1}
		return idem.New(rs.Dialect(), &cfg)
	})
	all := []*scenario{
		{name: "replay", base: "pkselect", op: func(ctx context.Context, _ int) error {
			k := seeded()
			res, err := rs.Do(ctx, k.scope, k.key, fingerprint, func(context.Context, TTx) (*idem.Response, error) {
				return nil, errors.New("completed key executed again")
			})
			if err == nil && !res.Replayed {
				err = errors.New("completed key not replayed")
			}
			return err
		}},
		{name: "cachedreplay", base: "pkselect", op: func(ctx context.Context, _ int) error {
			// Its first pass over the seeds fills the cache, in the warm-up.
			cs, err := cached()
			if err != nil {
				return err
			}
			k := seeded()
			res, err := cs.Do(ctx, k.scope, k.key, fingerprint, func(context.Context, TTx) (*idem.Response, error) {
				return nil, errors.New("completed key executed again")
			})
			if err == nil && !res.Replayed {
				err = errors.New("completed key not replayed")
			}
			return err
		}},
		{name: "get", base: "pkselect", op: func(ctx context.Context, _ int) error {
			k := seeded()
			_, err := rs.Get(ctx, k.scope, k.key)
			return err
		}},
		{name: "pkselect", op: func(ctx context.Context, _ int) error {
			k := seeded()
			return l.p.pkSelect(ctx, k.scope, k.key)
		}},
	}
	return slices.DeleteFunc(all, func(sc *scenario) bool { return !l.cfg.wants(sc.name) })
}

// claimTxOp is the tx scenario's operation on s: BEGIN; ClaimTx; the
// business statements; CompleteTx; COMMIT.
func claimTxOp[TTx any](s *idem.Store[TTx], insert func(context.Context, TTx, string) error) func(ctx context.Context, _ int) error {
	return func(ctx context.Context, _ int) error {
		scope, key := randomScope(), workload.NewKey()
		return inTx(ctx, s, func(tx TTx) error {
			c, err := s.ClaimTx(ctx, tx, scope, key, fingerprint)
			if err != nil {
				return err
			}
			if !c.Acquired() {
				return errNotAcquired
			}
			if err := insert(ctx, tx, scope); err != nil {
				return err
			}
			return s.CompleteTx(ctx, tx, c, response)
		})
	}
}

// scenarios returns the selected writing scenarios of shape, in the order
// they run; prefill, which closes the main pools, is left to
// prefillScenario.
func (l *level[TTx]) scenarios(shape workload.Shape) []*scenario {
	s, insert := l.p.store, l.b.business(shape)
	callbacks := make([]func(context.Context, TTx) (*idem.Response, error), tenants)
	for i := range callbacks {
		tenant := scopes[i]
		callbacks[i] = func(ctx context.Context, tx TTx) (*idem.Response, error) {
			return response, insert(ctx, tx, tenant)
		}
	}
	all := []*scenario{
		{name: "bare", writes: writesPlain, op: func(ctx context.Context, _ int) error {
			tenant := randomScope()
			return inTx(ctx, s, func(tx TTx) error { return insert(ctx, tx, tenant) })
		}},
		{name: "tx", writes: writesIdem, op: claimTxOp(s, insert)},
		{name: "do", writes: writesIdem, op: func(ctx context.Context, _ int) error {
			i := rand.IntN(tenants) //nolint:gosec // workload randomness
			res, err := s.Do(ctx, scopes[i], workload.NewKey(), fingerprint, callbacks[i])
			if err == nil && res.Replayed {
				err = errors.New("fresh key replayed")
			}
			return err
		}},
		{name: "separate", writes: writesIdem, op: func(ctx context.Context, _ int) error {
			scope, key := randomScope(), workload.NewKey()
			c, err := s.Claim(ctx, scope, key, fingerprint)
			if err != nil {
				return err
			}
			if !c.Acquired() {
				return errNotAcquired
			}
			return inTx(ctx, s, func(tx TTx) error {
				if err := insert(ctx, tx, scope); err != nil {
					return err
				}
				return s.CompleteTx(ctx, tx, c, response)
			})
		}},
		{name: "leased", writes: writesIdem, op: func(ctx context.Context, _ int) error {
			scope, key := randomScope(), workload.NewKey()
			lease, err := s.Acquire(ctx, scope, key, fingerprint)
			if err != nil {
				return err
			}
			if !lease.Acquired() {
				return errNotAcquired
			}
			return inTx(ctx, s, func(tx TTx) error {
				if err := insert(ctx, tx, scope); err != nil {
					return err
				}
				return lease.CompleteTx(ctx, tx, response)
			})
		}},
	}
	if opt := l.p.optStore; opt != nil {
		all = append(all, &scenario{name: "doopt", writes: writesIdem, op: func(ctx context.Context, _ int) error {
			i := rand.IntN(tenants) //nolint:gosec // workload randomness
			res, err := opt.Do(ctx, scopes[i], workload.NewKey(), fingerprint, callbacks[i])
			if err == nil && res.Replayed {
				err = errors.New("fresh key replayed")
			}
			return err
		}})
	}
	all = append(all, l.floorScenarios(insert)...)
	if l.cfg.wants("hotkeys") && l.hotTurn {
		all = append(all, l.hotkeys(insert))
	}
	all = append(all, &scenario{
		name: "reaper", base: "tx", writes: writesIdem, op: claimTxOp(s, insert),
		prepare: func(ctx context.Context) error {
			return fill(ctx, l.b, l.p.admin, expiredScope, 1, int64(l.cfg.reaperRows), -48*time.Hour)
		},
		during: func(ctx context.Context) (string, map[string]float64, error) {
			return reap(ctx, s, l.cfg.reaperRows, &idem.ReaperConfig{BatchPause: l.cfg.reaperPause, BatchSize: l.cfg.reaperBatch})
		},
	})
	if l.redis != nil {
		all = append(all, l.redisScenario(insert))
	}
	if l.httpSrv != nil {
		all = append(all, l.httpScenarios(shape)...)
	}
	var out []*scenario
	for _, sc := range all {
		if l.cfg.wants(sc.name) {
			sc.shape = shape
			out = append(out, sc)
		}
	}
	return out
}

// prefillScenario runs tx of shape on the prefilled namespace. It runs
// after every other scenario of its worker count and closes the main pools
// first: with both open at 64 workers, PostgreSQL's 100 connections would
// not suffice.
func (l *level[TTx]) prefillScenario(shape workload.Shape) *scenario {
	var pf *pools[TTx]
	sc := &scenario{name: "prefill", base: "tx", shape: shape, writes: writesIdem}
	sc.admin = func() admin { return pf.admin }
	sc.setup = func(ctx context.Context) (func(), error) {
		l.p.close()
		var err error
		if pf, err = l.b.open(ctx, l.pfNS, l.workers, l.via); err != nil {
			return nil, err
		}
		sc.op = claimTxOp(pf.store, l.b.business(shape))
		return pf.close, nil
	}
	return sc
}

// reap runs reaper passes until want expired records are gone or ctx ends,
// and reports the rate.
func reap[TTx any](ctx context.Context, s *idem.Store[TTx], want int, cfg *idem.ReaperConfig) (string, map[string]float64, error) {
	// Defaults otherwise (batches of 1000): the reaper as a service runs it.
	r, err := idem.NewReaper(s, cfg)
	if err != nil {
		return "", nil, err
	}
	t0 := time.Now()
	deleted := 0
	for deleted < want && ctx.Err() == nil {
		rep, err := r.RunOnce(ctx)
		deleted += rep.Deleted
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			return "", nil, fmt.Errorf("reaper: %w", err)
		}
		if rep.Deleted == 0 {
			break
		}
	}
	el := time.Since(t0)
	rate := float64(deleted) / el.Seconds()
	note := fmt.Sprintf("reaper %.0f rows/s (%d rows in %.1fs)", rate, deleted, el.Seconds())
	return note, map[string]float64{"reaper_rows_per_s": rate, "reaper_rows": float64(deleted)}, nil
}

// hotkeys runs cfg.hotWorkers workers on cfg.hotKeys keys at a time: the
// set of keys moves on every hotWindow, so each key meets duplicates while
// it runs (waits, in progress) and after it completed (replays).
func (l *level[TTx]) hotkeys(insert func(context.Context, TTx, string) error) *scenario {
	const hotWindow = 20 * time.Millisecond
	var (
		executed, replayed, inProgress atomic.Int64
		t0                             time.Time
		gen                            atomic.Int64
	)
	var hot *pools[TTx]
	return &scenario{
		name: "hotkeys", workers: l.cfg.hotWorkers, writes: writesIdem,
		// Only the executions write an order and complete a key.
		expect: func(int64) (int64, int64) { return executed.Load(), executed.Load() },
		setup: func(ctx context.Context) (func(), error) {
			// More connections than 16 would not add waits on the keys,
			// only on PostgreSQL's 100 connections, shared by the machine.
			var err error
			hot, err = l.b.open(ctx, l.ns, min(l.cfg.hotWorkers, 16), l.via)
			if err != nil {
				return nil, err
			}
			return hot.close, nil
		},
		prepare: func(context.Context) error {
			executed.Store(0)
			replayed.Store(0)
			inProgress.Store(0)
			gen.Add(1)
			t0 = time.Now()
			return nil
		},
		op: func(ctx context.Context, _ int) error {
			window := int64(time.Since(t0) / hotWindow)
			key := fmt.Sprintf("%s-%d-%d-%d", l.runID, gen.Load(), window, rand.IntN(l.cfg.hotKeys)) //nolint:gosec // workload randomness
			res, err := hot.store.Do(ctx, hotScope, key, fingerprint, func(ctx context.Context, tx TTx) (*idem.Response, error) {
				return response, insert(ctx, tx, hotScope)
			})
			switch {
			case errors.Is(err, idem.ErrInProgress):
				inProgress.Add(1)
				return nil
			case err != nil:
				return err
			case res.Replayed:
				replayed.Add(1)
			default:
				executed.Add(1)
			}
			return nil
		},
		check: func(ctx context.Context) (string, map[string]float64, error) {
			orders, err := hot.admin.queryInt(ctx, l.b.sql.countOrders, hotScope)
			if err != nil {
				return "", nil, fmt.Errorf("count orders: %w", err)
			}
			keys, err := hot.admin.queryInt(ctx, l.b.sql.countCompleted, hotScope)
			if err != nil {
				return "", nil, fmt.Errorf("count completed keys: %w", err)
			}
			ex, rp, ip := executed.Load(), replayed.Load(), inProgress.Load()
			note := fmt.Sprintf("executed %d, replayed %d, in progress %d; %d keys completed, %d orders", ex, rp, ip, keys, orders)
			extra := map[string]float64{
				"executed": float64(ex), "replayed": float64(rp), "in_progress": float64(ip),
				"keys_completed": float64(keys), "orders": float64(orders),
			}
			if ex != keys || orders != keys {
				return note, extra, fmt.Errorf("hotkeys: duplicate or lost execution: %s", note)
			}
			return note, extra, nil
		},
	}
}

// redisScenario is the pattern other services use instead of idem: SET NX
// with a lease in Redis (go-redis SetNX with a 30 s expiry), the bare
// business transaction, then SET of the response. Completed keys live 10
// minutes instead of a day, so that the shared Redis does not keep the
// run's keys; expiry costs Redis nothing per operation either way. The
// check counts the measurement's keys holding the response: one per order.
func (l *level[TTx]) redisScenario(insert func(context.Context, TTx, string) error) *scenario {
	s := l.p.store
	var prefix string
	return &scenario{
		name: "redis", writes: writesRedis,
		prepare: func(context.Context) error {
			prefix = fmt.Sprintf("idembench:%s:%d:", l.runID, l.gen.Add(1))
			return nil
		},
		op: func(ctx context.Context, _ int) error {
			scope, key := randomScope(), prefix+workload.NewKey()
			ok, err := l.redis.SetNX(ctx, key, "processing", 30*time.Second).Result()
			if err != nil {
				return err
			}
			if !ok {
				return errNotAcquired
			}
			if err := inTx(ctx, s, func(tx TTx) error { return insert(ctx, tx, scope) }); err != nil {
				return err
			}
			return l.redis.Set(ctx, key, response.Body, 10*time.Minute).Err()
		},
		redisKeys: func(ctx context.Context) (done, pending int64, err error) {
			return countRedisKeys(ctx, l.redisAdmin, prefix)
		},
	}
}

// countRedisKeys counts the keys under prefix holding the response (done)
// and holding anything else (pending).
func countRedisKeys(ctx context.Context, rc *redis.Client, prefix string) (done, pending int64, err error) {
	iter := rc.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	var batch []string
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		vals, err := rc.MGet(ctx, batch...).Result()
		if err != nil {
			return err
		}
		for _, v := range vals {
			if s, ok := v.(string); ok && s == string(response.Body) {
				done++
			} else {
				pending++
			}
		}
		batch = batch[:0]
		return nil
	}
	for iter.Next(ctx) {
		batch = append(batch, iter.Val())
		if len(batch) == 500 {
			if err := flush(); err != nil {
				return 0, 0, err
			}
		}
	}
	if err := iter.Err(); err != nil {
		return 0, 0, err
	}
	return done, pending, flush()
}

// httpScenarios post orders of shape to the test server: through the
// middleware (http; httpopt over the optimistic Store where the dialect
// has one) and to the same handler without it (httpplain); and replays
// through the middleware (httpreplay) beside a plain read endpoint
// (httppk).
func (l *level[TTx]) httpScenarios(shape workload.Shape) []*scenario {
	plain, idem := "/plain/"+string(shape)+"/orders", "/idem/"+string(shape)+"/orders"
	replayKeys := make([]string, 200)
	all := []*scenario{
		{name: "httpplain", writes: writesPlain, op: func(ctx context.Context, _ int) error {
			_, err := l.post(ctx, plain, workload.NewKey(), http.StatusCreated)
			return err
		}},
		{name: "http", base: "httpplain", writes: writesIdem, op: func(ctx context.Context, _ int) error {
			_, err := l.post(ctx, idem, workload.NewKey(), http.StatusCreated)
			return err
		}},
		{name: "httppk", op: func(ctx context.Context, _ int) error {
			k := l.seeds[rand.IntN(len(l.seeds))] //nolint:gosec // workload randomness
			_, err := l.post(ctx, "/pk/"+url.PathEscape(k.scope)+"/"+url.PathEscape(k.key), k.key, http.StatusCreated)
			return err
		}},
		{name: "httpreplay", base: "httppk",
			prepare: func(ctx context.Context) error {
				for i := range replayKeys {
					replayKeys[i] = workload.NewKey()
					if _, err := l.post(ctx, idem, replayKeys[i], http.StatusCreated); err != nil {
						return err
					}
				}
				return nil
			},
			op: func(ctx context.Context, _ int) error {
				h, err := l.post(ctx, idem, replayKeys[rand.IntN(len(replayKeys))], http.StatusCreated) //nolint:gosec // workload randomness
				if err == nil && h.Get("Idempotency-Replayed") != "true" {
					err = errors.New("completed key not replayed")
				}
				return err
			}},
	}
	if l.p.optStore != nil {
		opt := "/idemopt/" + string(shape) + "/orders"
		all = slices.Insert(all, 2, &scenario{name: "httpopt", base: "httpplain", writes: writesIdem, op: func(ctx context.Context, _ int) error {
			_, err := l.post(ctx, opt, workload.NewKey(), http.StatusCreated)
			return err
		}})
	}
	return all
}

// post sends orderRequest to path with key and checks the status.
func (l *level[TTx]) post(ctx context.Context, path, key string, want int) (http.Header, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, l.httpSrv.URL+path, bytes.NewReader(orderRequest))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	return l.send(req, want)
}

// send sends req, reads the whole answer and checks its status.
func (l *level[TTx]) send(req *http.Request, want int) (http.Header, error) {
	resp, err := l.httpCli.Do(req)
	if err != nil {
		return nil, err
	}
	var buf [512]byte
	for {
		if _, err := resp.Body.Read(buf[:]); err != nil {
			break
		}
	}
	_ = resp.Body.Close()
	if resp.StatusCode != want {
		return nil, fmt.Errorf("%s %s: status %d", req.Method, req.URL.Path, resp.StatusCode)
	}
	return resp.Header, nil
}

var orderRequest = []byte(`{"amount":{"value":"1999","currency":"EUR"},"items":[{"sku":"SKU-1234","qty":2}]}`)

// newHTTPServer serves POST /idem/<shape>/orders through idemhttp over s
// (and POST /idemopt/<shape>/orders over opt, when not nil) and POST
// /plain/<shape>/orders without it, all running the same business
// transaction of the shape, and POST /pk/<scope>/<key>, which reads the
// request and answers the stored response after a plain primary-key
// SELECT of the record.
func newHTTPServer[TTx any](s, opt *idem.Store[TTx], business func(workload.Shape) func(context.Context, TTx, string) error,
	pkSelect func(ctx context.Context, scope, key string) error,
) (*httptest.Server, error) {
	write := func(w http.ResponseWriter) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/ord_7GQ2V9X4KD8M3N5P")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(response.Body)
	}
	// protected is the order endpoint behind mw: the business statements
	// in the middleware's transaction.
	protected := func(mw *idemhttp.Middleware[TTx], insert func(context.Context, TTx, string) error) http.Handler {
		return mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tx, ok := mw.Tx(r.Context())
			if !ok {
				http.Error(w, "no transaction", http.StatusInternalServerError)
				return
			}
			if err := insert(r.Context(), tx, "http"); err != nil {
				http.Error(w, "no order", http.StatusInternalServerError)
				return
			}
			write(w)
		}))
	}
	mux := http.NewServeMux()
	mw, err := idemhttp.New(s, nil)
	if err != nil {
		return nil, err
	}
	var mwOpt *idemhttp.Middleware[TTx]
	if opt != nil {
		if mwOpt, err = idemhttp.New(opt, nil); err != nil {
			return nil, err
		}
	}
	for _, shape := range workload.Shapes {
		insert := business(shape)
		mux.Handle("POST /idem/"+string(shape)+"/orders", protected(mw, insert))
		if mwOpt != nil {
			mux.Handle("POST /idemopt/"+string(shape)+"/orders", protected(mwOpt, insert))
		}
		mux.HandleFunc("POST /plain/"+string(shape)+"/orders", func(w http.ResponseWriter, r *http.Request) {
			ctx := r.Context()
			err := inTx(ctx, s, func(tx TTx) error { return insert(ctx, tx, "http") })
			if err != nil {
				http.Error(w, "no order", http.StatusInternalServerError)
				return
			}
			write(w)
		})
	}
	// The replay baseline: the same request read, the record read by
	// primary key, the stored response written, as an unprotected
	// endpoint answering from one read would.
	mux.HandleFunc("POST /pk/{scope}/{key}", func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			http.Error(w, "no body", http.StatusBadRequest)
			return
		}
		if err := pkSelect(r.Context(), r.PathValue("scope"), r.PathValue("key")); err != nil {
			http.Error(w, "no record", http.StatusInternalServerError)
			return
		}
		write(w)
	})
	return httptest.NewServer(mux), nil
}

// fill copies the template record into keys from..to of 100 scopes named
// prefix+NN, with its retention deadline moved by shift (negative: already
// expired), in chunks so that no statement runs for minutes.
func fill[TTx any](ctx context.Context, b *backend[TTx], a admin, prefix string, from, to int64, shift time.Duration) error {
	const chunk = 200_000
	for _, q := range b.sql.fillPrep {
		if err := a.exec(ctx, q); err != nil {
			return fmt.Errorf("fill: %w", err)
		}
	}
	for lo := from; lo <= to; lo += chunk {
		hi := min(lo+chunk-1, to)
		if err := a.exec(ctx, b.sql.fill, b.sql.fillArgs(prefix, lo, hi, shift)...); err != nil {
			return fmt.Errorf("fill %d..%d: %w", lo, hi, err)
		}
	}
	return nil
}

// seedKeys completes n random keys and the template record through s.Do.
func seedKeys[TTx any](ctx context.Context, s *idem.Store[TTx], insert func(context.Context, TTx, string) error, n int) ([]seedKey, error) {
	keys := make([]seedKey, n)
	for i := range keys {
		keys[i] = seedKey{scope: scopes[i%tenants], key: workload.NewKey()}
	}
	keys = append(keys, seedKey{scope: templateScope, key: templateKey})
	err := workload.Complete(ctx, s, insert, len(keys), func(i int) (string, string) { return keys[i].scope, keys[i].key })
	if err != nil {
		err = fmt.Errorf("seed: %w", err)
	}
	return keys[:n], err
}
