package main

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/internal/testdb"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// TestMain runs the command itself when a test re-executes the test binary
// with ORDERS_RUN_MAIN=1, so that real signals can be sent to it.
func TestMain(m *testing.M) {
	if os.Getenv("ORDERS_RUN_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestDemo plays the demo on every database: it must print its table and
// report every step as expected.
func TestDemo(t *testing.T) {
	t.Parallel()
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		playDemoOn(t, filepath.Join(t.TempDir(), "orders.db"))
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		url, schema := postgresTestSchema(t)
		playDemoOn(t, url, "-schema", schema)
	})
	t.Run("mariadb", func(t *testing.T) {
		t.Parallel()
		playDemoOn(t, mysqlDatabaseDSN(t))
	})
}

func playDemoOn(t *testing.T, db string, args ...string) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := run(t.Context(), append([]string{"-demo", "-db", db}, args...), &out, &errOut)
	t.Log("\n" + out.String())
	require.NoError(t, err, errOut.String())
	require.Regexp(t, `^orders: serving on http://127\.0\.0\.1:\d+ `, out.String(), "one ready line first")
	require.Contains(t, out.String(), "All 12 steps behaved as expected.")
	require.NotContains(t, out.String(), "FAILED")
	for _, step := range []string{"first POST", "client retries", "JSON keys reordered", "amount changed",
		"50 concurrent duplicates", "no Idempotency-Key", "another tenant, same key", "in-flight duplicate",
		"in-flight payment duplicate", "payment retried"} {
		require.Contains(t, out.String(), step)
	}
}

// postgresTestSchema returns the test server's URL and a fresh schema, dropped
// when t ends, for -schema: no search_path, so that the demo runs through
// a transaction pooler too (.ci/pgbouncer.sh). The URL carries the exec
// mode of testdb.PostgresExecModes (the first), as a pooler refuses pgx's
// statement cache.
func postgresTestSchema(t *testing.T) (url, schema string) {
	t.Helper()
	url = testdb.PostgresURL(t)
	ctx := t.Context()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.WithoutCancel(ctx)) })
	schema = testdb.Name()
	_, err = conn.Exec(ctx, "CREATE SCHEMA "+schema)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := conn.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+schema+" CASCADE")
		assert.NoError(t, err)
	})
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	return url + sep + "default_query_exec_mode=" + testdb.PostgresExecModes()[0], schema
}

// mysqlDatabaseDSN returns mysql:// and the test server's DSN on a fresh
// database, dropped when t ends.
func mysqlDatabaseDSN(t *testing.T) string {
	t.Helper()
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
	_, err = admin.ExecContext(t.Context(), "CREATE DATABASE "+name)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := admin.ExecContext(context.WithoutCancel(t.Context()), "DROP DATABASE IF EXISTS "+name)
		assert.NoError(t, err)
	})
	cfg.DBName = name
	cfg.ParseTime = false // the service adds what it needs
	return "mysql://" + cfg.FormatDSN()
}

