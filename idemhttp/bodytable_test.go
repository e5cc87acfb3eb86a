package idemhttp_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/metrics"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
)

// largeSize is the response of TestLargeResponseEveryDialectBothStores.
const largeSize = 50 << 20

// TestLargeResponseEveryDialectBothStores: a 50 MiB response, written by a
// handler that also inserts an order in its transaction, is stored by
// reference and replayed byte for byte with its status and headers, on
// every dialect, in a DirBodyStore and in the dialect's table store (where
// it is spooled to a temporary file while the handler writes and then
// written in the handler's transaction, with the order and the record),
// with the process's live heap far below the response's size. The leased
// mode's handler begins its transaction with Tx, so its body goes into it
// too. Not parallel: the heap is the whole process's.
func TestLargeResponseEveryDialectBothStores(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) { testLargeEveryStore(t, harness[*sqlTx](sqliteHarness{})) })
	t.Run("postgres", func(t *testing.T) { testLargeEveryStore(t, harness[pgxTx](newPGHarness(t))) })
	t.Run("mariadb", func(t *testing.T) { testLargeEveryStore(t, harness[*sqlTx](newMySQLHarness(t))) })
}

func testLargeEveryStore[TTx any](t *testing.T, h harness[TTx]) {
	for _, c := range []struct {
		store string
		mode  idemhttp.Mode
	}{{"dir", idemhttp.Transactional}, {"table", idemhttp.Transactional}, {"table", idemhttp.Leased}} {
		t.Run(c.store+"/"+c.mode.String(), func(t *testing.T) {
			ns := h.open(t)
			var bs idem.BodyStore
			if c.store == "dir" {
				d, err := idem.NewDirBodyStore(t.TempDir())
				require.NoError(t, err)
				bs = d
			} else {
				bs = ns.bodyTable(nil)
			}
			testLargeResponse(t, ns, bs, c.mode)
		})
	}
}

func testLargeResponse[TTx any](t *testing.T, ns *namespace[TTx], bs idem.BodyStore, mode idemhttp.Mode) {
	store, err := idem.New(ns.dialect, &idem.Config{BodyStore: bs, MaxResponseBytes: 64 << 20})
	require.NoError(t, err)
	mw, err := idemhttp.New(store, &idemhttp.Config{Mode: mode, MaxResponseBytes: 64 << 20,
		Tenant: func(*http.Request) (string, error) { return "acme", nil }})
	require.NoError(t, err)
	var calls int
	srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		tx, ok := idemhttp.Tx[TTx](r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		if _, err := ns.insertOrder(r.Context(), tx, "acme", "export", 1); err != nil {
			http.Error(w, "insert failed", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "text/csv")
		w.Header().Set("Location", "/exports/1")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.Copy(w, &patternReader{n: largeSize})
	})))
	defer srv.Close()
	post := func() (*http.Response, [32]byte, int64) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/exports", bytes.NewReader([]byte(`{}`)))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", "export-large-1")
		req.Header.Set("Content-Type", "application/json")
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		h := sha256.New()
		n, err := io.Copy(h, resp.Body)
		require.NoError(t, err)
		var s [32]byte
		h.Sum(s[:0])
		return resp, s, n
	}
	want := patternSum(largeSize)

	start := time.Now()
	stop := heapPeaks()
	first, sum1, n1 := post()
	stored := time.Since(start)
	second, sum2, n2 := post()
	peak, live, allocated := stop()
	t.Logf("%d MiB: stored in %s, replayed in %s; heap objects peak %.1f MiB, live heap (after GC) peak %.1f MiB, allocated %.1f MiB",
		largeSize>>20, stored.Round(time.Millisecond), (time.Since(start) - stored).Round(time.Millisecond),
		float64(peak)/(1<<20), float64(live)/(1<<20), float64(allocated)/(1<<20))

	require.Equal(t, 1, calls)
	require.Equal(t, http.StatusCreated, first.StatusCode)
	require.Equal(t, http.StatusCreated, second.StatusCode)
	require.Equal(t, "true", second.Header.Get("Idempotency-Replayed"))
	for _, h := range []string{"Content-Type", "Location"} {
		require.Equal(t, first.Header.Get(h), second.Header.Get(h), h)
	}
	require.Equal(t, int64(largeSize), n1)
	require.Equal(t, int64(largeSize), n2)
	require.Equal(t, want, sum1)
	require.Equal(t, want, sum2)
	orders, err := ns.countOrders(t.Context())
	require.NoError(t, err)
	require.Equal(t, 1, orders)
	// What the process held: the live heap each GC found. A body held in
	// memory would be 50 MiB of it. The heap's peak also counts garbage not
	// yet collected (the drivers allocate each row they read), so it is
	// only bounded loosely.
	require.Less(t, live, uint64(largeSize/8), "the response was held in memory")
	require.Less(t, peak, uint64(largeSize/3), "the heap grew with the response")
}

