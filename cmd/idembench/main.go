// Command idembench is idem's load tool: it measures what idempotency costs
// next to the business transaction it protects, with many concurrent
// workers, latency percentiles, and the cases the Go benchmarks cannot
// reach (hot keys, a table of millions of records, the reaper at work,
// Redis, the HTTP middleware).
//
// It is a module of its own (cmd/idembench/go.mod), so that its Redis
// client, go-redis, never becomes a requirement of the library. Usage, from
// the repository's root:
//
//	cd cmd/idembench && GOWORK=off go run . -dialect all -workers 1,8,32,64 -duration 5s -reps 3
//	cd cmd/idembench && GOWORK=off go run . -dialect postgres -shape small,order -rtt direct,0,200us,1ms -scenarios bare,do,tx,redis
//	cd cmd/idembench && GOWORK=off go run . -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable' -scenarios bare,tx
//	cd cmd/idembench && GOWORK=off go run . summarize /tmp/pg.json /tmp/mysql.json
//
// summarize reads the -json reports of earlier runs and prints the tables
// of docs/performance.md: per dialect and worker count, median [min–max]
// of the per-repetition ratios; issue 17's targets beside their floors;
// the reaper.
//
// For every repetition, every -rtt setting, every worker count, every
// business shape (-shape) and every scenario in turn, it runs the
// scenario's operation from that many workers for -warmup, then for
// -duration, recording each operation's latency. The repetitions
// interleave (bare, tx, ..., bare, tx, ...), so a drift of the machine
// touches every scenario alike, and each row of the table is the median
// over the repetitions: ops/s, the p50/p99/p999 latencies, and the
// throughput relative to bare of the same shape (and to the scenario's own
// baseline) measured in the same repetition. With -order alternate (the
// default) every even repetition runs the scenarios in reverse order
// (prefill still last), so that no scenario is always measured in the same
// place, after the same neighbour: a fixed order lets whatever the one
// before leaves behind, or a drift within the repetition, fall on the
// same scenario every time (docs/performance.md, "Scenario order"). Run an
// even number of repetitions to balance the two orders.
//
// Shapes (-shape, comma-separated; default small,order; internal/workload,
// shared with BenchmarkIdem) are the business transaction the writing
// scenarios protect: small inserts one order; order locks a product
// (SELECT … FOR UPDATE), updates its stock, inserts the order and 3 order
// lines. Every writing measurement ends with an exactly-once check: orders
// written = successful operations (warm-up and tail included), with their
// lines and stock units, and completed idempotency records (or Redis keys
// holding the response, or finished rows of the floor scenarios' table) =
// orders, none left pending.
//
// Latency (-rtt, comma-separated; default direct): "direct" reaches the
// servers directly; a duration (0, 200us, 1ms) puts a TCP proxy of the
// tool in front of every server the measured pools use (the database and
// Redis alike; SQLite runs in the process, so only Redis is behind it)
// adding that round-trip time. The proxy costs CPU on the same machine, so
// read each RTT against 0 (the proxy without delay), not against direct.
// Through a proxy the tool also counts round trips per operation (the
// rt/op column: request-response turns on the proxied connections ÷
// operations).
//
// Scenarios (-scenarios, comma-separated; default all):
//
//	bare      BEGIN; the shape's statements; COMMIT: the business transaction alone
//	tx        BEGIN; Store.ClaimTx; the shape; Store.CompleteTx; COMMIT (fresh key)
//	do        Store.Do with the shape in its callback (fresh key)
//	doopt     do through a Store of idemmysql.WithOptimisticDo (MySQL/MariaDB only): the
//	          claim a plain read, the finished record inserted with COMMIT
//	floor     what no design of Store.Do can do without for a fresh key, without idem's
//	          code: BEGIN; a primary-key read of a record-shaped row; the shape; the
//	          INSERT of a finished record; COMMIT, in Do's round trips (PostgreSQL: BEGIN
//	          and the read in one batch, the INSERT and COMMIT in another; MariaDB: the
//	          same in compound statements, through a connector of the tool's like
//	          idemmysql.NewConnector; SQLite: prepared statements). The rows go to
//	          idembench_floor_records, a copy of the record table (columns, primary key,
//	          indexes). A target of do ÷ bare above floor ÷ bare is out of reach
//	floortx   the same as separate statements in a transaction begun as a caller's:
//	          the floor of tx (ClaimTx + CompleteTx); on SQLite, floor's statements
//	floorlock (MariaDB, PostgreSQL) the least a Do that holds the key before its callback
//	          runs must send. MariaDB (compound statements): BEGIN with the INSERT of a
//	          processing row; the shape; the response INSERTed into a table of its own with
//	          COMMIT (no UPDATE, no read). PostgreSQL: floor with the key's advisory lock
//	          (pg_try_advisory_xact_lock, as Do's claim takes it) before the read, in the
//	          same batch. A target of do ÷ bare above floorlock ÷ bare is out of reach for
//	          Do's default claim; on MariaDB floor remains the bound of doopt
//	floorlockbound (MariaDB only: SET STATEMENT, RETURNING) floorlock with what Do's claim owes its contract
//	          besides the lock: its wait bounded (SET STATEMENT innodb_lock_wait_timeout),
//	          the record's times the database's clock, returned by RETURNING
//	floorresp (MariaDB only) a schema of two tables as Do would write it, its contract kept:
//	          Do's own claim (the wait bounded, the database's clock, nothing returned);
//	          the shape; the response INSERTed, guarded against a transaction the
//	          server rolled back and overwriting a stale row (ON DUPLICATE KEY UPDATE),
//	          into a table with the token and expires_at (indexed, for the reaper), with
//	          COMMIT. Without the joins such a schema costs every read
//	separate  Store.Claim committed first, then BEGIN; the shape; CompleteTx; COMMIT
//	leased    Store.Acquire, then BEGIN; the shape; Lease.CompleteTx; COMMIT
//	replay    Store.Do on a completed key (the stored response comes back)
//	cachedreplay  replay through a Store with Config.ReplayCache (warmed up on the seeds)
//	get       Store.Get of a completed key
//	pkselect  a plain primary-key SELECT of the same rows: the baseline of replay and get
//	hotkeys   -hot-workers workers on -hot-keys keys at a time, through Store.Do:
//	          executions must equal the keys completed and the orders written
//	prefill   tx on a table holding -prefill records; compared with tx
//	reaper    tx while a Reaper deletes -reaper-rows expired records; compared with tx
//	redis     go-redis SetNX (SET key NX EX) in Redis; the bare transaction; SET key response
//	httpplain POST /orders over loopback to a handler running the bare transaction
//	http      the same through idemhttp's middleware; compared with httpplain
//	httpopt   http through a middleware over doopt's Store (MySQL/MariaDB only); compared
//	          with httpplain
//	httppk    POST over loopback (the same request) to a handler answering from a
//	          plain primary-key SELECT of a seeded record: the baseline of httpreplay
//	httpreplay POST /orders through the middleware with a key completed before
//	          the measurement (the stored response comes back); compared with httppk
//
// Each dialect works in a namespace of its own (a schema on PostgreSQL, a
// database on MariaDB, a file on SQLite) migrated with the shipped
// migrations and dropped at the end unless -keep. Before every measurement
// the tables are emptied and -seeds completed records put back, as
// BenchmarkIdem does. The prefilled namespace is filled in the server
// (generate_series, MariaDB's SEQUENCE engine, a recursive CTE); with
// -reuse-prefill it is named after its size, kept, and reused by later runs.
//
// The tool uses only idem's public API. docs/performance.md ("Load tool")
// shows results and how to read them.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/workload"
)