// TestAPI checks the routes the demo does not use, and the orders table's
// own unique constraint.
func TestAPI(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	path := filepath.Join(t.TempDir(), "orders.db")
	db, err := openDatabase(ctx, path, "")
	require.NoError(t, err)
	t.Cleanup(db.close)
	o, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	svc, err := db.service(ctx, o, nil)
	require.NoError(t, err)
	srv := httptest.NewServer(svc.handler)
	t.Cleanup(srv.Close)

	do := func(method, path, tenant, key, body string) (*http.Response, []byte) {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, method, srv.URL+path, strings.NewReader(body))
		require.NoError(t, err)
		if tenant != "" {
			req.Header.Set("Authorization", "Bearer "+svc.token(tenant))
		}
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp, b
	}
	code := func(body []byte) string {
		var e struct{ Code string }
		require.NoError(t, json.Unmarshal(body, &e))
		return e.Code
	}

	resp, created := do("POST", "/orders", "acme", "api-test-key-1", `{"sku":"tea","qty":2,"amount_cents":900}`)
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	var order map[string]any
	require.NoError(t, json.Unmarshal(created, &order))
	for _, field := range []string{"id", "tenant", "sku", "qty", "amount_cents", "created_at"} {
		require.Contains(t, order, field)
	}
	location := resp.Header.Get("Location")
	require.Regexp(t, `^/orders/\d+$`, location)

	resp, got := do("GET", location, "acme", "", "")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.JSONEq(t, string(created), string(got), "GET returns the order as created")
	resp, list := do("GET", "/orders", "acme", "", "")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var listed struct {
		Count  int              `json:"count"`
		Orders []map[string]any `json:"orders"`
	}
	require.NoError(t, json.Unmarshal(list, &listed))
	require.Equal(t, 1, listed.Count)
	require.Len(t, listed.Orders, 1)

	resp, _ = do("GET", location, "globex", "", "")
	require.Equal(t, http.StatusNotFound, resp.StatusCode, "another tenant's order does not exist for it")
	resp, list = do("GET", "/orders", "globex", "", "")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.JSONEq(t, `{"count":0,"orders":[]}`, string(list))

	for _, r := range []struct{ method, path, key string }{{"GET", "/orders", ""}, {"GET", location, ""}, {"POST", "/orders", "api-test-key-2"}} {
		resp, body := do(r.method, r.path, "", r.key, `{"sku":"tea","qty":2,"amount_cents":900}`)
		require.Equal(t, http.StatusUnauthorized, resp.StatusCode, r)
		require.Equal(t, "unauthenticated", code(body))
	}
	for _, bad := range []string{`{"sku":"tea","qty":0,"amount_cents":900}`, `{"sku":"tea","qty":1,"amount_cents":-1}`, `{"qty":1,"amount_cents":1}`} {
		resp, body := do("POST", "/orders", "acme", "api-test-key-3", bad)
		require.Equal(t, http.StatusUnprocessableEntity, resp.StatusCode, bad)
		require.Equal(t, "validation_failed", code(body))
	}
	resp, body := do("POST", "/orders", "acme", "api-test-key-3", `{"sku":"tea","qty":"two"}`)
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
	require.Equal(t, "invalid_body", code(body))

	// POST /payments, in the leased mode: charged once, replayed, and a
	// request that fails validation leaves the key free.
	resp, paid := do("POST", "/payments", "acme", "api-test-pay-1", `{"amount_cents":4200}`)
	require.Equal(t, http.StatusCreated, resp.StatusCode, string(paid))
	require.Regexp(t, `^/payments/\d+$`, resp.Header.Get("Location"))
	var pm map[string]any
	require.NoError(t, json.Unmarshal(paid, &pm))
	for _, field := range []string{"id", "tenant", "charge_id", "amount_cents", "attempt", "created_at"} {
		require.Contains(t, pm, field)
	}
	resp, again := do("POST", "/payments", "acme", "api-test-pay-1", `{"amount_cents":4200}`)
	require.Equal(t, "true", resp.Header.Get("Idempotency-Replayed"))
	require.Equal(t, string(paid), string(again))
	require.Equal(t, 1, svc.providerCalls())
	resp, body = do("POST", "/payments", "acme", "api-test-pay-2", `{"amount_cents":0}`)
	require.Equal(t, http.StatusUnprocessableEntity, resp.StatusCode)
	require.Equal(t, "validation_failed", code(body))
	resp, _ = do("POST", "/payments", "acme", "api-test-pay-2", `{"amount_cents":1}`)
	require.Equal(t, http.StatusCreated, resp.StatusCode, "the 422 released the key")
	require.Equal(t, 2, svc.providerCalls())

	// The business backstop: a second order for one (tenant, key) cannot
	// be written, whatever happens above the table.
	raw, err := idemsqlite.Open(path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = raw.Close() })
	_, err = raw.ExecContext(ctx, `INSERT INTO orders (tenant, idempotency_key, sku, qty, amount_cents, created_at)
		VALUES ('acme', 'api-test-key-1', 'tea', 2, 900, ?)`, time.Now())
	require.Error(t, err, "the unique constraint on (tenant, idempotency_key) holds")
}

func TestFlags(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"-no-such-flag"},
		{"stray-argument"},
		{"-db", "mysql://root@tcp(127.0.0.1:3306)/"}, // no database
		{"-db", "postgres://%zz"},
		{"-wait-timeout", "soon"},
		{"-schema", "shop"}, // PostgreSQL only; -db is SQLite here
	} {
		require.Error(t, run(t.Context(), args, io.Discard, io.Discard), "%q", args)
	}
}

