//go:build faults

package faults

// The process harness of the "many instances" and "kill -9" scenarios: the
// order service built once per test and run as real processes, a database
// namespace per scenario, an outside payment provider that outlives the
// service processes, and an HTTP client that labels every answer.

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver, to count rows
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/internal/ordersproc"
	"github.com/idemstore/idem/internal/testdb"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// procBuildMu serialises the builds of the orders binary: the second test
// to build then finds every package in the build cache and only links.
var procBuildMu sync.Mutex

// procBuild builds examples/orders into t's temporary directory and
// returns the binary's path. It is built without -race: the race detector
// belongs to this test process, and the service under it would be several
// times slower on this scenario's small machines; the service's own tests
// run it under -race.
func procBuild(t *testing.T) string {
	t.Helper()
	procBuildMu.Lock()
	defer procBuildMu.Unlock()
	bin := filepath.Join(t.TempDir(), "orders")
	start := time.Now()
	cmd := exec.CommandContext(t.Context(), "go", "build", "-o", bin, "./examples/orders")
	cmd.Dir = ".." // the module root
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build ./examples/orders: %s", out)
	t.Logf("built the orders binary in %s", time.Since(start).Round(time.Millisecond))
	return bin
}

// procDB is a fresh namespace on one dialect's database: the -db (and,
// on PostgreSQL, -schema) arguments the service gets, and a connection of
// the test's own to count rows.
type procDB struct {
	dialect string
	spec    string // the service's -db flag
	schema  string // PostgreSQL: the service's -schema flag
	sql     *sql.DB
}

// args returns the service's flags that name the database.
func (d *procDB) args() []string {
	if d.schema != "" {
		return []string{"-db", d.spec, "-schema", d.schema}
	}
	return []string{"-db", d.spec}
}

// table returns the service's table as SQL text: schema-qualified on
// PostgreSQL. table is one of the service's tables, never input.
func (d *procDB) table(table string) string {
	if d.dialect == dialectPostgres {
		return pgTable(d.schema, table)
	}
	return table
}

// procOpenDB creates a namespace for one scenario on dialect and drops it
// when t ends: an SQLite file in t.TempDir(), a PostgreSQL schema (named in
// every statement with -schema, as a transaction pooler keeps no
// search_path) or a MariaDB database.
func procOpenDB(t *testing.T, dialect string) *procDB {
	t.Helper()
	ctx := t.Context()
	switch dialect {
	case dialectSQLite:
		path := filepath.Join(t.TempDir(), "orders.db")
		db, err := idemsqlite.Open(path)
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		return &procDB{dialect: dialect, spec: path, sql: db}
	case dialectPostgres:
		url := pgExecURL(t, testdb.PostgresURL(t))
		conn, err := pgx.Connect(ctx, url)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close(context.WithoutCancel(ctx)) })
		schema := testdb.Name()
		_, err = conn.Exec(ctx, "CREATE SCHEMA "+schema)
		require.NoError(t, err)
		t.Cleanup(func() {
			_, err := conn.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+schema+" CASCADE")
			assert.NoError(t, err)
		})
		db, err := sql.Open("pgx", url)
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		return &procDB{dialect: dialect, spec: url, schema: schema, sql: db}
	case dialectMySQL:
		dsn := testdb.MySQLDSN(t, func(dsn string) (string, error) {
			cfg, err := gomysql.ParseDSN(dsn)
			if err != nil {
				return "", err
			}
			return cfg.Addr, nil
		})
		cfg, err := gomysql.ParseDSN(dsn)
		require.NoError(t, err)
		admin, err := sql.Open("mysql", cfg.FormatDSN())
		require.NoError(t, err)
		admin.SetMaxOpenConns(1)
		t.Cleanup(func() { _ = admin.Close() })
		name := testdb.Name()
		_, err = admin.ExecContext(ctx, "CREATE DATABASE "+name)
		require.NoError(t, err)
		t.Cleanup(func() {
			_, err := admin.ExecContext(context.WithoutCancel(ctx), "DROP DATABASE IF EXISTS "+name)
			assert.NoError(t, err)
		})
		cfg.DBName = name
		db, err := sql.Open("mysql", cfg.FormatDSN())
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		cfg.ParseTime = false // the service adds what it needs
		return &procDB{dialect: dialect, spec: "mysql://" + cfg.FormatDSN(), sql: db}
	}
	t.Fatalf("unknown dialect %q", dialect)
	return nil
}

