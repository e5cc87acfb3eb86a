package idemecho_test

import (
	"database/sql"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/labstack/echo/v4"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/contrib/idemecho"
	"github.com/idemstore/idem/idemhttp"
)

type app struct {
	db     *sql.DB
	srv    *httptest.Server
	runs   atomic.Int32
	status atomic.Int32 // the status an echo middleware outside idem's saw
	scope  atomic.Value
}

// newApp serves an echo app: a middleware outside idem's that records the
// status, idemecho.Middleware, and routes that make an order, refuse with a
// returned error, or ask for a transaction retry on their first run.
func newApp(t *testing.T, cfg *idemhttp.Config) *app {
	t.Helper()
	store, db := newStore(t)
	_, err := db.Exec(`CREATE TABLE orders (n INTEGER NOT NULL)`)
	require.NoError(t, err)
	mw, err := idemhttp.New(store, cfg)
	require.NoError(t, err)
	a := &app{db: db}
	e := echo.New()
	e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			err := next(c)
			a.status.Store(int32(c.Response().Status))
			return err
		}
	})
	g := e.Group("/v1", idemecho.Middleware(mw.Wrap))
	order := func(c echo.Context) error {
		n := a.runs.Add(1)
		scope, _ := idemhttp.Scope(c.Request().Context())
		a.scope.Store(scope)
		tx, ok := mw.Tx(c.Request().Context())
		if !ok {
			return echo.NewHTTPError(http.StatusTeapot, "no tx")
		}
		if _, err := tx.ExecContext(c.Request().Context(), `INSERT INTO orders (n) VALUES (?)`, n); err != nil {
			return err
		}
		var in struct {
			Amount int `json:"amount"`
		}
		if err := c.Bind(&in); err != nil {
			return err
		}
		if in.Amount <= 0 {
			return echo.NewHTTPError(http.StatusUnprocessableEntity, "amount must be positive")
		}
		if c.QueryParam("retry") != "" && n == 1 && idemhttp.RetryTransaction(c.Request().Context()) {
			return nil
		}
		return c.JSON(http.StatusCreated, map[string]any{"order": n, "amount": in.Amount})
	}
	g.POST("/orders", order)
	g.POST("/orders/:id/items", order)
	g.POST("/files/*", order)
	g.GET("/orders", func(c echo.Context) error { return echo.NewHTTPError(http.StatusNotFound, "none") })
	a.srv = httptest.NewServer(e)
	t.Cleanup(a.srv.Close)
	return a
}

// TestReturnedErrorPassesThrough: an echo handler's returned error is
// rendered inside the transaction: the client gets the handler's 422, its
// writes roll back, nothing is stored, and the key is free.
func TestReturnedErrorPassesThrough(t *testing.T) {
	a := newApp(t, nil)
	const key = "echo-error-key-0001"
	r := post(t, a.srv, "/v1/orders", key, `{"amount":0}`)
	require.Equal(t, http.StatusUnprocessableEntity, r.status, r.body)
	require.JSONEq(t, `{"message":"amount must be positive"}`, r.body)
	require.Equal(t, int32(http.StatusUnprocessableEntity), a.status.Load(), "the outer middleware sees what was sent")
	require.Zero(t, records(t, a.db))
	require.Zero(t, orders(t, a.db))
	r = post(t, a.srv, "/v1/orders", key, `{"amount":0}`)
	require.Equal(t, http.StatusUnprocessableEntity, r.status, "not stored: the handler ran again")
	require.Equal(t, int32(2), a.runs.Load())
}

// TestReplay: a success is stored and replayed; the handler runs once.
func TestReplay(t *testing.T) {
	a := newApp(t, nil)
	const key = "echo-replay-key-0001"
	first := post(t, a.srv, "/v1/orders", key, `{"amount":5}`)
	require.Equal(t, http.StatusCreated, first.status, first.body)
	again := post(t, a.srv, "/v1/orders", key, `{ "amount": 5 }`)
	require.True(t, again.replayed)
	require.Equal(t, first.body, again.body)
	require.Equal(t, int32(http.StatusCreated), a.status.Load())
	require.Equal(t, int32(1), a.runs.Load())
	require.Equal(t, 1, orders(t, a.db))
}

// TestTransactionRetryRunsAgain: echo can call a handler twice, so a
// transaction retry runs it again with a fresh request and response; only
// the second run's order commits.
func TestTransactionRetryRunsAgain(t *testing.T) {
	a := newApp(t, nil)
	r := post(t, a.srv, "/v1/orders?retry=1", "echo-retry-key-0001", `{"amount":5}`)
	require.Equal(t, http.StatusCreated, r.status, r.body)
	require.JSONEq(t, `{"order":2,"amount":5}`, r.body)
	require.Equal(t, int32(2), a.runs.Load())
	require.Equal(t, 1, orders(t, a.db))
}

