package main_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
	"github.com/idemstore/idem/internal/ordersproc"
	"github.com/idemstore/idem/internal/testdb"
	"github.com/idemstore/idem/migrations"
	idemmysql "github.com/idemstore/idem/mysql"
	idempg "github.com/idemstore/idem/postgres"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// buildMu serialises builds within one test binary: the later builds find
// every package in the build cache and only link.
var buildMu sync.Mutex

// buildIdem builds cmd/idem into t's temporary directory.
func buildIdem(t *testing.T) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	bin := filepath.Join(t.TempDir(), "idem")
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, ".")
	cmd.Env = append(os.Environ(), "GOWORK=off")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build ./cmd/idem\n%s", out)
	return bin
}

type result struct {
	code           int
	stdout, stderr string
}

// idemRun runs the command line with args and returns its exit code and output.
func idemRun(t *testing.T, bin string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), "IDEM_DB=")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		code = exit.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return result{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

func requireCode(t *testing.T, want int, r result, what string) {
	t.Helper()
	require.Equal(t, want, r.code, "%s\nstdout:\n%s\nstderr:\n%s", what, r.stdout, r.stderr)
}

type inspected struct {
	Digest, Scope, Key, Status string
	Token                      int64
	Body                       *string `json:"response_body"`
	BodyBytes                  int     `json:"response_body_bytes"`
	ResponseStatus             int     `json:"response_status"`
}

func inspectJSON(t *testing.T, bin string, args ...string) []inspected {
	t.Helper()
	r := idemRun(t, bin, append([]string{"inspect", "--json"}, args...)...)
	requireCode(t, 0, r, "inspect")
	var out []inspected
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &out))
	return out
}

// Bad input is refused with exit code 2 and a message that echoes neither
// the DSN (it may hold a password) nor a key or scope.
func TestBadInput(t *testing.T) {
	t.Parallel()
	bin := buildIdem(t)
	missing := filepath.Join(t.TempDir(), "none.db")
	db := filepath.Join(t.TempDir(), "idem.db")
	requireCode(t, 0, idemRun(t, bin, "migrate", "up", "--db", db), "migrate up")
	const secret = "s3cr3t-password"
	const key = "customer-key-never-printed"
	for _, c := range []struct {
		name string
		args []string
		msg  string
	}{
		{"no command", nil, "usage"},
		{"unknown command", []string{"frobnicate"}, "unknown command"},
		{"no db", []string{"check"}, "no database"},
		{"unknown dialect", []string{"check", "--db", "redis://u:" + secret + "@h/0"}, `unknown dialect "redis"`},
		{"bad postgres url", []string{"check", "--db", "postgres://u:" + secret + "@h:notaport/db"}, "invalid PostgreSQL URL"},
		{"bad mysql dsn", []string{"check", "--db", "mysql://u:" + secret + "@nonsense"}, "invalid MySQL DSN"},
		{"missing sqlite file", []string{"check", "--db", missing}, "no SQLite database"},
		{"malformed digest", []string{"inspect", "--db", db, "--digest", "xyz" + key}, "malformed digest"},
		{"short digest", []string{"inspect", "--db", db, "--digest", "abcdef"}, "malformed digest"},
		{"digest and key", []string{"inspect", "--db", db, "--digest", "0123456789abcdef", "--key", key}, "not both"},
		{"purge unconfirmed", []string{"purge", "--db", db, "--scope", "acme POST /orders", "--key", key}, "--yes"},
		{"purge scope unconfirmed", []string{"purge", "--db", db, "--scope", "acme POST /orders"}, "--yes"},
		{"release without token", []string{"release", "--db", db, "--scope", "s", "--key", key}, "--token"},
		{"reap without once", []string{"reap", "--db", db}, "--once"},
		{"stray argument", []string{"stats", "--db", db, key}, "unexpected arguments"},
		{"migrate what", []string{"migrate", "sideways", "--db", db}, "up|down|status"},
		{"schema on sqlite", []string{"check", "--db", db, "--schema", "x"}, "PostgreSQL only"},
	} {
		r := idemRun(t, bin, c.args...)
		requireCode(t, 2, r, c.name)
		require.Contains(t, r.stderr, c.msg, c.name)
		require.NotContains(t, r.stderr+r.stdout, secret, c.name)
		require.NotContains(t, r.stderr, key, c.name)
	}
	_, err := os.Stat(missing)
	require.ErrorIs(t, err, os.ErrNotExist, "check creates no file")

	// A well-formed digest that matches nothing: not found, exit 5.
	r := idemRun(t, bin, "inspect", "--db", db, "--digest", "0123456789ABCDEF")
	requireCode(t, 5, r, "unknown digest")
	// An unreachable server: exit 3, and the URL's password is not printed.
	r = idemRun(t, bin, "check", "--timeout", "5s", "--db", "postgres://u:"+secret+"@127.0.0.1:1/db?connect_timeout=2")
	requireCode(t, 3, r, "unreachable")
	require.NotContains(t, r.stderr, secret)
}

