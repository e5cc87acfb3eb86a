package idemgin_test

import (
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/gin-gonic/gin"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemgin"
	"github.com/idemstore/idem/idemhttp"
)

type app struct {
	db     *sql.DB
	srv    *httptest.Server
	mw     *idemgin.Middleware[*sql.Tx]
	before atomic.Int32 // runs of the gin middleware before idem's
	after  atomic.Int32 // runs of the gin middleware after idem's
	runs   atomic.Int32 // runs of the order handler
	status atomic.Int32 // the status the middleware before idem saw last
	scope  atomic.Value // the scope the order handler ran in
}

// newApp serves a gin engine: a middleware that sets the tenant, idem's,
// another middleware, then the routes.
func newApp(t *testing.T, cfg *idemhttp.Config, retry bool) *app {
	t.Helper()
	gin.SetMode(gin.TestMode)
	store, db := newStore(t)
	_, err := db.Exec(`CREATE TABLE orders (n INTEGER NOT NULL)`)
	require.NoError(t, err)
	if cfg == nil {
		cfg = &idemhttp.Config{}
	}
	cfg.Tenant = func(r *http.Request) (string, error) {
		c, _ := idemgin.GinContext(r)
		return c.GetString("tenant"), nil
	}
	a := &app{db: db}
	a.mw, err = idemgin.New(store, cfg)
	require.NoError(t, err)

	engine := gin.New()
	engine.Use(func(c *gin.Context) {
		a.before.Add(1)
		c.Set("tenant", c.GetHeader("X-Tenant"))
		c.Next()
		a.status.Store(int32(c.Writer.Status()))
	})
	v1 := engine.Group("/v1", a.mw.Handler(), func(c *gin.Context) { a.after.Add(1); c.Next() })
	order := func(c *gin.Context) {
		n := a.runs.Add(1)
		scope, _ := idemhttp.Scope(c.Request.Context())
		a.scope.Store(scope)
		tx, ok := a.mw.Tx(c)
		if !ok {
			c.String(http.StatusTeapot, "no tx")
			return
		}
		if _, err := tx.ExecContext(c.Request.Context(), `INSERT INTO orders (n) VALUES (?)`, n); err != nil {
			c.String(http.StatusInternalServerError, "insert failed")
			return
		}
		if retry && n == 1 && idemhttp.RetryTransaction(c.Request.Context()) {
			return
		}
		var in struct{ Amount int }
		if err := c.ShouldBindJSON(&in); err != nil {
			c.String(http.StatusBadRequest, "bad body")
			return
		}
		c.Header("Location", fmt.Sprintf("/v1/orders/%d", n))
		c.JSON(http.StatusCreated, gin.H{"order": n, "amount": in.Amount, "route": c.FullPath()})
	}
	v1.POST("/a", order)
	v1.POST("/b", order)
	v1.POST("/orders/:id/items", order)
	v1.POST("/files/*path", order)
	v1.GET("/orders", func(c *gin.Context) {
		_, ok := a.mw.Tx(c)
		c.String(http.StatusOK, "list tx=%t", ok)
	})
	a.srv = httptest.NewServer(engine)
	t.Cleanup(a.srv.Close)
	return a
}

func (a *app) orders(t *testing.T) int { return orders(t, a.db) }