// procTK is a tenant and an idempotency key.
type procTK struct{ tenant, key string }

// procRow is what a table holds for one (tenant, key).
type procRow struct {
	n  int   // rows; the table's unique constraint allows one
	id int64 // the smallest id
}

// rows counts table's rows by (tenant, idempotency_key). table is one of
// the service's two tables, never input.
func (d *procDB) rows(t *testing.T, table string) map[procTK]procRow {
	t.Helper()
	q := "SELECT tenant, idempotency_key, COUNT(*), MIN(id) FROM " + d.table(table) + " GROUP BY tenant, idempotency_key"
	rs, err := d.sql.QueryContext(t.Context(), q)
	require.NoError(t, err)
	defer rs.Close()
	out := map[procTK]procRow{}
	for rs.Next() {
		var tk procTK
		var r procRow
		require.NoError(t, rs.Scan(&tk.tenant, &tk.key, &r.n, &r.id))
		out[tk] = r
	}
	require.NoError(t, rs.Err())
	return out
}

// procProvider is the outside payment provider the services charge
// (-provider-url): it runs in the test process, so its charges survive the
// service's crashes, and it counts the charge calls per provider key. The
// provider deduplicates on the key, as a real one would; the scenarios
// check that idem never needed it to: a key the provider was asked to
// charge twice is a duplicate.
type procProvider struct {
	srv   *httptest.Server
	delay time.Duration // half before the charge is recorded, half after

	mu      sync.Mutex
	charges map[string]procCharge
	calls   map[string]int
	seq     int
}

// procCharge is one charge, in the JSON form of examples/orders.
type procCharge struct {
	ID          string `json:"charge_id"`
	AmountCents int64  `json:"amount_cents"`
}

func procNewProvider(t *testing.T, delay time.Duration) *procProvider {
	t.Helper()
	p := &procProvider{delay: delay, charges: map[string]procCharge{}, calls: map[string]int{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Key         string `json:"key"`
			AmountCents int64  `json:"amount_cents"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Key == "" {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		time.Sleep(p.delay / 2)
		p.mu.Lock()
		p.calls[in.Key]++
		c, ok := p.charges[in.Key]
		if !ok {
			p.seq++
			c = procCharge{ID: fmt.Sprintf("ch_%06d", p.seq), AmountCents: in.AmountCents}
			p.charges[in.Key] = c
		}
		p.mu.Unlock()
		// The charge is made; a service killed from now on has charged
		// without knowing it, which its StatusCheck must find out.
		time.Sleep(p.delay / 2)
		_ = json.NewEncoder(w).Encode(c)
	})
	mux.HandleFunc("POST /charges/lookup", func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Key string `json:"key"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		p.mu.Lock()
		c, ok := p.charges[in.Key]
		p.mu.Unlock()
		if !ok {
			http.NotFound(w, r)
			return
		}
		_ = json.NewEncoder(w).Encode(c)
	})
	p.srv = httptest.NewServer(mux)
	t.Cleanup(p.srv.Close)
	return p
}

// lookup returns the charge and the number of charge calls for a client's
// (tenant, key) of POST /payments. The service's provider key is its
// idemhttp scope (which starts with the tenant) and the key, joined by
// 0x1f (providerKey in examples/orders).
func (p *procProvider) lookup(tk procTK) (procCharge, int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, c := range p.charges {
		if strings.HasPrefix(k, tk.tenant) && strings.HasSuffix(k, "\x1f"+tk.key) {
			return c, p.calls[k], true
		}
	}
	return procCharge{}, 0, false
}

