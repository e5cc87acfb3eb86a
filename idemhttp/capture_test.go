package idemhttp_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/idemhttp"
)

// TestLargeFailureStreams: a 4xx or 5xx that is not final is never stored,
// so the middleware holds at most MaxResponseBytes of it: past that it
// streams the rest to the client while the handler still writes, rolls the
// handler's writes back (releases the lease) when it returns, and refuses
// MarkFinal and RetryTransaction from then on. Before, such a response was
// buffered whole, however large: a handler dumping a huge error page could
// make the middleware hold all of it.
func TestLargeFailureStreams(t *testing.T) {
	t.Parallel()
	for _, mode := range []idemhttp.Mode{idemhttp.Transactional, idemhttp.Leased} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			t.Run("sqlite", func(t *testing.T) {
				t.Parallel()
				testLargeFailureStreams(t, harness[*sqlTx](sqliteHarness{}), mode)
			})
			t.Run("postgres", func(t *testing.T) {
				t.Parallel()
				testLargeFailureStreams(t, harness[pgxTx](newPGHarness(t)), mode)
			})
			t.Run("mariadb", func(t *testing.T) {
				t.Parallel()
				testLargeFailureStreams(t, harness[*sqlTx](newMySQLHarness(t)), mode)
			})
		})
	}
}

func testLargeFailureStreams[TTx any](t *testing.T, h harness[TTx], mode idemhttp.Mode) {
	const limit = 4 << 10
	release := make(chan struct{})
	var markFinal, retry atomic.Value
	b := setup(t, h, options[TTx]{
		cfg: &idemhttp.Config{Mode: mode, MaxResponseBytes: limit},
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			var in struct {
				Amount int64  `json:"amount"`
				Then   string `json:"then"`
			}
			if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
				http.Error(w, "bad body", http.StatusBadRequest)
				return
			}
			if mode == idemhttp.Leased {
				tx, ok = idemhttp.Tx[TTx](r.Context())
			}
			if !ok {
				http.Error(w, "no transaction", http.StatusInternalServerError)
				return
			}
			if _, err := b.insert(r, tx, in.Amount); err != nil {
				http.Error(w, "insert failed", http.StatusInternalServerError)
				return
			}
			if in.Then != "dump" {
				w.WriteHeader(http.StatusCreated)
				return
			}
			w.Header().Set("Content-Type", "text/plain")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, err := io.WriteString(w, strings.Repeat("e", limit+1))
			assert.NoError(t, err) // on the server's goroutine: require would not stop the test
			select {
			case <-release: // the client has the status while the handler still runs
			case <-time.After(10 * time.Second):
			}
			markFinal.Store(idemhttp.MarkFinal(r.Context()))
			retry.Store(idemhttp.RetryTransaction(r.Context()))
			_, err = io.WriteString(w, strings.Repeat("f", 3*limit))
			assert.NoError(t, err)
		},
	})
	key := newKey()
	got := make(chan *http.Response, 1)
	req := b.newRequest(t, key, `{"amount":5,"then":"dump"}`)
	go func() {
		resp, err := b.srv.Client().Do(req)
		if err != nil {
			close(got)
			return
		}
		got <- resp
	}()
	var resp *http.Response
	select {
	case resp = <-got:
	case <-time.After(5 * time.Second):
		close(release)
		t.Fatal("the status of a large failure did not reach the client while the handler ran: it was buffered")
	}
	close(release)
	require.NotNil(t, resp, "the request failed")
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.Equal(t, "text/plain", resp.Header.Get("Content-Type"))
	require.NotEmpty(t, resp.Header.Get("X-Request-Id"))
	require.Equal(t, strings.Repeat("e", limit+1)+strings.Repeat("f", 3*limit), string(body), "streamed whole, in order")
	require.Equal(t, false, markFinal.Load(), "MarkFinal cannot store a response already on its way")
	require.Equal(t, false, retry.Load(), "RetryTransaction cannot rerun a response already on its way")

	require.Zero(t, b.orders(t), "the handler's writes were rolled back")
	require.Zero(t, b.records(t), "nothing stored; in the leased mode, the lease was released")
	r := b.post(t, key, `{"amount":5}`)
	require.Equal(t, http.StatusCreated, r.status, "the key is free: %s", r.body)
	require.False(t, r.replayed())
	require.Equal(t, 1, b.orders(t))
	require.Equal(t, int64(2), b.calls.Load())
}