var logDigest = regexp.MustCompile(`msg="idemhttp: request".* key=([0-9a-f]{16})`)

// The digest in a log line of the real orders service leads to its record;
// a payment stuck on a killed holder is released by token, and the retry
// then runs.
func TestOrdersLogLineAndStuckPayment(t *testing.T) {
	t.Parallel()
	bin := buildIdem(t)
	orders := ordersproc.Build(t, "../..")
	db := filepath.Join(t.TempDir(), "orders.db")
	srv := ordersproc.Start(t, orders, db, "127.0.0.1:0", "-provider-delay", "1h")

	const key = "order-cli-0001"
	resp := post(t, srv.URL+"/orders", key, `{"sku":"tea","qty":2,"amount_cents":900}`, 10*time.Second)
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	var d string
	require.Eventually(t, func() bool {
		m := logDigest.FindStringSubmatch(srv.Stderr())
		if m != nil {
			d = m[1]
		}
		return m != nil
	}, 10*time.Second, 20*time.Millisecond, "a request log line with the key digest")

	recs := inspectJSON(t, bin, "--db", db, "--digest", d)
	require.Len(t, recs, 1)
	require.Equal(t, idemhttp.ScopeFor("acme", "POST", "/orders"), recs[0].Scope)
	require.Equal(t, key, recs[0].Key)
	require.Equal(t, "succeeded", recs[0].Status)
	require.Equal(t, http.StatusCreated, recs[0].ResponseStatus)
	require.Nil(t, recs[0].Body, "the body is hidden by default")
	require.Positive(t, recs[0].BodyBytes)
	shown := inspectJSON(t, bin, "--db", "sqlite://"+db, "--tenant", "acme", "--method", "POST", "--route", "/orders", "--key", key, "--show-body")
	require.Len(t, shown, 1)
	require.NotNil(t, shown[0].Body)
	require.Contains(t, *shown[0].Body, `"sku":"tea"`)
	human := idemRun(t, bin, "inspect", "--db", db, "--digest", d)
	requireCode(t, 0, human, "inspect for people")
	require.Contains(t, human.stdout, "body hidden")
	require.NotContains(t, human.stdout, `"sku"`)

	// A payment whose holder hangs at the provider, then dies.
	const payKey = "pay-cli-0001"
	go func() { _ = postErr(srv.URL+"/payments", payKey, `{"amount_cents":1500}`, time.Minute) }()
	var token int64
	require.Eventually(t, func() bool {
		r := idemRun(t, bin, "inspect", "--json", "--db", db, "--tenant", "acme", "--method", "POST", "--route", "/payments", "--key", payKey)
		var out []inspected
		if r.code != 0 || json.Unmarshal([]byte(r.stdout), &out) != nil || len(out) != 1 {
			return false
		}
		token = out[0].Token
		return out[0].Status == "processing"
	}, 20*time.Second, 50*time.Millisecond, "the payment's claim is committed")
	srv.Kill(t)
	srv = ordersproc.Start(t, orders, db, srv.Addr)

	resp = post(t, srv.URL+"/payments", payKey, `{"amount_cents":1500}`, 10*time.Second)
	require.Equal(t, http.StatusConflict, resp.StatusCode, "the dead holder's lease is live: in progress")
	pd := idem.KeyDigest(idemhttp.ScopeFor("acme", "POST", "/payments"), payKey)
	require.Eventually(t, func() bool { return strings.Contains(srv.Stderr(), "key="+pd) }, 10*time.Second, 20*time.Millisecond,
		"the 409's log line carries the digest")

	r := idemRun(t, bin, "release", "--db", db, "--digest", pd, "--token", strconv.FormatInt(token+1, 10))
	requireCode(t, 6, r, "a stale token is refused")
	require.NotContains(t, r.stderr, payKey)
	r = idemRun(t, bin, "release", "--db", db, "--digest", pd, "--token", strconv.FormatInt(token, 10))
	requireCode(t, 0, r, "release")
	resp = post(t, srv.URL+"/payments", payKey, `{"amount_cents":1500}`, 10*time.Second)
	require.Equal(t, http.StatusCreated, resp.StatusCode, "the next retry runs")
	require.Equal(t, 1, ordersproc.Rows(t, db, "payments", "acme"))
	resp = post(t, srv.URL+"/payments", payKey, `{"amount_cents":1500}`, 10*time.Second)
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.Equal(t, "true", resp.Header.Get("Idempotency-Replayed"))
}

