package retryablehttp_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	"github.com/stretchr/testify/require"

	idemretryable "github.com/idemstore/idem/contrib/retryablehttp"
	"github.com/idemstore/idem/idemclient"
	"github.com/idemstore/idem/internal/ordersproc"
)

// server answers attempt i with answers[i] (the last one after that) and
// records the key and body of every attempt.
type server struct {
	srv     *httptest.Server
	mu      sync.Mutex
	keys    []string
	bodies  []string
	answers []func(http.ResponseWriter)
}

func newServer(t *testing.T, answers ...func(http.ResponseWriter)) *server {
	t.Helper()
	s := &server{answers: answers}
	s.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		n := len(s.keys)
		s.keys = append(s.keys, r.Header.Get("Idempotency-Key"))
		s.bodies = append(s.bodies, string(body))
		s.mu.Unlock()
		s.answers[min(n, len(s.answers)-1)](w)
	}))
	t.Cleanup(s.srv.Close)
	return s
}

func (s *server) attempts() ([]string, []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.keys...), append([]string(nil), s.bodies...)
}

func answer(status int, code string, header ...string) func(http.ResponseWriter) {
	return func(w http.ResponseWriter) {
		for i := 0; i+1 < len(header); i += 2 {
			w.Header().Set(header[i], header[i+1])
		}
		if code != "" {
			w.Header().Set("Content-Type", "application/json")
		}
		w.WriteHeader(status)
		if code != "" {
			_, _ = fmt.Fprintf(w, `{"code":%q,"message":"…","request_id":"req_1"}`, code)
		}
	}
}

func fastClient() *retryablehttp.Client {
	c := idemretryable.NewClient()
	c.RetryWaitMin = time.Millisecond
	c.RetryWaitMax = 20 * time.Millisecond
	return c
}

func do(t *testing.T, c *retryablehttp.Client, ctx context.Context, url, body string) (*http.Response, string, error) {
	t.Helper()
	req, err := retryablehttp.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	_, err = idemretryable.SetKey(req)
	require.NoError(t, err)
	resp, err := c.Do(req)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, string(b), nil
}

// TestPolicy: each class of answer is retried, with the same key and body,
// or returned after one attempt.
func TestPolicy(t *testing.T) {
	t.Parallel()
	created := answer(http.StatusCreated, "")
	for name, c := range map[string]struct {
		first func(http.ResponseWriter)
		retry bool
	}{
		"409 in progress":   {answer(http.StatusConflict, "idempotency_request_in_progress"), true},
		"503 store":         {answer(http.StatusServiceUnavailable, "idempotency_store_unavailable"), true},
		"502":               {answer(http.StatusBadGateway, ""), true},
		"504":               {answer(http.StatusGatewayTimeout, ""), true},
		"500":               {answer(http.StatusInternalServerError, ""), true},
		"425":               {answer(http.StatusTooEarly, ""), true},
		"429":               {answer(http.StatusTooManyRequests, ""), true},
		"400":               {answer(http.StatusBadRequest, "idempotency_key_invalid"), false},
		"409 key reused":    {answer(http.StatusConflict, "idempotency_key_reused"), false},
		"413":               {answer(http.StatusRequestEntityTooLarge, "idempotency_body_too_large"), false},
		"422":               {answer(http.StatusUnprocessableEntity, "validation_failed"), false},
		"500 too large":     {answer(http.StatusInternalServerError, "idempotency_response_too_large"), false},
		"501 not retryable": {answer(http.StatusNotImplemented, ""), false},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s := newServer(t, c.first, created)
			resp, body, err := do(t, fastClient(), t.Context(), s.srv.URL, `{"sku":"tea"}`)
			require.NoError(t, err)
			keys, bodies := s.attempts()
			if !c.retry {
				require.Len(t, keys, 1)
				require.NotEqual(t, http.StatusCreated, resp.StatusCode)
				if strings.Contains(body, "code") {
					require.Contains(t, body, `"request_id":"req_1"}`, "the body read to classify it is whole")
				}
				return
			}
			require.Equal(t, http.StatusCreated, resp.StatusCode)
			require.Len(t, keys, 2)
			require.NotEmpty(t, keys[0])
			require.Equal(t, keys[0], keys[1], "the same key")
			require.Equal(t, []string{`{"sku":"tea"}`, `{"sku":"tea"}`}, bodies, "the same body")
		})
	}
}

// TestRetryAfter: the library's default honours Retry-After on 429 and
// 503 only; Backoff honours it on the 409 in progress too, capped at
// RetryWaitMax.
func TestRetryAfter(t *testing.T) {
	t.Parallel()
	s := newServer(t, answer(http.StatusConflict, "idempotency_request_in_progress", "Retry-After", "1"), answer(http.StatusCreated, ""))
	c := fastClient()
	c.RetryWaitMax = 5 * time.Second
	start := time.Now()
	resp, _, err := do(t, c, t.Context(), s.srv.URL, `{}`)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.GreaterOrEqual(t, time.Since(start), time.Second)

	r := &http.Response{Header: http.Header{"Retry-After": {"3600"}}}
	require.LessOrEqual(t, idemretryable.Backoff(time.Millisecond, 2*time.Second, 0, r), 2*time.Second+200*time.Millisecond, "capped at RetryWaitMax")
	for n := range 10 {
		d := idemretryable.Backoff(100*time.Millisecond, time.Second, n, nil)
		require.GreaterOrEqual(t, d, 50*time.Millisecond)
		require.LessOrEqual(t, d, time.Second)
	}
}

