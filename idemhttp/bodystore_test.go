package idemhttp_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// patternReader yields n bytes of a pattern that holds every byte value
// without holding them: a generated export.
type patternReader struct{ off, n int64 }

func (p *patternReader) Read(b []byte) (int, error) {
	if p.off >= p.n {
		return 0, io.EOF
	}
	b = b[:min(int64(len(b)), p.n-p.off)]
	for i := range b {
		x := p.off + int64(i)
		b[i] = byte(x*7 + x/251)
	}
	p.off += int64(len(b))
	return len(b), nil
}

func patternSum(n int64) [32]byte {
	h := sha256.New()
	_, _ = io.Copy(h, &patternReader{n: n})
	var s [32]byte
	h.Sum(s[:0])
	return s
}

// heapPeak samples the live heap until stop is called, and returns the
// highest value seen (runtime/metrics, every millisecond) and the bytes
// allocated in between.
func heapPeak() (stop func() (peak, allocated uint64)) {
	samples := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}, {Name: "/gc/heap/allocs:bytes"}}
	runtime.GC()
	metrics.Read(samples)
	startAlloc := samples[1].Value.Uint64()
	var (
		mu   sync.Mutex
		peak uint64
		done = make(chan struct{})
		wg   sync.WaitGroup
	)
	wg.Go(func() {
		s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			metrics.Read(s)
			mu.Lock()
			peak = max(peak, s[0].Value.Uint64())
			mu.Unlock()
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	})
	return func() (uint64, uint64) {
		close(done)
		wg.Wait()
		metrics.Read(samples)
		return peak, samples[1].Value.Uint64() - startAlloc
	}
}

// TestLargeResponseStreamedToBodyStore: a 100 MiB response (over the
// store's inline limit) goes to a DirBodyStore while the handler writes,
// and is replayed with the same status, headers and bytes, in both modes,
// with the process's live heap far below the response's size. Not
// parallel: the heap is the whole process's.
func TestLargeResponseStreamedToBodyStore(t *testing.T) {
	const size = 100 << 20
	ctx := context.Background()
	dir := t.TempDir()
	db, err := idemsqlite.Open(filepath.Join(dir, "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemsqlite.Migrate(ctx, db))
	bs, err := idem.NewDirBodyStore(filepath.Join(dir, "bodies"))
	require.NoError(t, err)
	store, err := idem.New(idemsqlite.New(db), &idem.Config{BodyStore: bs, MaxResponseBytes: 200 << 20})
	require.NoError(t, err)
	want := patternSum(size)

	var calls int
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		w.Header().Set("Content-Type", "text/csv")
		w.Header().Set("Location", "/exports/1")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.Copy(w, &patternReader{n: size})
	})
	for _, mode := range []idemhttp.Mode{idemhttp.Transactional, idemhttp.Leased} {
		t.Run(mode.String(), func(t *testing.T) {
			calls = 0
			mw, err := idemhttp.New(store, &idemhttp.Config{Mode: mode, MaxResponseBytes: 200 << 20,
				Tenant: func(*http.Request) (string, error) { return "acme", nil }})
			require.NoError(t, err)
			srv := httptest.NewServer(mw.Wrap(handler))
			defer srv.Close()
			key := "export-" + mode.String()
			post := func() (*http.Response, [32]byte, int64) {
				req, err := http.NewRequest(http.MethodPost, srv.URL+"/exports", bytes.NewReader([]byte(`{}`)))
				require.NoError(t, err)
				req.Header.Set("Idempotency-Key", key)
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
			stop := heapPeak()
			first, sum1, n1 := post()
			second, sum2, n2 := post()
			peak, allocated := stop()
			t.Logf("%s: two requests of %d MiB: live heap peak %.1f MiB, allocated %.1f MiB", mode, size>>20, float64(peak)/(1<<20), float64(allocated)/(1<<20))

			require.Equal(t, 1, calls)
			require.Equal(t, http.StatusCreated, first.StatusCode)
			require.Equal(t, http.StatusCreated, second.StatusCode)
			require.Equal(t, "true", second.Header.Get("Idempotency-Replayed"))
			for _, h := range []string{"Content-Type", "Location"} {
				require.Equal(t, first.Header.Get(h), second.Header.Get(h), h)
			}
			require.Equal(t, int64(size), n1)
			require.Equal(t, int64(size), n2)
			require.Equal(t, want, sum1)
			require.Equal(t, want, sum2)
			require.Less(t, peak, uint64(size/4), "the response was held in memory")
		})
	}
}

// TestBodyStoreDownAnswers503: a body store that fails while the handler
// writes answers 503, commits nothing and leaves the key free; an object
// deleted by hand answers 500 idempotency_record_invalid on replay.
func TestBodyStoreDownAnswers503(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	db, err := idemsqlite.Open(filepath.Join(dir, "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemsqlite.Migrate(ctx, db))
	_, err = db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY)`)
	require.NoError(t, err)
	bodies := filepath.Join(dir, "bodies")
	bs, err := idem.NewDirBodyStore(bodies)
	require.NoError(t, err)
	store, err := idem.New(idemsqlite.New(db), &idem.Config{BodyStore: bs, InlineBodyMax: 1 << 10})
	require.NoError(t, err)
	mw, err := idemhttp.New(store, &idemhttp.Config{Tenant: func(*http.Request) (string, error) { return "acme", nil }})
	require.NoError(t, err)
	srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idemhttp.Tx[*sql.Tx](r.Context())
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO orders DEFAULT VALUES`); err != nil {
			http.Error(w, "no", 500)
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
	orders := func() int {
		var n int
		require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n))
		return n
	}

	require.NoError(t, os.RemoveAll(bodies))
	resp, body := post("export-key-0001")
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, string(body))
	require.Equal(t, 0, orders())
	require.NoError(t, os.MkdirAll(bodies, 0o700))
	resp, body = post("export-key-0001")
	require.Equal(t, http.StatusOK, resp.StatusCode, "the key was free")
	require.Len(t, body, 12000)
	require.Equal(t, 1, orders())

	entries, err := os.ReadDir(bodies)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.NoError(t, os.Remove(filepath.Join(bodies, entries[0].Name())))
	resp, body = post("export-key-0001")
	require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
	require.Contains(t, string(body), idemhttp.CodeRecordInvalid)
	require.Equal(t, 1, orders())
}