// doubleCharged counts the provider keys it was asked to charge more than
// once.
func (p *procProvider) doubleCharged() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, c := range p.calls {
		if c > 1 {
			n++
		}
	}
	return n
}

// procInstance is one running orders process.
type procInstance struct {
	cmd  *exec.Cmd
	base string        // http://127.0.0.1:port
	done chan struct{} // closed once the process has exited and been waited for
	logs *procLog
}

// procLog collects a process's stderr (the service logs key digests only),
// to show when a test fails.
type procLog struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	scan *logSink // every line, not only the first MiB
}

func (l *procLog) Write(b []byte) (int, error) {
	_, _ = l.scan.Write(b)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.buf.Len() > 1<<20 { // keep the first MiB: enough to diagnose
		return len(b), nil
	}
	return l.buf.Write(b)
}

func (l *procLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

var procReadyLine = regexp.MustCompile(`^orders: serving on (http://\S+) `)

// procStart starts the orders binary with args and returns once it serves.
// The process is killed, if it still runs, when t ends, so that a failed
// test leaves no orphan behind.
func procStart(t *testing.T, bin string, args ...string) *procInstance {
	t.Helper()
	p, err := procTryStart(t, bin, args...)
	require.NoError(t, err)
	return p
}

// procTryStart is procStart for goroutines other than the test's, which
// must not call t.FailNow.
func procTryStart(t *testing.T, bin string, args ...string) (*procInstance, error) {
	//nolint:noctx // the service outlives any one context: the test kills it (SIGKILL is the point) or stops it in t.Cleanup
	cmd := exec.Command(bin, append([]string{"-addr", "127.0.0.1:0", "-token-secret", ordersproc.TokenSecret}, args...)...)
	procOrphanGuard(cmd)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, fmt.Errorf("stdout pipe: %w", err)
	}
	// The scan's check is registered before the kill below, so it runs
	// after it, once the last line was read.
	p := &procInstance{cmd: cmd, done: make(chan struct{}), logs: &procLog{scan: newLogSink(t, "orders process")}}
	cmd.Stderr = p.logs
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start orders: %w", err)
	}
	t.Cleanup(func() { p.kill() })
	ready := make(chan string, 1)
	go func() {
		lines := bufio.NewScanner(stdout)
		first := true
		for lines.Scan() {
			if first {
				ready <- lines.Text()
				first = false
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
		_ = cmd.Wait() // after every read of stdout, as exec requires
		close(p.done)
	}()
	select {
	case line := <-ready:
		m := procReadyLine.FindStringSubmatch(line)
		if m == nil {
			return nil, fmt.Errorf("ready line %q; stderr: %s", line, p.logs)
		}
		p.base = m[1]
		return p, nil
	case <-p.done:
		return nil, fmt.Errorf("orders exited before serving: %v; stderr: %s", cmd.ProcessState, p.logs)
	case <-time.After(30 * time.Second):
		return nil, fmt.Errorf("orders did not serve within 30s; stderr: %s", p.logs)
	}
}

// kill sends SIGKILL (kill -9) and waits for the process to be gone.
func (p *procInstance) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// diedOfSIGKILL waits up to 10s for the process to exit and reports whether
// SIGKILL ended it (a fault-injection hook fired, or kill was called).
func (p *procInstance) diedOfSIGKILL() bool {
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		return false
	}
	ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// procAnswer is what a client got for one request.
type procAnswer struct {
	status   int // 0: no answer (timeout, connection error)
	label    string
	replayed bool
	body     []byte
	header   http.Header
}

// The labels of requests that got no answer.
const (
	procTimeout   = "client timeout"
	procConnError = "connection error"
)

// procClient is the HTTP client of the scenarios. Keep-alives are off: a
// connection to a killed instance would otherwise fail the next request
// for a reason that is the client's own.
var procClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

// procSend sends one POST to base+path and labels the answer as the
// outcome rows count them: "201", "201 replayed", "409
// idempotency_request_in_progress", procTimeout, ...
func procSend(ctx context.Context, base, path, tenant, key, body, crash string, timeout time.Duration) procAnswer {
	logSecrets.addRequest(tenant, key, http.MethodPost, path, body)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, strings.NewReader(body))
	if err != nil {
		return procAnswer{label: "request error: " + err.Error()}
	}
	req.Header.Set("Content-Type", "application/json")
	// The service takes the tenant from the bearer token only
	// (examples/orders/auth.go); the suite signs one per tenant.
	token := ordersproc.Token(tenant)
	logSecrets.add("token", token) // a credential: never in a log line
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Idempotency-Key", key)
	if crash != "" {
		req.Header.Set("X-Fault-Crash", crash)
	}
	resp, err := procClient.Do(req)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return procAnswer{label: procTimeout}
		}
		return procAnswer{label: procConnError}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return procAnswer{label: procTimeout}
		}
		return procAnswer{label: procConnError}
	}
	a := procAnswer{status: resp.StatusCode, body: b, header: resp.Header, replayed: resp.Header.Get("Idempotency-Replayed") == "true"}
	switch {
	case resp.StatusCode == http.StatusCreated && a.replayed:
		a.label = "201 replayed"
	case resp.StatusCode < 300:
		a.label = fmt.Sprint(resp.StatusCode)
	default:
		var e struct {
			Code string `json:"code"`
		}
		_ = json.Unmarshal(b, &e)
		a.label = fmt.Sprintf("%d %s", resp.StatusCode, e.Code)
	}
	return a
}

