package idemchi_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/contrib/idemchi"
	"github.com/idemstore/idem/idemhttp"
)

// scopes records the scope each route's handler ran in.
type scopes struct {
	mu   sync.Mutex
	seen map[string]string
	runs map[string]int
}

func (s *scopes) handler(name string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		scope, _ := idemhttp.Scope(r.Context())
		s.mu.Lock()
		if s.seen == nil {
			s.seen, s.runs = map[string]string{}, map[string]int{}
		}
		s.seen[name] = scope
		s.runs[name]++
		s.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"route":%q}`, name)
	}
}

// layouts builds the two common chi layouts around one middleware: r.Use on
// the router, and r.Use inside r.Route (a subrouter mounted at /v1/*).
var layouts = map[string]func(mw func(http.Handler) http.Handler, s *scopes) http.Handler{
	"router-level Use": func(mw func(http.Handler) http.Handler, s *scopes) http.Handler {
		r := chi.NewRouter()
		r.Use(mw)
		r.Post("/v1/a", s.handler("a"))
		r.Post("/v1/b", s.handler("b"))
		r.Post("/v1/orders/{id}/items", s.handler("items"))
		return r
	},
	"Route+Use": func(mw func(http.Handler) http.Handler, s *scopes) http.Handler {
		r := chi.NewRouter()
		r.Route("/v1", func(r chi.Router) {
			r.Use(mw)
			r.Post("/a", s.handler("a"))
			r.Post("/b", s.handler("b"))
			r.Post("/orders/{id}/items", s.handler("items"))
		})
		return r
	},
}

// TestSameKeyTwoRoutes is the scope collision of issue 14: under r.Route
// with r.Use the middleware saw chi's mount pattern /v1/* as the route, so
// the same key sent to /v1/a and then /v1/b answered 409
// idempotency_key_reused. Two routes are two operations: each gets its own
// record and its own answer, and each replays its own.
func TestSameKeyTwoRoutes(t *testing.T) {
	for _, op := range []struct {
		name string
		cfg  *idemhttp.Config
	}{{"default", nil}, {"idemchi.Operation", &idemhttp.Config{Operation: idemchi.Operation}}} {
		t.Run(op.name, func(t *testing.T) {
			for name, layout := range layouts {
				t.Run(name, func(t *testing.T) {
					mw, err := idemhttp.New(mustStore(t), op.cfg)
					require.NoError(t, err)
					srv := httptest.NewServer(layout(mw.Wrap, &scopes{}))
					defer srv.Close()
					const key = "same-key-two-routes-" + "0001"
					a := post(t, srv, "/v1/a", key, `{"n":1}`)
					require.Equal(t, http.StatusCreated, a.status, a.body)
					require.JSONEq(t, `{"route":"a"}`, a.body)
					b := post(t, srv, "/v1/b", key, `{"n":1}`)
					require.Equal(t, http.StatusCreated, b.status, "same key on another route: %s", b.body)
					require.JSONEq(t, `{"route":"b"}`, b.body)
					require.False(t, b.replayed)
					for path, want := range map[string]string{"/v1/a": `{"route":"a"}`, "/v1/b": `{"route":"b"}`} {
						again := post(t, srv, path, key, `{"n":1}`)
						require.Equal(t, http.StatusCreated, again.status)
						require.True(t, again.replayed, path)
						require.JSONEq(t, want, again.body)
					}
				})
			}
		})
	}
}

// TestScopes: by default a route is named by its path when chi's pattern
// is not known (router-level Use) or is the mount's catch-all (Route+Use);
// with idemchi.Operation it is the route's own pattern in both layouts, so
// the same key on two items of one order is a reused key.
func TestScopes(t *testing.T) {
	want := map[string]map[string]string{
		"default": {
			"/v1/a":              " POST /v1/a",
			"/v1/orders/1/items": " POST /v1/orders/1/items",
		},
		"idemchi.Operation": {
			"/v1/a":              " POST /v1/a",
			"/v1/orders/1/items": " POST /v1/orders/{id}/items",
		},
	}
	for _, op := range []struct {
		name string
		cfg  *idemhttp.Config
	}{{"default", nil}, {"idemchi.Operation", &idemhttp.Config{Operation: idemchi.Operation}}} {
		t.Run(op.name, func(t *testing.T) {
			for name, layout := range layouts {
				t.Run(name, func(t *testing.T) {
					mw, err := idemhttp.New(mustStore(t), op.cfg)
					require.NoError(t, err)
					s := &scopes{}
					srv := httptest.NewServer(layout(mw.Wrap, s))
					defer srv.Close()
					const key = "chi-scopes-key-"
					for path, scope := range want[op.name] {
						r := post(t, srv, path, key+strconv.Itoa(len(path)), `{}`)
						require.Equal(t, http.StatusCreated, r.status, r.body)
						s.mu.Lock()
						got := s.seen[map[string]string{"/v1/a": "a", "/v1/orders/1/items": "items"}[path]]
						s.mu.Unlock()
						require.Equal(t, scope, got, path)
					}
					k := key + "items"
					require.Equal(t, http.StatusCreated, post(t, srv, "/v1/orders/1/items", k, `{}`).status)
					second := post(t, srv, "/v1/orders/2/items", k, `{}`)
					if op.name == "default" {
						require.Equal(t, http.StatusCreated, second.status, "two paths, two records")
					} else {
						require.Equal(t, http.StatusConflict, second.status, "one route, one operation")
						require.Equal(t, idemhttp.CodeKeyReused, second.code)
					}
				})
			}
		})
	}
}

// TestOperationOutsideChi: idemchi.Operation on a plain ServeMux refuses
// with 500 and runs nothing.
func TestOperationOutsideChi(t *testing.T) {
	store, db := newStore(t)
	mw, err := idemhttp.New(store, &idemhttp.Config{Operation: idemchi.Operation})
	require.NoError(t, err)
	s := &scopes{}
	srv := httptest.NewServer(mw.Wrap(s.handler("a")))
	defer srv.Close()
	r := post(t, srv, "/v1/a", "outside-chi-key-0001", `{}`)
	require.Equal(t, http.StatusInternalServerError, r.status)
	require.Equal(t, idemhttp.CodeOperationFailed, r.code)
	require.Zero(t, records(t, db))
	require.Empty(t, s.runs)
}

// TestRequestID: with chi's middleware.RequestID first and
// idemchi.RequestID, the answer carries chi's ID (the incoming one, when
// the client sent one).
func TestRequestID(t *testing.T) {
	mw, err := idemhttp.New(mustStore(t), &idemhttp.Config{RequestID: idemchi.RequestID})
	require.NoError(t, err)
	var inChi string
	r := chi.NewRouter()
	r.Use(middleware.RequestID)
	r.Use(mw.Wrap)
	r.Post("/orders", func(w http.ResponseWriter, r *http.Request) {
		inChi = middleware.GetReqID(r.Context())
		require.Equal(t, inChi, idemhttp.RequestID(r.Context()))
		w.WriteHeader(http.StatusCreated)
	})
	srv := httptest.NewServer(r)
	defer srv.Close()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/orders", strings.NewReader(`{}`))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", "chi-request-id-0001")
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.NotEmpty(t, inChi)
	require.Equal(t, inChi, resp.Header.Get("X-Request-Id"))

	req, err = http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/orders", strings.NewReader(`{}`))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", "chi-request-id-0002")
	req.Header.Set("X-Request-Id", "from-the-gateway-7")
	resp, err = srv.Client().Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, "from-the-gateway-7", resp.Header.Get("X-Request-Id"))
}

// TestBadInput: through a chi router, what idemhttp refuses is answered
// with its code before the route's handler runs, and nothing is stored.
func TestBadInput(t *testing.T) {
	store, db := newStore(t)
	mw, err := idemhttp.New(store, &idemhttp.Config{Operation: idemchi.Operation, MaxBodyBytes: 1024})
	require.NoError(t, err)
	s := &scopes{}
	srv := httptest.NewServer(layouts["Route+Use"](mw.Wrap, s))
	defer srv.Close()
	for _, c := range []struct {
		name   string
		keys   []string
		body   string
		status int
		code   string
	}{
		{"no key", nil, `{}`, http.StatusBadRequest, idemhttp.CodeKeyMissing},
		{"invalid key", []string{"not a key"}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"two key lines", []string{"chi-key-line-0001", "chi-key-line-0002"}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"64 KiB key", []string{strings.Repeat("k", 64<<10)}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"not UTF-8", []string{"chi-key-\xff-0001"}, `{}`, http.StatusBadRequest, idemhttp.CodeKeyInvalid},
		{"body too large", []string{"chi-big-body-0001"}, `{"a":"` + strings.Repeat("x", 2048) + `"}`, http.StatusRequestEntityTooLarge, idemhttp.CodeBodyTooLarge},
		{"invalid JSON", []string{"chi-bad-json-0001"}, `{"a":`, http.StatusBadRequest, idemhttp.CodeBodyInvalid},
	} {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/v1/a", strings.NewReader(c.body))
		require.NoError(t, err)
		req.Header["Idempotency-Key"] = c.keys
		req.Header.Set("Content-Type", "application/json")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err, c.name)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, c.status, resp.StatusCode, c.name)
		require.Equal(t, c.code, codeOf(string(body)), c.name)
	}
	require.Empty(t, s.runs, "no handler ran")
	require.Zero(t, records(t, db))
}
