//go:build failover && linux

package failovertest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/ordersproc"
	idempg "github.com/idemstore/idem/postgres"
)

// fullScale selects the longer run (IDEM_FAILOVER_SCALE=full, make failover).
var fullScale = os.Getenv("IDEM_FAILOVER_SCALE") == "full"

func scaled[T any](ci, full T) T {
	if fullScale {
		return full
	}
	return ci
}

// env is what .ci/pgfailover.sh exports.
type env struct {
	dsn        string // multi-host, target_session_attrs=read-write: what the service gets
	primaryURL string
	standbyURL string
	primaryPID int // the primary's postmaster
}

func readEnv(t *testing.T) env {
	t.Helper()
	e := env{
		dsn:        os.Getenv("IDEM_FAILOVER_DSN"),
		primaryURL: os.Getenv("IDEM_FAILOVER_PRIMARY_URL"),
		standbyURL: os.Getenv("IDEM_FAILOVER_STANDBY_URL"),
	}
	pid, err := strconv.Atoi(os.Getenv("IDEM_FAILOVER_PRIMARY_PID"))
	if e.dsn == "" || e.primaryURL == "" || e.standbyURL == "" || err != nil {
		// Not a skip: the build tag asked for this scenario, and a
		// scenario that did not run must not look like one that passed.
		t.Fatal("IDEM_FAILOVER_* are not set: run the scenario with `make failover` (.ci/pgfailover.sh creates the clusters)")
	}
	e.primaryPID = pid
	return e
}