// TestOperation: with idemecho.Operation the scope is echo's route, so the
// same key on two items of one order is a reused key; a catch-all route's
// scope is the path.
func TestOperation(t *testing.T) {
	a := newApp(t, &idemhttp.Config{Operation: idemecho.Operation})
	const key = "echo-scope-key-0001"
	for _, c := range []struct{ path, scope string }{
		{"/v1/orders", " POST /v1/orders"},
		{"/v1/orders/1/items", " POST /v1/orders/:id/items"},
		{"/v1/files/a/b", " POST /v1/files/a/b"},
		{"/v1/files/c", " POST /v1/files/c"},
	} {
		r := post(t, a.srv, c.path, key, `{"amount":1}`)
		require.Equal(t, http.StatusCreated, r.status, "%s: %s", c.path, r.body)
		require.Equal(t, c.scope, a.scope.Load())
	}
	r := post(t, a.srv, "/v1/orders/2/items", key, `{"amount":1}`)
	require.Equal(t, http.StatusConflict, r.status)
	require.Equal(t, idemhttp.CodeKeyReused, r.code)
}

// TestPlainWrapMiddleware: with echo.WrapMiddleware alone, a handler that
// returns its error writes nothing inside idemhttp; idemhttp refuses to
// store that (it used to commit an empty 200 as the key's answer, with the
// handler's writes) and answers 500 idempotency_handler_no_response.
func TestPlainWrapMiddleware(t *testing.T) {
	store, db := newStore(t)
	_, err := db.Exec(`CREATE TABLE orders (n INTEGER NOT NULL)`)
	require.NoError(t, err)
	mw, err := idemhttp.New(store, nil)
	require.NoError(t, err)
	e := echo.New()
	e.Use(echo.WrapMiddleware(mw.Wrap))
	e.POST("/orders", func(c echo.Context) error {
		tx, _ := mw.Tx(c.Request().Context())
		if _, err := tx.ExecContext(c.Request().Context(), `INSERT INTO orders (n) VALUES (1)`); err != nil {
			return err
		}
		return echo.NewHTTPError(http.StatusUnprocessableEntity, "refused after a write")
	})
	srv := httptest.NewServer(e)
	defer srv.Close()
	r := post(t, srv, "/orders", "echo-plain-key-0001", `{}`)
	require.NotEqual(t, http.StatusOK, r.status, "an empty 200 for a refused request")
	require.Equal(t, http.StatusInternalServerError, r.status)
	require.Equal(t, idemhttp.CodeNoResponse, r.code)
	require.Zero(t, records(t, db))
	require.Zero(t, orders(t, db))
}

// TestPassThrough: a GET is not protected; echo renders its error as usual.
func TestPassThrough(t *testing.T) {
	a := newApp(t, nil)
	resp, err := a.srv.Client().Get(a.srv.URL + "/v1/orders")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusNotFound, resp.StatusCode)
	require.JSONEq(t, `{"message":"none"}`, string(body))
}

// TestBadInput: what idemhttp refuses is answered with its code before the
// echo handler runs, and nothing is stored.
func TestBadInput(t *testing.T) {
	a := newApp(t, &idemhttp.Config{MaxBodyBytes: 1024})
	for _, c := range []struct {
		name   string
		keys   []string
		body   string
		status int
		code   string
	}{
		{"no key", nil, `{}`, http.StatusBadRequest, idemhttp.CodeKeyMissing},
		{"invalid key", []string{"not a key"}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"two key lines", []string{"echo-key-line-0001", "echo-key-line-0002"}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"64 KiB key", []string{strings.Repeat("k", 64<<10)}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"not UTF-8", []string{"echo-key-\xff-0001"}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"body too large", []string{"echo-big-body-0001"}, `{"a":"` + strings.Repeat("x", 2048) + `"}`, http.StatusRequestEntityTooLarge, idemhttp.CodeBodyTooLarge},
		{"invalid JSON", []string{"echo-bad-json-0001"}, `{"a":`, http.StatusBadRequest, idemhttp.CodeBodyInvalid},
	} {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, a.srv.URL+"/v1/orders", strings.NewReader(c.body))
		require.NoError(t, err)
		req.Header["Idempotency-Key"] = c.keys
		req.Header.Set("Content-Type", "application/json")
		resp, err := a.srv.Client().Do(req)
		require.NoError(t, err, c.name)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, c.status, resp.StatusCode, c.name)
		require.Equal(t, c.code, codeOf(string(body)), c.name)
	}
	require.Zero(t, a.runs.Load())
	require.Zero(t, records(t, a.db))
}