// TestTransactionRetry is the gin hazard of issue 14 through the adapter: a
// transaction retry does not run the chain again behind gin's back. The
// attempt is rolled back, nothing is stored, the client gets 503 with
// Retry-After, and its retry with the same key runs the handler once.
func TestTransactionRetry(t *testing.T) {
	a := newApp(t, nil, true)
	const key = "gin-retry-key-0001"
	first := post(t, a.srv, "/v1/a", key, `{"amount":7}`)
	require.Equal(t, http.StatusServiceUnavailable, first.status, first.body)
	require.Equal(t, idemhttp.CodeStoreUnavailable, first.code)
	require.Equal(t, int32(1), a.runs.Load(), "the handler ran once")
	require.Equal(t, 0, records(t, a.db), "nothing stored that the handler did not write")
	require.Equal(t, 0, a.orders(t), "the attempt was rolled back")
	require.Equal(t, int32(http.StatusServiceUnavailable), a.status.Load(), "gin's middleware before idem sees the answer")

	retry := post(t, a.srv, "/v1/a", key, `{"amount":7}`)
	require.Equal(t, http.StatusCreated, retry.status, retry.body)
	require.JSONEq(t, `{"order":2,"amount":7,"route":"/v1/a"}`, retry.body)
	again := post(t, a.srv, "/v1/a", key, `{"amount":7}`)
	require.True(t, again.replayed)
	require.Equal(t, retry.body, again.body)
	require.Equal(t, 1, a.orders(t))
	require.Equal(t, int32(2), a.runs.Load())
}

// TestReplayStopsTheChain: the first request runs every handler; a replay
// is answered by idemhttp and no handler after idem's runs.
func TestReplayStopsTheChain(t *testing.T) {
	a := newApp(t, nil, false)
	const key = "gin-replay-key-0001"
	first := post(t, a.srv, "/v1/a", key, `{"amount":3}`)
	require.Equal(t, http.StatusCreated, first.status, first.body)
	require.False(t, first.replayed)
	require.Equal(t, int32(1), a.after.Load())
	require.Equal(t, int32(http.StatusCreated), a.status.Load())
	for range 2 {
		again := post(t, a.srv, "/v1/a", key, `{ "amount": 3 }`)
		require.Equal(t, http.StatusCreated, again.status)
		require.True(t, again.replayed)
		require.Equal(t, first.body, again.body)
	}
	require.Equal(t, int32(1), a.after.Load(), "no handler after idem's ran for the replays")
	require.Equal(t, int32(1), a.runs.Load())
	require.Equal(t, int32(3), a.before.Load())
	require.Equal(t, 1, a.orders(t))

	mismatch := post(t, a.srv, "/v1/a", key, `{"amount":4}`)
	require.Equal(t, http.StatusConflict, mismatch.status)
	require.Equal(t, idemhttp.CodeKeyReused, mismatch.code)
	require.Equal(t, int32(1), a.runs.Load())
}

// TestOperationFromFullPath: the operation is gin's route pattern, so two
// routes never share a scope, and a catch-all route's scope is the path.
func TestOperationFromFullPath(t *testing.T) {
	a := newApp(t, nil, false)
	const key = "gin-routes-key-0001"
	for _, c := range []struct{ path, scope string }{
		{"/v1/a", "acme POST /v1/a"},
		{"/v1/b", "acme POST /v1/b"},
		{"/v1/orders/1/items", "acme POST /v1/orders/:id/items"},
		{"/v1/files/x/y", "acme POST /v1/files/x/y"},
		{"/v1/files/z", "acme POST /v1/files/z"},
	} {
		r := postAs(t, a.srv, c.path, key, `{"amount":1}`, "acme")
		require.Equal(t, http.StatusCreated, r.status, "%s: %s", c.path, r.body)
		require.False(t, r.replayed, c.path)
		require.Equal(t, c.scope, a.scope.Load())
	}
	require.Equal(t, 5, a.orders(t))
	// Same pattern, other item: the same key is a reused key.
	r := postAs(t, a.srv, "/v1/orders/2/items", key, `{"amount":1}`, "acme")
	require.Equal(t, http.StatusConflict, r.status)
	// Another tenant: another record.
	r = postAs(t, a.srv, "/v1/a", key, `{"amount":1}`, "globex")
	require.Equal(t, http.StatusCreated, r.status)
	require.False(t, r.replayed)
}

