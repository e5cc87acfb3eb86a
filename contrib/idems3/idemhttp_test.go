package idems3_test

import (
	"bytes"
	"crypto/sha256"
	"database/sql"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idems3"
	"github.com/idemstore/idem/idemhttp"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// patternReader yields n bytes of a pattern holding every byte value,
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

// heapPeak samples the live heap every millisecond until stop, which
// returns the heap after a GC at the start, the peak, and the bytes
// allocated in between.
func heapPeak() (stop func() (base, peak, allocated uint64)) {
	samples := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}, {Name: "/gc/heap/allocs:bytes"}}
	runtime.GC()
	metrics.Read(samples)
	base, startAlloc := samples[0].Value.Uint64(), samples[1].Value.Uint64()
	var (
		mu   sync.Mutex
		peak = base
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
	return func() (uint64, uint64, uint64) {
		close(done)
		wg.Wait()
		metrics.Read(samples)
		return base, peak, samples[1].Value.Uint64() - startAlloc
	}
}

// httpStack is idemhttp over SQLite with the S3 store of fx, and a
// business table orders.
type httpStack struct {
	db    *sql.DB
	store *idem.Store[*sql.Tx]
}

func newHTTPStack(t *testing.T, bs idem.BodyStore, cfg idem.Config) *httpStack {
	t.Helper()
	ctx := t.Context()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemsqlite.Migrate(ctx, db))
	_, err = db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY)`)
	require.NoError(t, err)
	cfg.BodyStore = bs
	store, err := idem.New(idemsqlite.New(db), &cfg)
	require.NoError(t, err)
	return &httpStack{db: db, store: store}
}

func (s *httpStack) serve(t *testing.T, mode idemhttp.Mode, maxBytes int, h http.Handler) *httptest.Server {
	t.Helper()
	mw, err := idemhttp.New(s.store, &idemhttp.Config{Mode: mode, MaxResponseBytes: maxBytes,
		Tenant: func(*http.Request) (string, error) { return "acme", nil }})
	require.NoError(t, err)
	srv := httptest.NewServer(mw.Wrap(h))
	t.Cleanup(srv.Close)
	return srv
}

func (s *httpStack) orders(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, s.db.QueryRowContext(t.Context(), `SELECT count(*) FROM orders`).Scan(&n))
	return n
}

// post sends a POST with key and returns the response, its body's SHA-256
// and length (the body read as a stream, never held).
func post(t *testing.T, srv *httptest.Server, key string) (*http.Response, [32]byte, int64) {
	t.Helper()
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
	return resp, [32]byte(h.Sum(nil)), n
}

// TestHTTPLargeResponse: a 50 MiB response goes to S3 while the handler
// writes (a multipart upload), and is replayed with the same status,
// headers and bytes, in both modes, with the process's live heap far below
// the response's size. Not parallel: the heap is the whole process's.
func TestHTTPLargeResponse(t *testing.T) {
	const size = 50 << 20
	srv := s3Server(t)
	st := newStore(t, srv, newPrefix())
	stack := newHTTPStack(t, st, idem.Config{MaxResponseBytes: 64 << 20})
	h := sha256.New()
	_, _ = io.Copy(h, &patternReader{n: size})
	want := [32]byte(h.Sum(nil))

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
			hs := stack.serve(t, mode, 64<<20, handler)
			key := "export-" + mode.String()
			stop := heapPeak()
			first, sum1, n1 := post(t, hs, key)
			second, sum2, n2 := post(t, hs, key)
			base, peak, allocated := stop()
			t.Logf("%s: a %d MiB response stored in S3 and replayed: live heap %.1f MiB before, peak %.1f MiB; allocated %.1f MiB",
				mode, size>>20, float64(base)/(1<<20), float64(peak)/(1<<20), float64(allocated)/(1<<20))

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
			// One multipart part (Config.PartSize) is held by design.
			require.Less(t, peak, base+size/8+idems3.MinPartSize, "the response was held in memory")
		})
	}
}

// TestHTTPServerDownAndObjectDeleted: with the S3 server unreachable (its
// port closed) a large response answers 503, commits nothing and leaves
// the key free; once it is back the retry runs; the object then deleted by
// hand replays 500 idempotency_record_invalid without running the handler.
func TestHTTPServerDownAndObjectDeleted(t *testing.T) {
	t.Parallel()
	srv := s3Server(t)
	ctx := t.Context()
	fx := s3Stores{srv}.Open(ctx, t)
	stack := newHTTPStack(t, fx.Store, idem.Config{InlineBodyMax: 1 << 10})
	hs := stack.serve(t, idemhttp.Transactional, 0, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idemhttp.Tx[*sql.Tx](r.Context())
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO orders DEFAULT VALUES`); err != nil {
			http.Error(w, "no", 500)
			return
		}
		_, _ = w.Write(bytes.Repeat([]byte("row,1\n"), 2000))
	}))

	fx.Break(t)
	resp, body := postRead(t, hs, "export-key-0001")
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, body)
	require.Equal(t, 0, stack.orders(t), "nothing committed")
	fx.Mend(t)
	resp, body = postRead(t, hs, "export-key-0001")
	require.Equal(t, http.StatusOK, resp.StatusCode, "the key was free")
	require.Len(t, body, 12000)
	require.Equal(t, 1, stack.orders(t))

	addrs := listAll(t, fx.Store)
	require.Len(t, addrs, 1)
	fx.Remove(ctx, t, addrs[0])
	resp, body = postRead(t, hs, "export-key-0001")
	require.Equal(t, http.StatusInternalServerError, resp.StatusCode)
	require.Contains(t, body, idemhttp.CodeRecordInvalid)
	require.Equal(t, 1, stack.orders(t), "the handler did not run again")
}

func postRead(t *testing.T, srv *httptest.Server, key string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/exports", bytes.NewReader([]byte(`{}`)))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, string(b)
}

func listAll(t *testing.T, st idem.BodyStore) []string {
	t.Helper()
	return list(t, st, time.Now().Add(time.Minute))
}