func post(t *testing.T, url, key, body string, timeout time.Duration) *http.Response {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+ordersproc.Token("acme"))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	_ = resp.Body.Close()
	return resp
}

func postErr(url, key, body string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+ordersproc.Token("acme"))
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err == nil {
		_ = resp.Body.Close()
	}
	return err
}

// dialectCase is one database the command line runs against, with a store
// on the same table for the test to write through.
type dialectCase struct {
	name string
	dsn  string
	args []string // extra flags (--schema)
	// misconfigured is a DSN of the same database that Check must refuse,
	// and what its message must name; empty if none.
	misconfigured, problem string
	// open returns a store over the table with cfg, and a function that
	// counts the table's rows by status with plain SQL.
	open func(t *testing.T, cfg *idem.Config) (opsStore, func() map[idem.Status]int64)
}

// opsStore is what the test needs of a store, whatever its transaction type.
type opsStore interface {
	Claim(ctx context.Context, scope, key string, fp idem.Fingerprint) (*idem.Claim, error)
	Complete(ctx context.Context, c *idem.Claim, resp *idem.Response) error
	Fail(ctx context.Context, c *idem.Claim, resp *idem.Response) error
}

func countSQL(t *testing.T, query func(q string) (map[idem.Status]int64, error)) func() map[idem.Status]int64 {
	return func() map[idem.Status]int64 {
		m, err := query(`SELECT status, COUNT(*) FROM idempotency_keys GROUP BY status`)
		require.NoError(t, err)
		return m
	}
}

func scanCounts(rows *sql.Rows, err error) (map[idem.Status]int64, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	m := map[idem.Status]int64{}
	for rows.Next() {
		var s idem.Status
		var n int64
		if err := rows.Scan(&s, &n); err != nil {
			return nil, err
		}
		m[s] = n
	}
	return m, rows.Err()
}

func sqliteCase(t *testing.T) dialectCase {
	path := filepath.Join(t.TempDir(), "idem.db")
	return dialectCase{name: "sqlite", dsn: path, open: func(t *testing.T, cfg *idem.Config) (opsStore, func() map[idem.Status]int64) {
		db, err := idemsqlite.Open(path)
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		s, err := idem.New(idemsqlite.New(db), cfg)
		require.NoError(t, err)
		return s, countSQL(t, func(q string) (map[idem.Status]int64, error) { return scanCounts(db.Query(q)) })
	}}
}

func mysqlCase(t *testing.T) dialectCase {
	base := testdb.MySQLDSN(t, func(dsn string) (string, error) {
		c, err := gomysql.ParseDSN(dsn)
		if err != nil {
			return "", err
		}
		return c.Addr, nil
	})
	admin, err := sql.Open("mysql", base)
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	name := testdb.Name()
	_, err = admin.Exec("CREATE DATABASE " + name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec("DROP DATABASE " + name) })
	cfg, err := gomysql.ParseDSN(base)
	require.NoError(t, err)
	cfg.DBName = name
	cfg.ParseTime = true
	dsn := cfg.FormatDSN()
	cfg.ParseTime = false
	return dialectCase{name: "mysql", dsn: "mysql://" + dsn, misconfigured: "mysql://" + cfg.FormatDSN(), problem: "add parseTime=true to the DSN", open: func(t *testing.T, c *idem.Config) (opsStore, func() map[idem.Status]int64) {
		db, err := sql.Open("mysql", dsn)
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		s, err := idem.New(idemmysql.New(db), c)
		require.NoError(t, err)
		return s, countSQL(t, func(q string) (map[idem.Status]int64, error) { return scanCounts(db.Query(q)) })
	}}
}

