package idemhttp_test

import (
	"errors"
	"net/http"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/idemhttp"
)

// TestOperations runs the cases of issue 14's operation naming, request IDs,
// replay header and unwritten responses on every dialect.
func TestOperations(t *testing.T) {
	t.Parallel()
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		runOperationCases(t, harness[*sqlTx](sqliteHarness{}))
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		runOperationCases(t, harness[pgxTx](newPGHarness(t)))
	})
	t.Run("mariadb", func(t *testing.T) {
		t.Parallel()
		runOperationCases(t, harness[*sqlTx](newMySQLHarness(t)))
	})
}

func runOperationCases[TTx any](t *testing.T, h harness[TTx]) {
	t.Helper()
	for _, c := range []testCase[TTx]{
		{"CatchAllPatternIsNotAnOperation", testCatchAllPattern[TTx]},
		{"OperationHook", testOperationHook[TTx]},
		{"OperationHookRefuses", testOperationHookRefuses[TTx]},
		{"UnwrittenResponseNotStored", testUnwrittenResponse[TTx]},
		{"UnwrittenResponseLeased", testUnwrittenResponseLeased[TTx]},
		{"RequestIDHook", testRequestIDHook[TTx]},
		{"ReplayedHeaderName", testReplayedHeaderName[TTx]},
		{"KeyInvalidStatesFormat", testKeyInvalidStatesFormat[TTx]},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t, h)
		})
	}
}

// scoped wraps createOrder behind mw and records the scope it ran in.
func scoped[TTx any](b *bundle[TTx], mw *idemhttp.Middleware[TTx], seen *atomic.Value) http.Handler {
	return mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.calls.Add(1)
		scope, _ := idemhttp.Scope(r.Context())
		seen.Store(scope)
		tx, ok := mw.Tx(r.Context()) // typed by the middleware: no type argument to get wrong
		createOrder(b, w, r, tx, ok)
	}))
}

// testCatchAllPattern: a pattern that matches many routes (a ServeMux
// subtree, a {name...} wildcard, the root) is not an operation name, so two
// routes under it never share a scope: the same key on /v1/a and /v1/b makes
// two records (it was one scope, "POST /v1/", and the second got 409). An
// exact pattern still names the operation.
func testCatchAllPattern[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	var seen atomic.Value
	mw := mustNew(t, b.store, &idemhttp.Config{Tenant: testTenant})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/", scoped(b, mw, &seen))
	mux.Handle("POST /files/{path...}", scoped(b, mw, &seen))
	mux.Handle("POST /orders/{id}/items", scoped(b, mw, &seen))
	mux.Handle("POST /", scoped(b, mw, &seen))

	for _, pair := range [][2]string{{"/v1/a", "/v1/b"}, {"/files/x/y", "/files/z"}, {"/a", "/b"}} {
		key := newKey()
		for _, p := range pair {
			r := b.direct(t, mux, key, `{"amount":5}`, path(p))
			require.Equal(t, http.StatusCreated, r.status, "%s: %s", p, r.body)
			require.False(t, r.replayed(), p)
			require.Equal(t, "t1 POST "+p, seen.Load(), "the scope of %s is its path", p)
		}
		again := b.direct(t, mux, key, `{"amount":5}`, path(pair[0]))
		require.True(t, again.replayed())
	}
	require.Equal(t, 6, b.orders(t))
	require.Equal(t, 6, b.records(t))

	// An exact pattern is the operation: two items of one order are one
	// operation, so the same key there is a reused key.
	key := newKey()
	r := b.direct(t, mux, key, `{"amount":5}`, path("/orders/1/items"))
	require.Equal(t, http.StatusCreated, r.status)
	require.Equal(t, "t1 POST /orders/{id}/items", seen.Load())
	r = b.direct(t, mux, key, `{"amount":5}`, path("/orders/2/items"))
	require.Equal(t, http.StatusConflict, r.status)
	require.Equal(t, idemhttp.CodeKeyReused, r.code(t))
}