// TestPassThrough: a GET passes through with gin's own writer and no
// transaction; a POST without a key the configuration lets through too.
func TestPassThrough(t *testing.T) {
	a := newApp(t, &idemhttp.Config{KeyOptional: func(r *http.Request) bool { return r.Header.Get("X-Optional") != "" }}, false)
	resp, err := a.srv.Client().Get(a.srv.URL + "/v1/orders")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, int32(1), a.after.Load())
	require.Equal(t, 0, records(t, a.db))
}

// TestBadInput: what idemhttp refuses is answered before any handler after
// idem's runs (the chain is aborted, so the business handler never runs
// unprotected), with idemhttp's code, and nothing is stored.
func TestBadInput(t *testing.T) {
	a := newApp(t, &idemhttp.Config{MaxBodyBytes: 1024}, false)
	cases := []struct {
		name   string
		header http.Header
		body   string
		status int
		code   string
	}{
		{"no key", http.Header{}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyMissing},
		{"invalid key", http.Header{"Idempotency-Key": {"no spaces allowed here"}}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"two key lines", http.Header{"Idempotency-Key": {"gin-key-line-0001", "gin-key-line-0002"}}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"64 KiB key", http.Header{"Idempotency-Key": {strings.Repeat("k", 64<<10)}}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"not UTF-8", http.Header{"Idempotency-Key": {"gin-key-\xff-0001"}}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"body too large", http.Header{"Idempotency-Key": {"gin-big-body-0001"}}, `{"a":"` + strings.Repeat("x", 2048) + `"}`, http.StatusRequestEntityTooLarge, idemhttp.CodeBodyTooLarge},
		{"invalid JSON", http.Header{"Idempotency-Key": {"gin-bad-json-0001"}}, `{"a":`, http.StatusBadRequest, idemhttp.CodeBodyInvalid},
	}
	for _, c := range cases {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, a.srv.URL+"/v1/a", strings.NewReader(c.body))
		require.NoError(t, err)
		req.Header = c.header
		req.Header.Set("Content-Type", "application/json")
		resp, err := a.srv.Client().Do(req)
		require.NoError(t, err, c.name)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, c.status, resp.StatusCode, c.name)
		require.Equal(t, c.code, codeOf(string(body)), c.name)
	}
	require.Zero(t, a.after.Load(), "no handler after idem's ran")
	require.Zero(t, a.runs.Load())
	require.Zero(t, records(t, a.db))
	require.Equal(t, int32(len(cases)), a.before.Load())
}

// TestLeased: the leased mode through gin, with the typed lease.
func TestLeased(t *testing.T) {
	gin.SetMode(gin.TestMode)
	store, db := newStore(t)
	mw, err := idemgin.New(store, &idemhttp.Config{Mode: idemhttp.Leased})
	require.NoError(t, err)
	var calls atomic.Int32
	engine := gin.New()
	engine.POST("/pay", mw.Handler(), func(c *gin.Context) {
		calls.Add(1)
		lease, ok := mw.Lease(c)
		require.True(t, ok)
		c.JSON(http.StatusCreated, gin.H{"attempt": lease.Attempt()})
	})
	srv := httptest.NewServer(engine)
	defer srv.Close()
	for i := range 2 {
		r := post(t, srv, "/pay", "gin-leased-key-0001", `{}`)
		require.Equal(t, http.StatusCreated, r.status, r.body)
		require.Equal(t, i == 1, r.replayed)
		require.JSONEq(t, `{"attempt":1}`, r.body)
	}
	require.Equal(t, int32(1), calls.Load())
	require.Equal(t, 1, records(t, db))
}

func TestNewRefusesBadConfig(t *testing.T) {
	store, _ := newStore(t)
	_, err := idemgin.New(store, &idemhttp.Config{MaxBodyBytes: -1})
	require.ErrorContains(t, err, "MaxBodyBytes")
	_, err = idemgin.New[*sql.Tx](nil, nil)
	require.Error(t, err)
	var _ *idem.Store[*sql.Tx] = store
}