// Defaults match the machine's local servers, as the tests' do.
const (
	defaultPostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultMySQLDSN    = "root@tcp(127.0.0.1:3306)/test"
)

var allScenarios = []string{
	"bare", "tx", "do", "doopt", "floor", "floortx", "floorlock", "floorlockbound", "floorresp", "separate", "leased", "replay", "cachedreplay", "get", "pkselect",
	"hotkeys", "prefill", "reaper", "redis", "httpplain", "http", "httpopt", "httppk", "httpreplay",
}

// config is the parsed command line.
type config struct {
	targets      []target
	workers      []int
	shapes       []workload.Shape
	rtts         []rttSetting
	duration     time.Duration
	warmup       time.Duration
	reps         int
	scenarios    map[string]bool
	prefill      int
	reusePrefill bool
	reaperRows   int
	reaperPause  time.Duration
	reaperBatch  int
	cpuProfile   string
	// store is the Config of every Store the tool opens (-replay-read).
	store      *idem.Config
	seeds      int
	hotWorkers int
	hotKeys    int
	redisAddr  string
	keep       bool
	jsonPath   string
	runID      string
	// alternate reverses the scenario order of every even repetition
	// (-order alternate).
	alternate bool
}

// target is one dialect and where to find it.
type target struct{ dialect, dsn string }

// orderName is -order as given.
func (c *config) orderName() string {
	if c.alternate {
		return "alternate"
	}
	return "fixed"
}