// testOperationHook: Config.Operation names the scope; the name is in the
// fingerprint in place of the method and route.
func testOperationHook[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	var seen atomic.Value
	mw := mustNew(t, b.store, &idemhttp.Config{Tenant: testTenant, Operation: func(r *http.Request) (string, error) {
		return "orders.create " + strings.TrimPrefix(r.URL.Path, "/v1/"), nil
	}})
	mux := http.NewServeMux()
	mux.Handle("/", scoped(b, mw, &seen))
	key := newKey()
	r := b.direct(t, mux, key, `{"amount":5}`, path("/v1/a"))
	require.Equal(t, http.StatusCreated, r.status)
	require.Equal(t, "t1 orders.create a", seen.Load())
	r = b.direct(t, mux, key, `{"amount":5}`, path("/v1/b"))
	require.Equal(t, http.StatusCreated, r.status)
	require.Equal(t, "t1 orders.create b", seen.Load())
	r = b.direct(t, mux, key, `{"amount":5}`, path("/v1/a"))
	require.True(t, r.replayed())
	require.Equal(t, 2, b.orders(t))
}

// testOperationHookRefuses: an error of Config.Operation is the server's
// fault: 500 with CodeOperationFailed (an *Error as it is), the handler not
// run, nothing stored.
func testOperationHookRefuses[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	var seen atomic.Value
	for _, c := range []struct {
		name   string
		op     func(*http.Request) (string, error)
		status int
		code   string
	}{
		{"error", func(*http.Request) (string, error) { return "", errors.New("no route") }, http.StatusInternalServerError, idemhttp.CodeOperationFailed},
		{"empty", func(*http.Request) (string, error) { return "", nil }, http.StatusInternalServerError, idemhttp.CodeOperationFailed},
		{"*Error", func(*http.Request) (string, error) {
			return "", &idemhttp.Error{Status: http.StatusNotFound, Code: "no_such_route", Message: "No such route."}
		}, http.StatusNotFound, "no_such_route"},
	} {
		mw := mustNew(t, b.store, &idemhttp.Config{Tenant: testTenant, Operation: c.op})
		r := b.direct(t, scoped(b, mw, &seen), newKey(), `{"amount":5}`)
		require.Equal(t, c.status, r.status, c.name)
		require.Equal(t, c.code, r.code(t), c.name)
	}
	require.Zero(t, b.calls.Load())
	require.Zero(t, b.records(t))
}

// testUnwrittenResponse: a handler that returns without writing anything is
// taken as one that never ran (a router adapter that did not call it): its
// transaction rolls back, nothing is stored, the client gets 500 with
// CodeNoResponse and the key stays free.
func testUnwrittenResponse[TTx any](t *testing.T, h harness[TTx]) {
	var silent atomic.Bool
	silent.Store(true)
	b := setup(t, h, options[TTx]{handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
		if silent.Load() {
			_, _ = b.insert(r, tx, 1) // work done, but no answer written
			return
		}
		createOrder(b, w, r, tx, ok)
	}})
	key := newKey()
	r := b.post(t, key, `{"amount":1}`)
	require.Equal(t, http.StatusInternalServerError, r.status)
	require.Equal(t, idemhttp.CodeNoResponse, r.code(t))
	require.Zero(t, b.orders(t), "the silent attempt's writes were rolled back")
	require.Zero(t, b.records(t))

	silent.Store(false)
	r = b.post(t, key, `{"amount":1}`)
	require.Equal(t, http.StatusCreated, r.status, "the key stayed free")
	require.Equal(t, 1, b.orders(t))

	// An explicit empty 200 is an answer, stored and replayed.
	empty := b.with(idemhttp.Config{}, func(_ *bundle[TTx], w http.ResponseWriter, _ *http.Request, _ TTx, _ bool) {
		w.WriteHeader(http.StatusOK)
	})
	key = newKey()
	require.Equal(t, http.StatusOK, b.direct(t, empty, key, `{}`).status)
	require.True(t, b.direct(t, empty, key, `{}`).replayed())
}