// heapPeaks samples, every millisecond until stop, the heap's objects
// (live and not yet collected garbage) and the live heap as of the last
// GC (/gc/heap/live:bytes), and returns the peak of each and the bytes
// allocated in between.
func heapPeaks() (stop func() (peak, live, allocated uint64)) {
	names := []string{"/memory/classes/heap/objects:bytes", "/gc/heap/live:bytes", "/gc/heap/allocs:bytes"}
	read := func() []uint64 {
		s := make([]metrics.Sample, len(names))
		for i, n := range names {
			s[i].Name = n
		}
		metrics.Read(s)
		out := make([]uint64, len(s))
		for i := range s {
			out[i] = s[i].Value.Uint64()
		}
		return out
	}
	runtime.GC()
	startAlloc := read()[2]
	var (
		mu         sync.Mutex
		peak, live uint64
		done       = make(chan struct{})
		wg         sync.WaitGroup
	)
	wg.Go(func() {
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			v := read()
			mu.Lock()
			peak, live = max(peak, v[0]), max(live, v[1])
			mu.Unlock()
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	})
	return func() (uint64, uint64, uint64) {
		close(done)
		wg.Wait()
		return peak, live, read()[2] - startAlloc
	}
}

// TestTableBodyStoreFaults: with the dialect's table body store, on every
// dialect and in both modes, a body store that is down (its table
// dropped) answers 503, commits nothing (no order, no record) and leaves
// the key free; a record whose object's rows were deleted by hand answers
// 500 idempotency_record_invalid on replay and runs nothing again.
func TestTableBodyStoreFaults(t *testing.T) {
	t.Parallel()
	t.Run("sqlite", func(t *testing.T) { t.Parallel(); testTableBodyFaults(t, harness[*sqlTx](sqliteHarness{})) })
	t.Run("postgres", func(t *testing.T) { t.Parallel(); testTableBodyFaults(t, harness[pgxTx](newPGHarness(t))) })
	t.Run("mariadb", func(t *testing.T) { t.Parallel(); testTableBodyFaults(t, harness[*sqlTx](newMySQLHarness(t))) })
}

func testTableBodyFaults[TTx any](t *testing.T, h harness[TTx]) {
	for _, mode := range []idemhttp.Mode{idemhttp.Transactional, idemhttp.Leased} {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := t.Context()
			ns := h.open(t)
			bs := ns.bodyTable(nil)
			store, err := idem.New(ns.dialect, &idem.Config{BodyStore: bs, InlineBodyMax: 1 << 10})
			require.NoError(t, err)
			mw, err := idemhttp.New(store, &idemhttp.Config{Mode: mode, Tenant: func(*http.Request) (string, error) { return "acme", nil }})
			require.NoError(t, err)
			var calls int
			srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls++
				tx, _ := idemhttp.Tx[TTx](r.Context())
				if _, err := ns.insertOrder(r.Context(), tx, "acme", "k", 1); err != nil {
					http.Error(w, "no", http.StatusInternalServerError)
					return
				}
				_, _ = w.Write(bytes.Repeat([]byte("row,1\n"), 2000))
			})))
			defer srv.Close()
			post := func(key string) (*http.Response, []byte) {
				req, err := http.NewRequest(http.MethodPost, srv.URL+"/x", bytes.NewReader([]byte(`{}`)))
				require.NoError(t, err)
				req.Header.Set("Idempotency-Key", key)
				req.Header.Set("Content-Type", "application/json")
				resp, err := srv.Client().Do(req)
				require.NoError(t, err)
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				return resp, b
			}
			count := func(f func(context.Context) (int, error)) int {
				n, err := f(ctx)
				require.NoError(t, err)
				return n
			}

			resp, body := post("export-key-0001")
			require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
			require.Len(t, body, 12000)
			var addrs []string
			require.NoError(t, bs.List(ctx, time.Now().Add(time.Hour), func(a string) error { addrs = append(addrs, a); return nil }))
			require.Len(t, addrs, 1)
			require.NoError(t, bs.Delete(ctx, addrs[0])) // by hand
			resp, body = post("export-key-0001")
			require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
			require.Contains(t, string(body), idemhttp.CodeRecordInvalid)
			require.Equal(t, 1, calls)

			require.NoError(t, ns.dropBodies(ctx))
			resp, body = post("export-key-0002")
			require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, string(body))
			require.Contains(t, string(body), idemhttp.CodeStoreUnavailable)
			require.Equal(t, 1, count(ns.countOrders), "the order rolled back with the record")
			require.Equal(t, 1, count(ns.countRecords), "nothing committed for the refused key")
		})
	}
}