func postgresCase(t *testing.T) dialectCase {
	url := testdb.PostgresURL(t)
	pool, err := pgxpool.New(t.Context(), url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	schema := testdb.Name()
	_, err = pool.Exec(t.Context(), "CREATE SCHEMA "+schema)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	return dialectCase{name: "postgres", dsn: url, args: []string{"--schema", schema}, open: func(t *testing.T, c *idem.Config) (opsStore, func() map[idem.Status]int64) {
		s, err := idem.New(idempg.New(pool, idempg.WithSchema(schema)), c)
		require.NoError(t, err)
		return s, countSQL(t, func(q string) (map[idem.Status]int64, error) {
			rows, err := pool.Query(t.Context(), strings.Replace(q, "idempotency_keys", pgx.Identifier{schema, "idempotency_keys"}.Sanitize(), 1))
			if err != nil {
				return nil, err
			}
			defer rows.Close()
			m := map[idem.Status]int64{}
			for rows.Next() {
				var s int16
				var n int64
				if err := rows.Scan(&s, &n); err != nil {
					return nil, err
				}
				m[idem.Status(s)] = n
			}
			return m, rows.Err()
		})
	}}
}

type statsOut struct {
	Total, Processing, Succeeded, Failed int64
	LiveLeases                           int64 `json:"live_leases"`
	StaleLeases                          int64 `json:"stale_leases"`
	Expired                              int64
}

// On every dialect: migrate, check, stats matching the table, inspect by
// digest, release by token, purge, reap, migrate down and status.
func TestEveryDialect(t *testing.T) {
	t.Parallel()
	bin := buildIdem(t)
	for _, c := range []struct {
		name string
		mk   func(*testing.T) dialectCase
	}{{"sqlite", sqliteCase}, {"mysql", mysqlCase}, {"postgres", postgresCase}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dc := c.mk(t)
			with := func(args ...string) []string {
				return append(append(args, "--db", dc.dsn), dc.args...)
			}
			if dc.name != "sqlite" {
				r := idemRun(t, bin, with("check")...)
				requireCode(t, 4, r, "check before migrating")
				require.Contains(t, r.stderr, "does not exist")
			}
			requireCode(t, 0, idemRun(t, bin, with("migrate", "up")...), "migrate up")
			r := idemRun(t, bin, with("check", "--json")...)
			requireCode(t, 0, r, "check")
			require.JSONEq(t, `{"dialect":"`+dc.name+`","ready":true}`, r.stdout)
			if dc.misconfigured != "" {
				r = idemRun(t, bin, append([]string{"check", "--db", dc.misconfigured}, dc.args...)...)
				requireCode(t, 4, r, "check with a misconfigured DSN")
				require.Contains(t, r.stderr, dc.problem)
			}

			ctx := t.Context()
			store, counts := dc.open(t, &idem.Config{LeaseDuration: time.Hour})
			past, _ := dc.open(t, &idem.Config{LeaseDuration: time.Minute, Retention: time.Hour,
				Now: func() time.Time { return time.Now().Add(-3 * time.Hour) }})
			scope := idemhttp.ScopeFor("acme", "POST", "/orders")
			for i := range 3 {
				c, err := store.Claim(ctx, scope, fmt.Sprintf("ok-%d", i), idem.NewFingerprint([]byte("x")))
				require.NoError(t, err)
				require.NoError(t, store.Complete(ctx, c, &idem.Response{StatusCode: 201, Body: []byte("secret body")}))
			}
			c, err := store.Claim(ctx, scope, "declined", idem.NewFingerprint([]byte("x")))
			require.NoError(t, err)
			require.NoError(t, store.Fail(ctx, c, &idem.Response{StatusCode: 402}))
			stuck, err := store.Claim(ctx, scope, "stuck", idem.NewFingerprint([]byte("x")))
			require.NoError(t, err)
			for i := range 2 { // expired three hours ago by the database's clock
				c, err := past.Claim(ctx, scope, fmt.Sprintf("old-%d", i), idem.NewFingerprint([]byte("x")))
				require.NoError(t, err)
				require.NoError(t, past.Complete(ctx, c, &idem.Response{StatusCode: 201}))
			}
			// A processing record whose lease ran out, retained for now.
			staleStore, _ := dc.open(t, &idem.Config{LeaseDuration: time.Minute, Retention: 24 * time.Hour,
				Now: func() time.Time { return time.Now().Add(-time.Hour) }})
			_, err = staleStore.Claim(ctx, "other", "stale", idem.NewFingerprint([]byte("x")))
			require.NoError(t, err)

			r = idemRun(t, bin, with("stats", "--json")...)
			requireCode(t, 0, r, "stats")
			var st statsOut
			require.NoError(t, json.Unmarshal([]byte(r.stdout), &st))
			byStatus := counts()
			require.Equal(t, statsOut{
				Total:      byStatus[idem.StatusProcessing] + byStatus[idem.StatusSucceeded] + byStatus[idem.StatusFailed],
				Processing: byStatus[idem.StatusProcessing], Succeeded: byStatus[idem.StatusSucceeded], Failed: byStatus[idem.StatusFailed],
				LiveLeases: 1, StaleLeases: 1, Expired: 2,
			}, st)
			require.Equal(t, statsOut{Total: 8, Processing: 2, Succeeded: 5, Failed: 1, LiveLeases: 1, StaleLeases: 1, Expired: 2}, st)
			human := idemRun(t, bin, with("stats")...)
			requireCode(t, 0, human, "stats for people")
			require.Contains(t, human.stdout, "expired, awaiting the reaper")

			d := idem.KeyDigest(scope, "stuck")
			recs := inspectJSON(t, bin, with("--digest", d)...)
			require.Len(t, recs, 1)
			require.Equal(t, "stuck", recs[0].Key)
			require.Equal(t, stuck.Token, recs[0].Token)
			r = idemRun(t, bin, with("purge", "--digest", d, "--yes")...)
			requireCode(t, 6, r, "purge of a live lease without --force")
			require.NotContains(t, r.stderr, "stuck")
			requireCode(t, 6, idemRun(t, bin, with("release", "--digest", d, "--token", strconv.FormatInt(stuck.Token-1, 10))...), "stale token")
			requireCode(t, 0, idemRun(t, bin, with("release", "--digest", d, "--token", strconv.FormatInt(stuck.Token, 10))...), "release")
			requireCode(t, 5, idemRun(t, bin, with("inspect", "--digest", d)...), "released record is gone")
			again, err := store.Claim(ctx, scope, "stuck", idem.NewFingerprint([]byte("x")))
			require.NoError(t, err)
			require.True(t, again.Acquired(), "the next retry acquires")

			r = idemRun(t, bin, with("reap", "--once", "--json")...)
			requireCode(t, 0, r, "reap")
			require.Contains(t, r.stdout, `"deleted": 2`)

			r = idemRun(t, bin, with("purge", "--scope", "acme POST /orders", "--yes", "--json")...)
			requireCode(t, 0, r, "purge scope")
			require.Contains(t, r.stdout, `"deleted": 4`, "the live lease is kept")
			require.Equal(t, map[idem.Status]int64{idem.StatusProcessing: 2}, counts())

			requireCode(t, 0, idemRun(t, bin, with("migrate", "down")...), "migrate down")
			r = idemRun(t, bin, with("migrate", "status", "--json")...)
			requireCode(t, 0, r, "status")
			require.Contains(t, r.stdout, `"applied": false`)
			r = idemRun(t, bin, with("check")...)
			requireCode(t, 4, r, "check after down")
			require.Contains(t, r.stderr, fmt.Sprintf("schema version is %d", migrations.SchemaVersion-1))
		})
	}
}