// TestShutdownOnSignal runs the command as a process and stops it with
// SIGINT and SIGTERM: a request in flight still gets its answer, the
// process exits 0, and the temporary database is removed.
func TestShutdownOnSignal(t *testing.T) {
	t.Parallel()
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			//nolint:gosec // G204: re-executes this test binary (os.Args[0]) with fixed arguments
			cmd := exec.CommandContext(t.Context(), os.Args[0], "-addr", "127.0.0.1:0", "-handler-delay", "700ms", "-token-secret", testTokenSecret)
			cmd.Env = append(os.Environ(), "ORDERS_RUN_MAIN=1")
			stdout, err := cmd.StdoutPipe()
			require.NoError(t, err)
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			require.NoError(t, cmd.Start())

			lines := bufio.NewScanner(stdout)
			require.True(t, lines.Scan(), "the ready line")
			ready := regexp.MustCompile(`^orders: serving on (http://\S+) \(database: SQLite file (.+)\)$`).FindStringSubmatch(lines.Text())
			require.NotNil(t, ready, lines.Text())
			base, dbPath := ready[1], ready[2]
			require.FileExists(t, dbPath)

			inFlight := make(chan int, 1)
			go func() {
				req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, base+"/orders", strings.NewReader(`{"sku":"tea","qty":1,"amount_cents":100}`))
				req.Header.Set("Authorization", "Bearer "+testToken("acme"))
				req.Header.Set("Idempotency-Key", "signal-test-key-1")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					inFlight <- 0
					return
				}
				resp.Body.Close()
				inFlight <- resp.StatusCode
			}()
			time.Sleep(300 * time.Millisecond) // the request is in its handler
			require.NoError(t, cmd.Process.Signal(sig))

			require.Equal(t, http.StatusCreated, <-inFlight, "the request in flight finished")
			rest, _ := io.ReadAll(stdout)
			require.NoError(t, cmd.Wait(), "exit status 0; stderr: %s", stderr.String())
			require.Contains(t, string(rest), "orders: stopped")
			require.NoDirExists(t, filepath.Dir(dbPath), "the temporary database is removed")
		})
	}
}

// startOrders runs the service in this process with args and returns its
// base URL; it stops when t ends.
func startOrders(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append([]string{"-addr", "127.0.0.1:0", "-db", filepath.Join(t.TempDir(), "orders.db"), "-token-secret", testTokenSecret}, args...), pw, io.Discard)
		_ = pw.Close()
	}()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	lines := bufio.NewScanner(pr)
	require.True(t, lines.Scan(), "the ready line")
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	m := regexp.MustCompile(`^orders: serving on (http://\S+) `).FindStringSubmatch(lines.Text())
	require.NotNil(t, m, lines.Text())
	return m[1]
}

// TestFaultInjectionSwitch checks that X-Fault-Crash does nothing without
// -fault-injection (were it honoured, this test binary would die), and
// that with it an unknown stage is refused.
func TestFaultInjectionSwitch(t *testing.T) {
	t.Parallel()
	post := func(base, stage, key string) (*http.Response, []byte) {
		t.Helper()
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, base+"/orders", strings.NewReader(`{"sku":"tea","qty":1,"amount_cents":100}`))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+testToken("acme"))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set(crashHeader, stage)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp, body
	}
	off := startOrders(t)
	for _, stage := range []string{crashBeforeClaim, crashAfterClaim, crashAfterCommit} {
		resp, body := post(off, stage, "fault-off-"+stage)
		require.Equal(t, http.StatusCreated, resp.StatusCode, "%s: %s", stage, body)
	}
	on := startOrders(t, "-fault-injection")
	resp, body := post(on, "after-lunch", "fault-on-unknown")
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
	require.Contains(t, string(body), "fault_stage_unknown")
	resp, body = post(on, "", "fault-on-none")
	require.Equal(t, http.StatusCreated, resp.StatusCode, "no header, no crash: %s", body)
}