// procRetryable reports whether a client may retry after a, as docs/http.md
// tells clients to: no answer, 409 in progress, or 503.
func procRetryable(a procAnswer) bool {
	switch a.label {
	case procTimeout, procConnError, "409 idempotency_request_in_progress", "503 idempotency_store_unavailable", "503 idempotency_lease_lost":
		return true
	}
	return false
}

// procTally counts the answers and keeps every 201 body per (path, tenant,
// key), for the checks at the end of a scenario. Safe for concurrent use.
type procTally struct {
	mu         sync.Mutex
	requests   int
	codes      map[string]int
	unexpected []string
	successes  map[procJob][][]byte
}

// procJob is one client intent: a POST to path with a tenant, key and body.
type procJob struct {
	path, tenant, key, body string
}

func newProcTally() *procTally {
	return &procTally{codes: map[string]int{}, successes: map[procJob][][]byte{}}
}

func (y *procTally) add(j procJob, a procAnswer) {
	y.mu.Lock()
	defer y.mu.Unlock()
	y.requests++
	y.codes[a.label]++
	switch {
	case a.status == http.StatusCreated:
		y.successes[j] = append(y.successes[j], a.body)
	case !procRetryable(a):
		y.unexpected = append(y.unexpected, fmt.Sprintf("%s %s: %s %s", j.path, j.key, a.label, a.body))
	}
}

// procPay is the JSON of a 201 to POST /orders or POST /payments, as far
// as the checks need it: a row id, or a charge recovered by the status
// check (no payment row: reconciliation's job, see payments.go).
type procPay struct {
	ID        int64  `json:"id"`
	ChargeID  string `json:"charge_id"`
	Attempt   int    `json:"attempt"`
	Recovered bool   `json:"recovered"`
}

// procVerdict is what the checks of a scenario's end found.
type procVerdict struct {
	duplicates, lost int
	// recovered counts the payments answered with the charge the status
	// check found at the provider (their holder was killed after charging).
	recovered int
	payments  int // payment intents
}

