package idemclient_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/idemclient"
	"github.com/idemstore/idem/internal/ordersproc"
)

// outcome is what the client under test finally got.
type outcome struct {
	resp *http.Response
	body string
	err  error
}

// TestOrdersServerKilled runs the real examples/orders service as a process
// on an SQLite file, kills it with SIGKILL in the middle of a POST /orders,
// and restarts it on the same port and file while the client retries: the
// client ends with exactly one order and the answer the service gave it.
func TestOrdersServerKilled(t *testing.T) {
	t.Parallel()
	bin := ordersproc.Build(t, "..")
	for name, c := range map[string]struct {
		args     []string
		stage    string // X-Fault-Crash of the first attempt; "" kills from outside
		replayed bool   // the final answer is the stored original
	}{
		// The order and its stored 201 committed, the answer was lost
		// with the process: the retry gets the original, replayed.
		"after the commit": {args: []string{"-fault-injection"}, stage: "after-commit", replayed: true},
		// Killed inside the transaction: nothing committed, the retry
		// makes the order.
		"before the commit": {args: []string{"-fault-injection"}, stage: "after-claim"},
		// A SIGKILL from outside while the handler sleeps in its
		// transaction.
		"by a signal mid-request": {args: []string{"-handler-delay", "1500ms"}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := filepath.Join(t.TempDir(), "orders.db")
			srv := ordersproc.Start(t, bin, db, "127.0.0.1:0", c.args...)
			base := &ordersproc.CrashFirst{Stage: c.stage}
			tr, err := idemclient.New(&idemclient.Config{Base: base, MinBackoff: 50 * time.Millisecond, MaxBackoff: time.Second, MaxAttempts: 30})
			require.NoError(t, err)
			client := &http.Client{Transport: tr}
			tenant := "killed-" + strings.ReplaceAll(name, " ", "-")

			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
			defer cancel()
			done := make(chan outcome, 1)
			go func() {
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"sku":"tea","qty":2,"amount_cents":900}`))
				if err != nil {
					done <- outcome{err: err}
					return
				}
				req.Header.Set("Authorization", "Bearer "+ordersproc.Token(tenant))
				resp, err := client.Do(req)
				if err != nil {
					done <- outcome{err: err}
					return
				}
				defer resp.Body.Close()
				body, err := io.ReadAll(resp.Body)
				done <- outcome{resp: resp, body: string(body), err: err}
			}()

			if c.stage == "" {
				time.Sleep(500 * time.Millisecond) // the handler is sleeping in its transaction
				srv.Kill(t)
			}
			select {
			case <-srv.Exited():
			case <-time.After(time.Minute):
				t.Fatal("the service was not killed")
			}
			require.True(t, srv.Killed(), "the service died of SIGKILL")
			srv = ordersproc.Start(t, bin, db, srv.Addr, c.args...)

			out := <-done
			require.NoError(t, out.err)
			require.Equal(t, http.StatusCreated, out.resp.StatusCode, out.body)
			require.Equal(t, c.replayed, out.resp.Header.Get("Idempotency-Replayed") == "true")
			keys := base.Keys()
			require.GreaterOrEqual(t, len(keys), 2, "the first attempt died with the service")
			for _, k := range keys {
				require.Equal(t, keys[0], k, "one key on every attempt")
			}

			orders := ordersproc.Orders(t, srv.URL, tenant)
			require.Len(t, orders, 1, "exactly one order")
			require.Equal(t, 1, ordersproc.Rows(t, db, "orders", tenant), "one row in the database file")
			require.JSONEq(t, string(orders[0]), out.body, "the answer is the order that was stored")
			var o struct {
				ID int64 `json:"id"`
			}
			require.NoError(t, json.Unmarshal(orders[0], &o))
			require.NotZero(t, o.ID)
		})
	}
}

// recorder is a RoundTripper under the client under test that records the
// status (or 0 for an error) of every attempt.
type recorder struct {
	mu       sync.Mutex
	statuses []int
}

func (r *recorder) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(req)
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil {
		r.statuses = append(r.statuses, 0)
	} else {
		r.statuses = append(r.statuses, resp.StatusCode)
	}
	return resp, err
}

func (r *recorder) seen() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]int(nil), r.statuses...)
}

// TestOrdersSlowServer: against the real service, an attempt that times out
// is retried with the same key and gets the original's answer once it is
// stored, never a second effect. POST /payments runs in the leased mode: the
// retry meets 409 in progress, whose Retry-After (1s, not the 30s lease)
// the client honours.
func TestOrdersSlowServer(t *testing.T) {
	t.Parallel()
	bin := ordersproc.Build(t, "..")
	for name, c := range map[string]struct {
		args   []string
		path   string
		body   string
		table  string
		status int // an answer the client must have retried, besides the timeout
	}{
		"orders, transactional": {args: []string{"-handler-delay", "1500ms"}, path: "/orders", body: `{"sku":"tea","qty":1,"amount_cents":100}`, table: "orders"},
		"payments, leased":      {args: []string{"-provider-delay", "2s"}, path: "/payments", body: `{"amount_cents":4200}`, table: "payments", status: http.StatusConflict},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := filepath.Join(t.TempDir(), "orders.db")
			srv := ordersproc.Start(t, bin, db, "127.0.0.1:0", c.args...)
			rec := &recorder{}
			tr, err := idemclient.New(&idemclient.Config{Base: rec, AttemptTimeout: 500 * time.Millisecond, MinBackoff: 50 * time.Millisecond})
			require.NoError(t, err)
			tenant := "slow-" + c.table
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+c.path, strings.NewReader(c.body))
			require.NoError(t, err)
			req.Header.Set("Authorization", "Bearer "+ordersproc.Token(tenant))
			start := time.Now()
			resp, err := (&http.Client{Transport: tr}).Do(req)
			require.NoError(t, err)
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			require.NoError(t, err)
			elapsed := time.Since(start)
			t.Logf("attempts %v in %s", rec.seen(), elapsed.Round(time.Millisecond))

			require.Equal(t, http.StatusCreated, resp.StatusCode, string(body))
			require.Equal(t, "true", resp.Header.Get("Idempotency-Replayed"), "the answer of the first attempt, stored")
			require.Equal(t, 0, rec.seen()[0], "the first attempt timed out")
			if c.status != 0 {
				require.Contains(t, rec.seen(), c.status)
			}
			require.Less(t, elapsed, 6*time.Second, "Retry-After was short enough to follow the original closely")
			require.Equal(t, 1, ordersproc.Rows(t, db, c.table, tenant), "one effect")
		})
	}
}