// wants reports whether scenario name was selected.
func (c *config) wants(name string) bool { return c.scenarios[name] }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "idembench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "summarize" {
		return summarize(args[1:], stdout)
	}
	cfg, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	if cfg.cpuProfile != "" {
		f, err := os.Create(cfg.cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	m := machine{NumCPU: runtime.NumCPU(), GOMAXPROCS: runtime.GOMAXPROCS(0), Go: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH}
	if cfg.wants("redis") {
		rc := newRedisClient(cfg.redisAddr, 1)
		info, err := rc.Info(ctx, "server").Result()
		_ = rc.Close()
		if err != nil {
			return fmt.Errorf("redis at %s (needed by the redis scenario; leave it out with -scenarios): %w", cfg.redisAddr, err)
		}
		m.Redis = redisVersion(info)
	}
	rep := &report{Command: "idembench " + strings.Join(args, " "), Machine: m, Started: time.Now().UTC(), Duration: cfg.duration.String(), Warmup: cfg.warmup.String(), Order: cfg.orderName()}
	fmt.Fprintln(stdout, m)
	var errs []error
	for _, t := range cfg.targets {
		res, err := runTarget(ctx, cfg, t, stderr)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", t.dialect, err))
			if ctx.Err() != nil {
				break
			}
			continue
		}
		res.summarise()
		res.writeTable(stdout)
		rep.Dialects = append(rep.Dialects, res)
	}
	if cfg.jsonPath != "" {
		w := stdout
		if cfg.jsonPath != "-" {
			f, err := os.Create(cfg.jsonPath)
			if err != nil {
				return errors.Join(append(errs, err)...)
			}
			defer f.Close()
			w = f
		}
		if err := writeJSON(w, rep); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// runTarget opens the backend of t and measures it.
func runTarget(ctx context.Context, cfg *config, t target, log io.Writer) (*dialectResult, error) {
	switch t.dialect {
	case "postgres":
		b, err := newPGBackend(ctx, t.dsn)
		if err != nil {
			return nil, err
		}
		defer b.close()
		b.storeCfg = cfg.store
		return runBackend(ctx, cfg, b, log)
	case "mysql":
		b, err := newMySQLBackend(ctx, t.dsn)
		if err != nil {
			return nil, err
		}
		defer b.close()
		b.storeCfg = cfg.store
		return runBackend(ctx, cfg, b, log)
	default:
		dir := t.dsn
		if dir == "" {
			d, err := os.MkdirTemp("", "idembench-")
			if err != nil {
				return nil, err
			}
			if !cfg.keep {
				defer os.RemoveAll(d)
			}
			dir = d
		}
		b := newSQLiteBackend(dir)
		b.storeCfg = cfg.store
		return runBackend(ctx, cfg, b, log)
	}
}

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	fs := flag.NewFlagSet("idembench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		cfg       config
		dialect   = fs.String("dialect", "sqlite", "postgres, mysql, sqlite or all, on the local servers (IDEM_TEST_POSTGRES_URL and IDEM_TEST_MYSQL_DSN override them)")
		db        = fs.String("db", "", "one database instead of -dialect: postgres://..., mysql://<go-sql-driver DSN>, or sqlite:<directory for the files>")
		workers   = fs.String("workers", "1,8,32,64", "comma-separated worker counts")
		scenarios = fs.String("scenarios", "all", "comma-separated scenarios, or all: "+strings.Join(allScenarios, ","))
		shapes    = fs.String("shape", "small,order", "comma-separated business shapes of the writing scenarios: small (one INSERT), order (a product locked and updated, the order and 3 lines inserted)")
		rtts      = fs.String("rtt", "direct", "comma-separated round-trip times added by a proxy in front of every server: direct (no proxy) or a duration, 0 being the proxy without delay (e.g. direct,0,200us,1ms)")
	)
	fs.DurationVar(&cfg.duration, "duration", 5*time.Second, "measuring time of each scenario, per worker count and repetition")
	fs.DurationVar(&cfg.warmup, "warmup", -1, "unrecorded time before each measurement; default a fifth of -duration, at most 1s")
	fs.IntVar(&cfg.reps, "reps", 3, "repetitions; the table shows medians")
	fs.IntVar(&cfg.prefill, "prefill", 1_000_000, "records in the table of the prefill scenario")
	fs.BoolVar(&cfg.reusePrefill, "reuse-prefill", false, "keep the prefilled namespace (idembench_prefill_<N>) and reuse it when it exists")
	fs.IntVar(&cfg.reaperRows, "reaper-rows", 100_000, "expired records seeded for the reaper scenario")
	fs.DurationVar(&cfg.reaperPause, "reaper-pause", 0, "ReaperConfig.BatchPause of the reaper scenario (0: none, the default)")
	fs.IntVar(&cfg.reaperBatch, "reaper-batch", 0, "ReaperConfig.BatchSize of the reaper scenario (0: the default, 1000)")
	fs.StringVar(&cfg.cpuProfile, "cpuprofile", "", "write a CPU profile of the whole run (the tool's side: clients, idem, the HTTP server, SQLite) to this file")
	order := fs.String("order", "alternate", "scenario order within a repetition: alternate (every even repetition in reverse, prefill still last) or fixed")
	replayRead := fs.String("replay-read", "auto", "Config.ReplayRead of every store: auto, always (Do reads the key first; do then shows what it costs a new key) or never")
	fs.IntVar(&cfg.seeds, "seeds", 1000, "completed records restored before every measurement; replay, get and pkselect read them")
	fs.IntVar(&cfg.hotWorkers, "hot-workers", 100, "workers of the hotkeys scenario")
	fs.IntVar(&cfg.hotKeys, "hot-keys", 10, "keys the hotkeys workers share at a time")
	fs.StringVar(&cfg.redisAddr, "redis", "127.0.0.1:6379", "Redis address for the redis scenario")
	fs.BoolVar(&cfg.keep, "keep", false, "keep the namespaces (schemas, databases, files) instead of dropping them")
	fs.StringVar(&cfg.jsonPath, "json", "", "also write the results as JSON to this file (- for standard output)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	var err error
	if cfg.targets, err = parseTargets(*dialect, *db); err != nil {
		return nil, err
	}
	for _, w := range strings.Split(*workers, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(w))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("-workers: %q is not a positive number", w)
		}
		cfg.workers = append(cfg.workers, n)
	}
	if cfg.shapes, err = workload.ParseShapes(*shapes); err != nil {
		return nil, fmt.Errorf("-shape: %w", err)
	}
	if cfg.rtts, err = parseRTTs(*rtts); err != nil {
		return nil, err
	}
	cfg.scenarios = make(map[string]bool)
	for _, s := range strings.Split(*scenarios, ",") {
		s = strings.TrimSpace(s)
		switch {
		case s == "all":
			for _, a := range allScenarios {
				cfg.scenarios[a] = true
			}
		case slices.Contains(allScenarios, s):
			cfg.scenarios[s] = true
		default:
			return nil, fmt.Errorf("-scenarios: unknown scenario %q", s)
		}
	}
	switch {
	case cfg.duration <= 0:
		return nil, errors.New("-duration must be positive")
	case cfg.reps < 1:
		return nil, errors.New("-reps must be at least 1")
	case cfg.prefill < 1 || cfg.reaperRows < 1 || cfg.seeds < 1 || cfg.hotWorkers < 1 || cfg.hotKeys < 1:
		return nil, errors.New("-prefill, -reaper-rows, -seeds, -hot-workers and -hot-keys must be at least 1")
	case !slices.Contains([]string{"auto", "always", "never"}, *replayRead):
		return nil, fmt.Errorf("-replay-read %q: want auto, always or never", *replayRead)
	case cfg.reaperPause < 0 || cfg.reaperBatch < 0:
		return nil, errors.New("-reaper-pause and -reaper-batch must not be negative")
	case *order != "alternate" && *order != "fixed":
		return nil, fmt.Errorf("-order %q: want alternate or fixed", *order)
	}
	cfg.alternate = *order == "alternate"
	if cfg.warmup < 0 {
		cfg.warmup = min(cfg.duration/5, time.Second)
	}
	cfg.store = &idem.Config{ReplayRead: map[string]idem.ReplayRead{
		"auto": idem.ReplayReadAuto, "always": idem.ReplayReadAlways, "never": idem.ReplayReadNever,
	}[*replayRead]}
	var id [4]byte
	_, _ = rand.Read(id[:])
	cfg.runID = hex.EncodeToString(id[:])
	return &cfg, nil
}

