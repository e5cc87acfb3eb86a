package idemhttp_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
)

// TestObserve: one event per protected request, with the outcome the log
// names, the route pattern (never a raw path) and the key's digest.
func TestObserve(t *testing.T) {
	t.Parallel()
	store, err := idem.New(sqliteHarness{}.open(t).dialect, nil)
	require.NoError(t, err)
	var (
		mu     sync.Mutex
		events []idemhttp.RequestEvent
	)
	mw, err := idemhttp.New(store, &idemhttp.Config{Observe: func(_ context.Context, e idemhttp.RequestEvent) {
		mu.Lock()
		defer mu.Unlock()
		events = append(events, e)
	}})
	require.NoError(t, err)
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, ok := mw.Tx(r.Context()); !ok {
			t.Error("no transaction")
		}
		w.WriteHeader(http.StatusCreated)
	}))
	mux := http.NewServeMux()
	mux.Handle("POST /orders/{id}/items", h)
	send := func(handler http.Handler, path, key, body string) {
		r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		if key != "" {
			r.Header.Set("Idempotency-Key", key)
		}
		handler.ServeHTTP(httptest.NewRecorder(), r)
	}
	const key = "observe-key-0001"
	send(mux, "/orders/secret-42/items", key, `{"a":1}`)
	send(mux, "/orders/secret-42/items", key, `{"a":1}`)
	send(mux, "/orders/secret-42/items", key, `{"a":2}`)
	send(mux, "/orders/secret-42/items", "", `{"a":1}`)
	send(h, "/orders/secret-43/items", "observe-key-0002", `{"a":1}`) // no pattern

	require.Len(t, events, 5)
	type row struct {
		outcome, route string
		status         int
		digested       bool
	}
	var got []row
	for _, e := range events {
		require.Equal(t, http.MethodPost, e.Method)
		require.Equal(t, idemhttp.Transactional, e.Mode)
		require.NotContains(t, e.KeyDigest, "observe")
		got = append(got, row{e.Outcome, e.Route, e.Status, len(e.KeyDigest) == 16})
	}
	require.Equal(t, []row{
		{"completed", "/orders/{id}/items", 201, true},
		{"replayed", "/orders/{id}/items", 201, true},
		{"key_reused", "/orders/{id}/items", 409, true},
		{"key_missing", "/orders/{id}/items", 400, false},
		{"completed", "", 201, true},
	}, got)
	require.Equal(t, events[0].KeyDigest, events[1].KeyDigest)
}