// TestOutsideProvider runs POST /payments against -provider-url: the
// charge is made there, once, and its id is what the payment records.
func TestOutsideProvider(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	calls := map[string]int{}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", func(w http.ResponseWriter, r *http.Request) {
		var in providerRequest
		require.NoError(t, json.NewDecoder(r.Body).Decode(&in))
		mu.Lock()
		calls[in.Key]++
		mu.Unlock()
		_ = json.NewEncoder(w).Encode(charge{ID: "ch_outside", AmountCents: in.AmountCents})
	})
	mux.HandleFunc("POST /charges/lookup", func(w http.ResponseWriter, r *http.Request) {
		var in providerRequest
		require.NoError(t, json.NewDecoder(r.Body).Decode(&in))
		mu.Lock()
		defer mu.Unlock()
		switch {
		case in.Key == "broken":
			http.Error(w, "down", http.StatusInternalServerError)
		case calls[in.Key] == 0:
			http.NotFound(w, r)
		default:
			_ = json.NewEncoder(w).Encode(charge{ID: "ch_outside", AmountCents: 4200})
		}
	})
	provider := httptest.NewServer(mux)
	t.Cleanup(provider.Close)
	base := startOrders(t, "-provider-url", provider.URL)
	for range 2 {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, base+"/payments", strings.NewReader(`{"amount_cents":4200}`))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+testToken("acme"))
		req.Header.Set("Idempotency-Key", "outside-provider-1")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, resp.StatusCode, string(body))
		require.Contains(t, string(body), `"charge_id":"ch_outside"`)
	}
	// -provider-url (the fault suite's mode) trusts no tenant header
	// either: without a token, 401 and no charge.
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, base+"/payments", strings.NewReader(`{"amount_cents":4200}`))
	require.NoError(t, err)
	req.Header.Set("X-Tenant-ID", "acme")
	req.Header.Set("Idempotency-Key", "outside-provider-2")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	mu.Lock()
	keys := make([]string, 0, len(calls))
	for key, n := range calls {
		keys = append(keys, key)
		assert.Equal(t, 1, n, "charged once; the retry replayed")
	}
	mu.Unlock()
	require.Len(t, keys, 1)

	// The status check's lookup: 200 is the charge, 404 no charge, anything
	// else an error (the verdict stays unknown).
	p := newProvider(0, provider.URL)
	for _, key := range keys {
		c, found, err := p.lookup(t.Context(), key)
		require.NoError(t, err)
		require.True(t, found)
		require.Equal(t, "ch_outside", c.ID)
	}
	_, found, err := p.lookup(t.Context(), "no-such-key")
	require.NoError(t, err)
	require.False(t, found)
	_, _, err = p.lookup(t.Context(), "broken")
	require.Error(t, err)
}

// testTokenSecret signs the tokens of the servers the tests start.
const testTokenSecret = "test-secret"

// testToken returns a bearer token for tenant, signed with testTokenSecret.
func testToken(tenant string) string { return newAuthenticator(testTokenSecret).token(tenant) }

// TestTenantComesFromAuthentication: the tenant is the bearer token's. A
// request without a valid token is refused with 401 before anything is
// claimed, and an X-Tenant-ID header naming another tenant changes nothing:
// acme's stored response never reaches a caller who only knows acme's key.
func TestTenantComesFromAuthentication(t *testing.T) {
	t.Parallel()
	base := startOrders(t)
	post := func(auth, tenantHeader string) (*http.Response, []byte) {
		t.Helper()
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, base+"/orders", strings.NewReader(`{"sku":"tea","qty":1,"amount_cents":100}`))
		require.NoError(t, err)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		if tenantHeader != "" {
			req.Header.Set("X-Tenant-ID", tenantHeader)
		}
		req.Header.Set("Idempotency-Key", "auth-test-key-0001")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp, body
	}
	first, body := post("Bearer "+testToken("acme"), "")
	require.Equal(t, http.StatusCreated, first.StatusCode, string(body))

	for _, auth := range []string{"", "Bearer acme", "Bearer acme.00", "Bearer " + testToken("acme") + "0",
		"Bearer " + newAuthenticator("other-secret").token("acme")} {
		resp, body := post(auth, "acme")
		require.Equal(t, http.StatusUnauthorized, resp.StatusCode, "%q: %s", auth, body)
		require.NotContains(t, string(body), `"sku"`, "acme's order must not leak")
	}
	other, body := post("Bearer "+testToken("globex"), "acme")
	require.Equal(t, http.StatusCreated, other.StatusCode, string(body))
	require.Empty(t, other.Header.Get("Idempotency-Replayed"), "globex runs its own order, X-Tenant-ID notwithstanding")
	again, _ := post("Bearer "+testToken("acme"), "")
	require.Equal(t, "true", again.Header.Get("Idempotency-Replayed"))
}