// testUnwrittenResponseLeased: in the leased mode a handler that wrote
// nothing may still have made its outside call, so nothing is stored and
// the key is not given up either: duplicates get 409 in progress until the
// lease runs out and the status check decides.
func testUnwrittenResponseLeased[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{cfg: &idemhttp.Config{Mode: idemhttp.Leased},
		handler: func(*bundle[TTx], http.ResponseWriter, *http.Request, TTx, bool) {}})
	key := newKey()
	r := b.post(t, key, `{"amount":1}`)
	require.Equal(t, http.StatusInternalServerError, r.status)
	require.Equal(t, idemhttp.CodeNoResponse, r.code(t))
	r = b.post(t, key, `{"amount":1}`)
	require.Equal(t, http.StatusConflict, r.status)
	require.Equal(t, idemhttp.CodeInProgress, r.code(t))
	require.Equal(t, int64(1), b.calls.Load())
}

// testRequestIDHook: Config.RequestID supplies the ID (here from another
// header, as a request-ID middleware's context value would); an ID that is
// not well formed is replaced by a generated one.
func testRequestIDHook[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	var inHandler atomic.Value
	mw := mustNew(t, b.store, &idemhttp.Config{Tenant: testTenant,
		RequestID: func(r *http.Request) string { return r.Header.Get("X-Correlation-Id") }})
	hd := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		inHandler.Store(idemhttp.RequestID(r.Context()))
		w.WriteHeader(http.StatusCreated)
	}))
	r := b.direct(t, hd, newKey(), `{}`, header("X-Correlation-Id", "corr-42"), header("X-Request-Id", "ignored"))
	require.Equal(t, http.StatusCreated, r.status)
	require.Equal(t, "corr-42", r.header.Get("X-Request-Id"))
	require.Equal(t, "corr-42", inHandler.Load())
	for _, bad := range []string{"", "two words", strings.Repeat("x", 129), "\u00e9"} {
		r = b.direct(t, hd, newKey(), `{}`, header("X-Correlation-Id", bad))
		require.Regexp(t, `^req_[a-z0-9]{26}$`, r.header.Get("X-Request-Id"), "%q", bad)
	}
	r = b.direct(t, hd, "bad key", `{}`, header("X-Correlation-Id", "corr-43"))
	_, _, id := r.errorBody(t)
	require.Equal(t, "corr-43", id, "error bodies carry it too")
}

// testReplayedHeaderName: Config.ReplayedHeader renames the replay marker.
func testReplayedHeaderName[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	stripe := b.with(idemhttp.Config{ReplayedHeader: "Idempotent-Replayed", ReplayHeaders: []string{"Idempotent-Replayed"}}, nil)
	key := newKey()
	r := b.direct(t, stripe, key, `{"amount":1}`)
	require.Equal(t, http.StatusCreated, r.status)
	require.Empty(t, r.header.Get("Idempotent-Replayed"))
	r = b.direct(t, stripe, key, `{"amount":1}`)
	require.Equal(t, "true", r.header.Get("Idempotent-Replayed"))
	require.Empty(t, r.header.Get("Idempotency-Replayed"))
}

// testKeyInvalidStatesFormat: the 400 says what a valid key looks like and
// never echoes the key.
func testKeyInvalidStatesFormat[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	r := b.post(t, "short-secret", `{"amount":1}`) // 12 characters: the shortest key accepted
	require.Equal(t, http.StatusCreated, r.status)
	for _, key := range []string{"tiny-secret", "has space in it secret", strings.Repeat("s", 65)} {
		r = b.post(t, key, `{}`)
		require.Equal(t, http.StatusBadRequest, r.status, key)
		code, msg, _ := r.errorBody(t)
		require.Equal(t, idemhttp.CodeKeyInvalid, code)
		require.Contains(t, msg, "12 to 64 letters, digits, '-' or '_'")
		require.NotContains(t, string(r.body), "secret")
		require.NotContains(t, string(r.body), "sss")
	}
	hex := b.with(idemhttp.Config{KeyFormat: regexp.MustCompile(`^[0-9a-f]{8}$`)}, nil)
	r = b.direct(t, hex, "secret-key-0001", `{}`)
	_, msg, _ := r.errorBody(t)
	require.Contains(t, msg, "matching ^[0-9a-f]{8}$")
	require.NotContains(t, string(r.body), "secret")
}