// parseTargets turns -dialect or -db into the dialects to measure.
func parseTargets(dialect, db string) ([]target, error) {
	if db != "" {
		switch {
		case strings.HasPrefix(db, "postgres://"), strings.HasPrefix(db, "postgresql://"):
			return []target{{"postgres", db}}, nil
		case strings.HasPrefix(db, "mysql://"):
			return []target{{"mysql", strings.TrimPrefix(db, "mysql://")}}, nil
		case strings.HasPrefix(db, "sqlite:"):
			return []target{{"sqlite", strings.TrimPrefix(db, "sqlite:")}}, nil
		}
		return nil, errors.New("-db: want a postgres://, mysql:// or sqlite: prefix")
	}
	pg := target{"postgres", envOr("IDEM_TEST_POSTGRES_URL", defaultPostgresURL)}
	my := target{"mysql", envOr("IDEM_TEST_MYSQL_DSN", defaultMySQLDSN)}
	lite := target{"sqlite", ""}
	switch dialect {
	case "postgres":
		return []target{pg}, nil
	case "mysql":
		return []target{my}, nil
	case "sqlite":
		return []target{lite}, nil
	case "all":
		return []target{pg, my, lite}, nil
	}
	return nil, fmt.Errorf("-dialect: unknown dialect %q", dialect)
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// redisVersion picks redis_version out of INFO's answer.
func redisVersion(info string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
			return v
		}
	}
	return "unknown"
}