// check verifies the invariants over everything y saw and the database
// holds: every intent some client saw succeed has exactly one row whose id
// is the one answered, every success of one intent is byte-identical, no
// order or payment exists twice, the provider charged no key twice, and
// every answer is one of the documented retryable codes or a 201. Each
// intent in jobs must have succeeded.
func (y *procTally) check(t *testing.T, db *procDB, prov *procProvider, jobs []procJob) procVerdict {
	t.Helper()
	y.mu.Lock()
	defer y.mu.Unlock()
	var v procVerdict
	tables := map[string]map[procTK]procRow{"/orders": db.rows(t, "orders"), "/payments": db.rows(t, "payments")}
	for _, rows := range tables {
		for tk, r := range rows {
			if r.n > 1 {
				v.duplicates += r.n - 1
				t.Errorf("%d rows for tenant %s key %s", r.n, tk.tenant, tk.key)
			}
		}
	}
	if prov != nil {
		if n := prov.doubleCharged(); n > 0 {
			v.duplicates += n
			t.Errorf("the provider was asked to charge %d key(s) more than once", n)
		}
	}
	for _, j := range jobs {
		bodies := y.successes[j]
		if len(bodies) == 0 {
			t.Errorf("%s tenant %s key %s: no client ever got a 201", j.path, j.tenant, j.key)
			continue
		}
		for _, b := range bodies[1:] {
			if !bytes.Equal(b, bodies[0]) {
				t.Errorf("%s key %s: 201 bodies differ:\n%s\n%s", j.path, j.key, bodies[0], b)
				break
			}
		}
		var got procPay
		if err := json.Unmarshal(bodies[0], &got); err != nil {
			t.Errorf("%s key %s: 201 body %q: %v", j.path, j.key, bodies[0], err)
			continue
		}
		tk := procTK{j.tenant, j.key}
		if j.path == "/payments" {
			v.payments++
		}
		if got.Recovered {
			v.recovered++
			// A payment recovered by the status check has no row; the
			// provider must hold the very charge answered.
			c, _, ok := prov.lookup(tk)
			if !ok || c.ID != got.ChargeID {
				v.lost++
				t.Errorf("%s key %s: recovered charge %s is not the provider's (%+v)", j.path, j.key, got.ChargeID, c)
			}
			continue
		}
		if r, ok := tables[j.path][tk]; !ok || r.id != got.ID {
			v.lost++
			t.Errorf("%s key %s: acknowledged id %d, database holds %+v", j.path, j.key, got.ID, r)
		}
	}
	for _, u := range y.unexpected {
		t.Errorf("undocumented answer: %s", u)
	}
	return v
}

// procRetryUntilCreated sends j to instance first (mod the number of
// instances; -1: a random one), then to random instances, until it gets a
// 201 or deadline passes, with a client timeout drawn from
// [minTimeout, maxTimeout) each time (short ones make retries while the
// original still runs) and a short pause after retryable answers.
func procRetryUntilCreated(ctx context.Context, y *procTally, bases func() []string, j procJob, first int, minTimeout, maxTimeout time.Duration, deadline time.Time) {
	for time.Now().Before(deadline) && ctx.Err() == nil {
		all := bases()
		base := all[rand.IntN(len(all))]
		if first >= 0 {
			base, first = all[first%len(all)], -1
		}
		timeout := minTimeout + rand.N(maxTimeout-minTimeout)
		a := procSend(ctx, base, j.path, j.tenant, j.key, j.body, "", timeout)
		y.add(j, a)
		if !procRetryable(a) {
			return
		}
		time.Sleep(10*time.Millisecond + rand.N(60*time.Millisecond))
	}
}

// procLogFailures logs, once t has failed, the lines of the instances'
// logs that tell of a request whose handler ran and did not complete
// (rolled back, lease lost, store failing after the handler ran), to show
// where it went wrong. The logs carry key digests only.
func procLogFailures(t *testing.T, insts []*procInstance) {
	t.Helper()
	if !t.Failed() {
		return
	}
	shown := 0
	for i, p := range insts {
		for line := range strings.Lines(p.logs.String()) {
			ranLeased := strings.Contains(line, " attempt=") && !strings.Contains(line, "outcome=completed ") && !strings.Contains(line, "outcome=replayed ")
			if !ranLeased && !strings.Contains(line, "outcome=rolled_back") && !strings.Contains(line, "outcome=lease_lost") {
				continue
			}
			if shown++; shown > 40 {
				return
			}
			t.Logf("instance %d: %s", i, strings.TrimSpace(line))
		}
	}
}