// TestFailover runs the orders service and a store-level Do client against
// the primary, SIGKILLs the primary's whole process group under load (the
// postmaster and every backend at once, as a crash of its host would),
// promotes the standby after a pause in which there is no primary, keeps
// the load on, and then checks the promoted database against every answer
// the clients saw.
func TestFailover(t *testing.T) {
	e := readEnv(t)
	ctx := t.Context()

	standby, err := pgx.Connect(ctx, e.standbyURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = standby.Close(context.WithoutCancel(ctx)) })
	var inRecovery bool
	require.NoError(t, standby.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery))
	require.True(t, inRecovery, "the standby must be in recovery before the failover")
	primary, err := pgx.Connect(ctx, e.primaryURL)
	require.NoError(t, err)
	var syncNames, syncState string
	require.NoError(t, primary.QueryRow(ctx, `SELECT current_setting('synchronous_standby_names'),
		(SELECT string_agg(sync_state, ',') FROM pg_stat_replication)`).Scan(&syncNames, &syncState))
	_ = primary.Close(ctx)
	require.NotEmpty(t, syncNames, "the primary must name a synchronous standby")
	require.Equal(t, "sync", syncState, "the standby must be the synchronous one")

	bin := buildOrders(t)
	svc := startOrders(t, bin, "-db", e.dsn, "-wait-timeout", "2s", "-lease", "10s", "-reap-interval", "1h")

	// The store-level client: Do on its own pool over the same DSN, so
	// that the errors a Go caller gets during the failover are seen with
	// their classification (the HTTP service turns every store error into
	// a 503).
	pool, err := pgxpool.New(ctx, e.dsn)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS do_effects (
		id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
		idempotency_key text NOT NULL)`) // no unique constraint: a second run of an intent would show
	require.NoError(t, err)
	store, err := idem.New(idempg.New(pool), &idem.Config{LeaseDuration: 10 * time.Second, WaitTimeout: 2 * time.Second})
	require.NoError(t, err)

	// A client that reaches the standby directly, as one whose DNS name or
	// virtual IP has not moved yet would: refused as unavailable (25006)
	// until the promotion, served afterwards.
	standbyPool, err := pgxpool.New(ctx, e.standbyURL)
	require.NoError(t, err)
	t.Cleanup(standbyPool.Close)
	standbyStore, err := idem.New(idempg.New(standbyPool), &idem.Config{})
	require.NoError(t, err)
	standbyDo := func() error {
		_, err := standbyStore.Do(ctx, "standby-probe", "before-and-after", idem.NewFingerprint([]byte("probe")),
			func(context.Context, pgx.Tx) (*idem.Response, error) { return &idem.Response{StatusCode: 200}, nil })
		return err
	}
	err = standbyDo()
	require.ErrorIs(t, err, idem.ErrStoreUnavailable, "Do on the standby before the promotion")
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "25006", pgErr.Code)

	httpClients := scaled(8, 16)
	doClients := scaled(2, 4)
	beforeKill := scaled(4*time.Second, 15*time.Second)
	noPrimary := scaled(time.Second, 2*time.Second)
	afterPromote := scaled(4*time.Second, 15*time.Second)

	run := &runState{}
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	// Each client finishes the intent it is on after stopLoad; this bounds
	// how long that may take.
	finishCtx, cancelFinish := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancelFinish()
	var wg sync.WaitGroup
	for c := range httpClients {
		wg.Go(func() { run.httpClient(loadCtx, finishCtx, svc.base, c) })
	}
	for c := range doClients {
		wg.Go(func() { run.doClient(loadCtx, finishCtx, store, c) })
	}

	sleep(t, beforeKill)
	killedAt := time.Now()
	run.killedAt.Store(killedAt.UnixNano())
	killPrimary(t, e.primaryPID)
	t.Logf("primary killed (SIGKILL to the process group of postmaster %d) after %s of load", e.primaryPID, beforeKill)

	sleep(t, noPrimary)
	var promoted bool
	require.NoError(t, standby.QueryRow(ctx, "SELECT pg_promote(true, 60)").Scan(&promoted))
	require.True(t, promoted, "pg_promote did not finish within 60s")
	promotedAt := time.Now()
	require.NoError(t, standby.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery))
	require.False(t, inRecovery)
	t.Logf("standby promoted %s after the kill", promotedAt.Sub(killedAt).Round(time.Millisecond))

	require.NoError(t, standbyDo(), "Do on the promoted standby")

	sleep(t, afterPromote)
	stopLoad()
	wg.Wait()

	v := run.verify(t, standby, svc.base)
	outage := "no success of a request sent after the kill"
	if first := run.firstOKAfterKill.Load(); first != 0 {
		// pg_promote(wait) polls for the end of recovery every 100 ms: the
		// first 201 may come before it returns.
		outage = fmt.Sprintf("first success of a request sent after the kill %s after the kill",
			time.Duration(first-killedAt.UnixNano()).Round(time.Millisecond))
	}
	notes := fmt.Sprintf("%d HTTP clients, %d intents (%d retried: %d replayed, %d ran once on the new primary); %d Do clients, %d intents, %d Do errors unclassified; %d verification replays; pg_promote returned %s after the kill; %s",
		httpClients, v.intents, v.retried, v.retriedReplayed, v.retriedFresh,
		doClients, v.doIntents, v.unclassified, v.verifyReplays,
		promotedAt.Sub(killedAt).Round(time.Millisecond), outage)
	report(t, run, v, notes)
	if t.Failed() {
		t.Logf("orders stderr:\n%s", svc.logs.String())
	}
}

func sleep(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case <-time.After(d):
	case <-t.Context().Done():
		t.FailNow()
	}
}

// killPrimary SIGKILLs the postmaster's process group (pg_ctl starts the
// postmaster as a session leader, so its group is the postmaster and every
// backend) and waits until the port refuses connections.
func killPrimary(t *testing.T, pid int) {
	t.Helper()
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	require.NoError(t, err, "the primary's postmaster %d", pid)
	require.Contains(t, string(cmdline), "postgres", "process %d is not a postmaster", pid)
	pgid, err := syscall.Getpgid(pid)
	require.NoError(t, err)
	require.Equal(t, pid, pgid, "the postmaster is expected to lead its process group")
	require.NoError(t, syscall.Kill(-pgid, syscall.SIGKILL))
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", "127.0.0.1:15432", 200*time.Millisecond)
		if err != nil {
			return
		}
		_ = c.Close()
		require.True(t, time.Now().Before(deadline), "the primary still accepts connections 10s after SIGKILL")
		time.Sleep(20 * time.Millisecond)
	}
}

// buildOrders builds examples/orders (without -race: the detector belongs
// to this process; the service's own tests run under -race).
func buildOrders(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "orders")
	cmd := exec.CommandContext(t.Context(), "go", "build", "-o", bin, "./examples/orders")
	cmd.Dir = filepath.Join("..", "..") // the module root
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build ./examples/orders: %s", out)
	return bin
}

type orders struct {
	base string
	logs *lockedBuffer
}

type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.buf.Len() > 1<<20 {
		return len(p), nil
	}
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

var readyLine = regexp.MustCompile(`^orders: serving on (http://\S+) `)

// startOrders starts the service and returns once it serves; it is
// stopped when t ends.
func startOrders(t *testing.T, bin string, args ...string) *orders {
	t.Helper()
	//nolint:noctx // stopped in t.Cleanup, after every use
	cmd := exec.Command(bin, append([]string{"-addr", "127.0.0.1:0", "-token-secret", ordersproc.TokenSecret}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // no orphan if the test dies
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	o := &orders{logs: &lockedBuffer{}}
	cmd.Stderr = o.logs
	require.NoError(t, cmd.Start())
	done := make(chan struct{})
	ready := make(chan string, 1)
	go func() {
		lines := bufio.NewScanner(stdout)
		if lines.Scan() {
			ready <- lines.Text()
		}
		_, _ = io.Copy(io.Discard, stdout)
		_ = cmd.Wait()
		close(done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	select {
	case line := <-ready:
		m := readyLine.FindStringSubmatch(line)
		require.NotNil(t, m, "ready line %q; stderr: %s", line, o.logs)
		o.base = m[1]
	case <-done:
		t.Fatalf("orders exited before serving: %s", o.logs)
	case <-time.After(60 * time.Second):
		t.Fatalf("orders did not serve within 60s: %s", o.logs)
	}
	return o
}

// intent is one business intent of a client: one key, sent until a final
// answer.
type intent struct {
	tenant, key, body string
	labels            []string // every answer, in order
	oks               [][]byte // every 201 body
	final             string   // the last answer's label
}

// runState collects what every client saw. Safe for concurrent use.
type runState struct {
	killedAt, firstOKAfterKill atomic.Int64 // UnixNano

	mu       sync.Mutex
	intents  []*intent
	do       []*doIntent
	codes    map[string]int
	requests int
}

func (r *runState) count(label string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.codes == nil {
		r.codes = map[string]int{}
	}
	r.codes[label]++
	r.requests++
}

// sawOK notes a success of an attempt sent at sent: the first one sent
// after the kill measures how long the service had no primary (an attempt
// sent before may have committed before the kill and been answered after).
func (r *runState) sawOK(sent time.Time) {
	if k := r.killedAt.Load(); k != 0 && sent.UnixNano() > k && r.firstOKAfterKill.Load() == 0 {
		r.firstOKAfterKill.CompareAndSwap(0, time.Now().UnixNano())
	}
}

var httpClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}

// post sends one POST /orders and labels the answer.
func post(ctx context.Context, base string, in *intent) (label string, body []byte) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/orders", strings.NewReader(in.body))
	if err != nil {
		return "request error", nil
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+ordersproc.Token(in.tenant))
	req.Header.Set("Idempotency-Key", in.key)
	resp, err := httpClient.Do(req)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return "client timeout", nil
		}
		return "connection error", nil
	}
	defer resp.Body.Close()
	body, err = io.ReadAll(resp.Body)
	if err != nil {
		return "connection error", nil
	}
	switch {
	case resp.StatusCode == http.StatusCreated && resp.Header.Get("Idempotency-Replayed") == "true":
		return "201 replayed", body
	case resp.StatusCode == http.StatusCreated:
		return "201", body
	}
	var e struct {
		Code string `json:"code"`
	}
	_ = json.Unmarshal(body, &e)
	return fmt.Sprintf("%d %s", resp.StatusCode, e.Code), body
}

// retryable reports whether a client retries after label: no answer, 409
// in progress, a 503, or the service's 500 internal_error (the order's
// INSERT failed, the transaction rolled back and the key is free: nothing
// happened).
func retryable(label string) bool {
	switch label {
	case "client timeout", "connection error", "409 idempotency_request_in_progress",
		"503 idempotency_store_unavailable", "500 internal_error":
		return true
	}
	return false
}

// pause backs off between retries: 50 ms doubling to 800 ms, with jitter.
// Shorter than the Retry-After: 2 the service advertises for a 503, to
// keep the run short; it changes how often a client asks, not what it gets.
func pause(ctx context.Context, try int) bool {
	d := (50 * time.Millisecond) << min(try, 4)
	d = d/2 + rand.N(d/2+1)
	select {
	case <-time.After(d):
		return true
	case <-ctx.Done():
		return false
	}
}

func (r *runState) httpClient(loadCtx, finishCtx context.Context, base string, c int) {
	tenants := []string{"tenant-a", "tenant-b", "tenant-c"}
	for n := 0; loadCtx.Err() == nil; n++ {
		in := &intent{
			tenant: tenants[(c+n)%len(tenants)],
			key:    fmt.Sprintf("failover-%02d-%06d", c, n),
			body:   fmt.Sprintf(`{"sku":"sku-%d","qty":%d,"amount_cents":%d}`, n%7, 1+n%3, 100+n),
		}
		r.mu.Lock()
		r.intents = append(r.intents, in)
		r.mu.Unlock()
		for try := 0; ; try++ {
			sent := time.Now()
			label, body := post(finishCtx, base, in)
			r.count(label)
			in.labels = append(in.labels, label)
			in.final = label
			if strings.HasPrefix(label, "201") {
				in.oks = append(in.oks, body)
				r.sawOK(sent)
				break
			}
			if !retryable(label) || !pause(finishCtx, try) {
				break
			}
		}
	}
}

// doIntent is one intent of the store-level client.
type doIntent struct {
	key          string
	errs         []string // every error, classified or not
	unclassified []string
	effectErrs   []string // the callback's own errors, which idem returns as they are
	ok           *idem.Result
	attempts     int
}

// errEffect marks an error of the callback's own statement, which idem
// returns as it is (the caller classifies its own errors).
var errEffect = errors.New("the effect's INSERT failed")

func (r *runState) doClient(loadCtx, finishCtx context.Context, store *idem.Store[pgx.Tx], c int) {
	const scope = "do-probe"
	for n := 0; loadCtx.Err() == nil; n++ {
		d := &doIntent{key: fmt.Sprintf("do-%02d-%06d", c, n)}
		r.mu.Lock()
		r.do = append(r.do, d)
		r.mu.Unlock()
		fp := idem.NewFingerprint([]byte(d.key))
		for try := 0; ; try++ {
			d.attempts++
			sent := time.Now()
			callCtx, cancel := context.WithTimeout(finishCtx, 10*time.Second)
			res, err := store.Do(callCtx, scope, d.key, fp, func(ctx context.Context, tx pgx.Tx) (*idem.Response, error) {
				var id int64
				if err := tx.QueryRow(ctx, "INSERT INTO do_effects (idempotency_key) VALUES ($1) RETURNING id", d.key).Scan(&id); err != nil {
					return nil, fmt.Errorf("%w: %w", errEffect, err)
				}
				return &idem.Response{StatusCode: 200, Body: []byte(strconv.FormatInt(id, 10))}, nil
			})
			cancel()
			if err == nil {
				d.ok = res
				r.sawOK(sent)
				break
			}
			label := classify(err)
			d.errs = append(d.errs, label)
			if strings.HasPrefix(label, "unclassified") {
				d.unclassified = append(d.unclassified, err.Error())
			}
			if strings.HasPrefix(label, "effect error") {
				d.effectErrs = append(d.effectErrs, err.Error())
			}
			if finishCtx.Err() != nil || !pause(finishCtx, try) {
				break
			}
		}
	}
}

// classify names an error of Do the way a caller would branch on it.
func classify(err error) string {
	var pgErr *pgconn.PgError
	code := ""
	if errors.As(err, &pgErr) {
		code = " " + pgErr.Code
	}
	switch {
	case errors.Is(err, idem.ErrStoreUnavailable):
		return "ErrStoreUnavailable"
	case errors.Is(err, idem.ErrRetryable):
		return "ErrRetryable"
	case errors.Is(err, idem.ErrInProgress):
		return "ErrInProgress"
	case errors.Is(err, errEffect):
		return "effect error" + code
	default:
		return "unclassified" + code
	}
}

// verdict is what the checks at the end found.
type verdict struct {
	intents, retried, retriedReplayed, retriedFresh int
	doIntents, unclassified                         int
	verifyReplays                                   int
	duplicates, lost                                int
}

// verify checks the promoted database (through conn, a direct connection
// to it) and the service now running on it against every answer the
// clients saw.
func (r *runState) verify(t *testing.T, conn *pgx.Conn, base string) verdict {
	t.Helper()
	ctx := t.Context()
	r.mu.Lock()
	defer r.mu.Unlock()
	var v verdict

	type tk struct{ tenant, key string }
	type row struct {
		n  int
		id int64
	}
	rows := map[tk]row{}
	rs, err := conn.Query(ctx, "SELECT tenant, idempotency_key, count(*), min(id) FROM orders GROUP BY 1, 2")
	require.NoError(t, err)
	for rs.Next() {
		var k tk
		var w row
		require.NoError(t, rs.Scan(&k.tenant, &k.key, &w.n, &w.id))
		rows[k] = w
	}
	require.NoError(t, rs.Err())
	orderRows := 0
	for k, w := range rows {
		orderRows += w.n
		if w.n > 1 { // the table's unique constraint forbids it; counted all the same
			v.duplicates += w.n - 1
			t.Errorf("%d orders for %s/%s", w.n, k.tenant, k.key)
		}
	}

	v.intents = len(r.intents)
	for _, in := range r.intents {
		if len(in.oks) == 0 {
			t.Errorf("intent %s/%s ended without a 201: %v", in.tenant, in.key, in.labels)
			continue
		}
		first := in.oks[0]
		for _, b := range in.oks[1:] {
			if !bytes.Equal(b, first) {
				v.duplicates++
				t.Errorf("intent %s/%s: two different 201s: %s and %s", in.tenant, in.key, first, b)
			}
		}
		var o struct {
			ID int64 `json:"id"`
		}
		require.NoError(t, json.Unmarshal(first, &o), "201 body %s", first)
		w, ok := rows[tk{in.tenant, in.key}]
		switch {
		case !ok:
			v.lost++
			t.Errorf("intent %s/%s: acknowledged order %d is not in the promoted database (answers %v)", in.tenant, in.key, o.ID, in.labels)
		case w.id != o.ID:
			v.lost++
			t.Errorf("intent %s/%s: acknowledged order %d, the promoted database holds %d", in.tenant, in.key, o.ID, w.id)
		}
		// The stored response: a retry now, on the promoted database, must
		// be a replay of the very bytes the client got.
		label, body := post(ctx, base, in)
		v.verifyReplays++
		if label != "201 replayed" || !bytes.Equal(body, first) {
			v.lost++
			t.Errorf("intent %s/%s: replay on the promoted database: %s %s, want 201 replayed %s", in.tenant, in.key, label, body, first)
		}
		if len(in.labels) > 1 {
			v.retried++
			if in.final == "201 replayed" {
				v.retriedReplayed++
			} else {
				v.retriedFresh++
			}
		}
	}
	// Orders = completed keys: every committed order has its record and no
	// record exists without its order.
	var completed, other int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 2), count(*) FILTER (WHERE status <> 2)
		FROM idempotency_keys WHERE scope NOT IN ('do-probe', 'standby-probe')`).Scan(&completed, &other))
	assert.Equal(t, orderRows, completed, "orders rows vs completed idempotency records")
	assert.Zero(t, other, "records not completed")
	if orderRows > len(r.intents) {
		t.Errorf("%d orders for %d intents", orderRows, len(r.intents))
	}

	// The Do client: one effect per key, the one whose id Do answered.
	effects := map[string][]int64{}
	rs, err = conn.Query(ctx, "SELECT idempotency_key, id FROM do_effects")
	require.NoError(t, err)
	for rs.Next() {
		var k string
		var id int64
		require.NoError(t, rs.Scan(&k, &id))
		effects[k] = append(effects[k], id)
	}
	require.NoError(t, rs.Err())
	v.doIntents = len(r.do)
	for _, d := range r.do {
		v.unclassified += len(d.unclassified)
		for _, u := range d.unclassified {
			t.Errorf("Do %s: unclassified error: %s", d.key, u)
		}
		for _, u := range d.effectErrs {
			t.Logf("Do %s: the callback's INSERT failed: %s", d.key, u)
		}
		if d.ok == nil {
			t.Errorf("Do %s ended without a result: %v", d.key, d.errs)
			continue
		}
		ids := effects[d.key]
		if len(ids) > 1 {
			v.duplicates += len(ids) - 1
			t.Errorf("Do %s: %d effects", d.key, len(ids))
		}
		if len(ids) == 0 || strconv.FormatInt(ids[0], 10) != string(d.ok.Response.Body) {
			v.lost++
			t.Errorf("Do %s: answered effect %s, the promoted database holds %v", d.key, d.ok.Response.Body, ids)
		}
		r.codes["Do: ok"]++
		if d.ok.Replayed {
			r.codes["Do: ok replayed"]++
		}
		for _, e := range d.errs {
			r.codes["Do: "+e]++
		}
		r.requests += d.attempts
	}
	return v
}

// report logs the docs/reliability.md row, prefixed with FAULTS| as the
// fault suite's rows are, and fails on a duplicate or a lost order.
func report(t *testing.T, r *runState, v verdict, notes string) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	var codes []string
	for _, k := range slices.Sorted(maps.Keys(r.codes)) {
		codes = append(codes, fmt.Sprintf("%s: %d", k, r.codes[k]))
	}
	t.Logf("FAULTS| failover | postgres | %s | %d | 1 primary SIGKILL + promotion | %d | %d | %s | %s |",
		scaled("ci", "full"), r.requests, v.duplicates, v.lost, strings.Join(codes, ", "), notes)
	if v.duplicates != 0 || v.lost != 0 {
		t.Errorf("%d duplicate(s) and %d lost acknowledged order(s); both must be zero", v.duplicates, v.lost)
	}
}