// TestExportStoredByReference: POST /exports' CSV, over -inline-body-max,
// is stored in the body store; a retry with the same key replays it byte
// for byte (the orders as they were), and a new key sees the new order.
func TestExportStoredByReference(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db, err := openDatabase(ctx, filepath.Join(t.TempDir(), "orders.db"), "")
	require.NoError(t, err)
	t.Cleanup(db.close)
	bodies := t.TempDir()
	o, err := parseFlags([]string{"-bodies", bodies, "-inline-body-max", "100"}, io.Discard)
	require.NoError(t, err)
	svc, err := db.service(ctx, o, nil)
	require.NoError(t, err)
	srv := httptest.NewServer(svc.handler)
	t.Cleanup(srv.Close)
	do := func(path, key, body string) (*http.Response, []byte) {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, "POST", srv.URL+path, strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+svc.token("acme"))
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp, b
	}
	for i := range 3 {
		resp, _ := do("/orders", "export-order-"+strconv.Itoa(i), `{"sku":"tea","qty":2,"amount_cents":900}`)
		require.Equal(t, http.StatusCreated, resp.StatusCode)
	}
	before, err := os.ReadDir(bodies)
	require.NoError(t, err)
	first, csv1 := do("/exports", "export-key-0001", `{}`)
	require.Equal(t, http.StatusCreated, first.StatusCode, string(csv1))
	require.Equal(t, 4, strings.Count(string(csv1), "\n"), "a header and three orders")
	objects, err := os.ReadDir(bodies)
	require.NoError(t, err)
	require.Len(t, objects, len(before)+1, "the CSV is in the body store (the 201s of the orders too: over 100 bytes)")

	resp, _ := do("/orders", "export-order-3", `{"sku":"tea","qty":1,"amount_cents":450}`)
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	again, csv2 := do("/exports", "export-key-0001", `{}`)
	require.Equal(t, "true", again.Header.Get("Idempotency-Replayed"))
	require.Equal(t, first.Header.Get("Content-Type"), again.Header.Get("Content-Type"))
	require.Equal(t, csv1, csv2)
	_, csv3 := do("/exports", "export-key-0002", `{}`)
	require.Equal(t, 5, strings.Count(string(csv3), "\n"))
}

// TestExportInTableBodyStore: with -bodies table, POST /exports' CSV is
// kept in the database's idempotency_bodies table, committed with its
// record, and a retry replays it byte for byte.
func TestExportInTableBodyStore(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	path := filepath.Join(t.TempDir(), "orders.db")
	db, err := openDatabase(ctx, path, "")
	require.NoError(t, err)
	t.Cleanup(db.close)
	o, err := parseFlags([]string{"-bodies", "table", "-inline-body-max", "100"}, io.Discard)
	require.NoError(t, err)
	svc, err := db.service(ctx, o, nil)
	require.NoError(t, err)
	srv := httptest.NewServer(svc.handler)
	t.Cleanup(srv.Close)
	do := func(path, key, body string) (*http.Response, []byte) {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, "POST", srv.URL+path, strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+svc.token("acme"))
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp, b
	}
	for i := range 3 {
		resp, _ := do("/orders", "table-order-"+strconv.Itoa(i), `{"sku":"tea","qty":2,"amount_cents":900}`)
		require.Equal(t, http.StatusCreated, resp.StatusCode)
	}
	first, csv1 := do("/exports", "table-export-1", `{}`)
	require.Equal(t, http.StatusCreated, first.StatusCode, string(csv1))
	again, csv2 := do("/exports", "table-export-1", `{}`)
	require.Equal(t, "true", again.Header.Get("Idempotency-Replayed"))
	require.Equal(t, csv1, csv2)

	check, err := idemsqlite.Open(path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = check.Close() })
	var objects int
	require.NoError(t, check.QueryRowContext(ctx, `SELECT count(*) FROM idempotency_bodies WHERE seq = 0`).Scan(&objects))
	require.Equal(t, 4, objects, "the CSV and the three orders' 201s (over 100 bytes) are in the table")
}