// TestGivesUpWithTheLastResponse: once the retries are spent, the caller
// gets the last answer (PassthroughErrorHandler), not an error without it.
func TestGivesUpWithTheLastResponse(t *testing.T) {
	t.Parallel()
	s := newServer(t, answer(http.StatusConflict, "idempotency_request_in_progress"))
	c := fastClient()
	c.RetryMax = 2
	resp, body, err := do(t, c, t.Context(), s.srv.URL, `{}`)
	require.NoError(t, err)
	require.Equal(t, http.StatusConflict, resp.StatusCode)
	require.Contains(t, body, "idempotency_request_in_progress")
	keys, _ := s.attempts()
	require.Len(t, keys, 3)
}

// TestKeys: SetKey keeps the caller's key, takes idemclient.WithKey's, or
// makes one; RequireKey stops the retries of a POST that has none.
func TestKeys(t *testing.T) {
	t.Parallel()
	req, err := retryablehttp.NewRequestWithContext(t.Context(), http.MethodPost, "http://127.0.0.1/", nil)
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", "mine-0000000001")
	key, err := idemretryable.SetKey(req)
	require.NoError(t, err)
	require.Equal(t, "mine-0000000001", key)

	req, err = retryablehttp.NewRequestWithContext(idemclient.WithKey(t.Context(), "ctx-0000000001"), http.MethodPost, "http://127.0.0.1/", nil)
	require.NoError(t, err)
	key, err = idemretryable.SetKey(req)
	require.NoError(t, err)
	require.Equal(t, "ctx-0000000001", key)
	require.Equal(t, key, req.Header.Get("Idempotency-Key"))

	req, err = retryablehttp.NewRequestWithContext(t.Context(), http.MethodPost, "http://127.0.0.1/", nil)
	require.NoError(t, err)
	key, err = idemretryable.SetKey(req)
	require.NoError(t, err)
	require.Regexp(t, `^[A-Za-z0-9_-]{12,64}$`, key)
	again, err := idemretryable.SetKey(req)
	require.NoError(t, err)
	require.Equal(t, key, again, "once")

	s := newServer(t, answer(http.StatusBadGateway, ""))
	req, err = retryablehttp.NewRequestWithContext(t.Context(), http.MethodPost, s.srv.URL, strings.NewReader("x"))
	require.NoError(t, err)
	_, err = fastClient().Do(req) //nolint:bodyclose // PassthroughErrorHandler returns the 502, closed below
	require.ErrorIs(t, err, idemretryable.ErrNoKey)
	keys, _ := s.attempts()
	require.Equal(t, []string{""}, keys, "sent once, never retried")
}

// TestOrdersServerKilled: against the real examples/orders process, killed
// with SIGKILL once its commit is done (the answer lost) or in the middle
// of the handler, and restarted on the same port and SQLite file, a
// go-retryablehttp client with this package's policy ends with exactly one
// order and the answer the service stored.
func TestOrdersServerKilled(t *testing.T) {
	t.Parallel()
	bin := ordersproc.Build(t, "../..")
	for name, c := range map[string]struct {
		args     []string
		stage    string
		replayed bool
	}{
		"after the commit":        {args: []string{"-fault-injection"}, stage: "after-commit", replayed: true},
		"by a signal mid-request": {args: []string{"-handler-delay", "1500ms"}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := filepath.Join(t.TempDir(), "orders.db")
			srv := ordersproc.Start(t, bin, db, "127.0.0.1:0", c.args...)
			crash := &ordersproc.CrashFirst{Stage: c.stage}
			client := idemretryable.NewClient()
			client.HTTPClient = &http.Client{Transport: crash, Timeout: 10 * time.Second}
			client.RetryMax = 30
			client.RetryWaitMin = 50 * time.Millisecond
			client.RetryWaitMax = time.Second
			tenant := "retryablehttp-" + strings.ReplaceAll(name, " ", "-")

			type outcome struct {
				resp *http.Response
				body string
				err  error
			}
			done := make(chan outcome, 1)
			go func() {
				req, err := retryablehttp.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"sku":"tea","qty":2,"amount_cents":900}`))
				if err == nil {
					req.Header.Set("Authorization", "Bearer "+ordersproc.Token(tenant))
					_, err = idemretryable.SetKey(req)
				}
				if err != nil {
					done <- outcome{err: err}
					return
				}
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
				time.Sleep(500 * time.Millisecond) // the handler sleeps in its transaction
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
			keys := crash.Keys()
			require.GreaterOrEqual(t, len(keys), 2)
			for _, k := range keys {
				require.Equal(t, keys[0], k, "one key on every attempt")
			}
			orders := ordersproc.Orders(t, srv.URL, tenant)
			require.Len(t, orders, 1, "exactly one order")
			require.Equal(t, 1, ordersproc.Rows(t, db, "orders", tenant))
			require.JSONEq(t, string(orders[0]), out.body, "the answer is the order stored")
		})
	}
}
