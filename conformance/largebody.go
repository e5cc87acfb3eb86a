package conformance

import (
	"context"
	"crypto/sha256"
	"io"
	"runtime"
	"runtime/metrics"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// LargeBodySize is the response size of [RunLargeBody].
const LargeBodySize = 50 << 20

// RunLargeBody stores a 50 MiB response by reference, streamed from a Do
// callback with Store.PutBodyTx, in each built-in body store (a
// DirBodyStore, then the dialect's table store, Namespace.BodyTable, where
// it is written inside Do's transaction), replays it and checks it byte for
// byte (by SHA-256), and fails t if the process's live heap (as each GC
// found it) rose by more than an eighth of the response meanwhile. Call it
// from a test that is not parallel (and before any parallel one resumes):
// the heap measured is the whole process's.
func RunLargeBody[TTx any](t *testing.T, h Harness[TTx]) {
	t.Helper()
	t.Run("Dir", func(t *testing.T) { RunLargeBodyStore(t, h, dirBodyStores{}) })
	t.Run("Table", func(t *testing.T) {
		ns := h.Open(t.Context(), t)
		runLargeBody(t, ns, ns.BodyTable(nil), 0)
	})
}

// RunLargeBodyStore is [RunLargeBody] with a body store of bh, whose
// fixture's PutBuffer the heap may rise by on top.
func RunLargeBodyStore[TTx any](t *testing.T, h Harness[TTx], bh BodyStoreHarness) {
	t.Helper()
	ns := h.Open(t.Context(), t)
	fx := bh.Open(t.Context(), t)
	runLargeBody(t, ns, fx.Store, fx.PutBuffer)
}

// runLargeBody is RunLargeBody on one body store, bs, which may hold
// putBuffer bytes in memory while it writes.
func runLargeBody[TTx any](t *testing.T, ns *Namespace[TTx], bs idem.BodyStore, putBuffer int64) {
	store, err := idem.New(ns.Dialect, &idem.Config{BodyStore: bs, MaxResponseBytes: 64 << 20, Logger: scannedLogger(t)})
	require.NoError(t, err)
	want := sha256.New()
	_, err = io.Copy(want, &pattern{n: LargeBodySize})
	require.NoError(t, err)
	ctx := t.Context()
	key := newKey("large")

	start := time.Now()
	stop := sampleHeap()
	var calls counter
	fn := func(ctx context.Context, tx TTx) (*idem.Response, error) {
		calls.inc()
		ref, err := store.PutBodyTx(ctx, tx, idem.DoClaim(ctx), &pattern{n: LargeBodySize})
		if err != nil {
			return nil, err
		}
		return &idem.Response{StatusCode: 200, BodyRef: ref}, nil
	}
	_, err = store.Do(ctx, "t1/export", key, fp("x"), fn)
	require.NoError(t, err)
	stored := time.Since(start)
	res, err := store.Do(ctx, "t1/export", key, fp("x"), fn)
	require.NoError(t, err)
	require.True(t, res.Replayed)
	rc, err := store.OpenBody(ctx, res.Response)
	require.NoError(t, err)
	got := sha256.New()
	n, err := io.Copy(got, rc)
	require.NoError(t, err)
	require.NoError(t, rc.Close())
	base, peak, live := stop()

	require.Equal(t, 1, calls.get())
	require.Equal(t, int64(LargeBodySize), n)
	require.Equal(t, want.Sum(nil), got.Sum(nil))
	t.Logf("a %d MiB response stored in %s, replayed (read twice: checked, then streamed) in %s: live heap %.1f MiB before, peak %.1f MiB after a GC, heap objects peak %.1f MiB",
		LargeBodySize>>20, stored.Round(time.Millisecond), (time.Since(start) - stored).Round(time.Millisecond),
		float64(base)/(1<<20), float64(live)/(1<<20), float64(peak)/(1<<20))
	// What the process held: the live heap each GC found; a body held in
	// memory would be 50 MiB of it. The heap objects' peak also counts
	// garbage not yet collected (a driver allocates each row it reads), so
	// it is bounded loosely.
	require.Less(t, live, base+LargeBodySize/8+uint64(putBuffer), "the body was held in memory")
	require.Less(t, peak, base+LargeBodySize/3+uint64(putBuffer), "the heap grew with the body")
}

// pattern yields n bytes holding every byte value, without holding them.
type pattern struct{ off, n int64 }

func (p *pattern) Read(b []byte) (int, error) {
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

// sampleHeap samples the heap (runtime/metrics) every millisecond until
// stop, which returns the heap after a GC at the start, the peak of the
// heap's objects (live or garbage not yet collected) and the peak of the
// live heap as of the last GC (/gc/heap/live:bytes).
func sampleHeap() (stop func() (base, peak, live uint64)) {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	runtime.GC()
	metrics.Read(s)
	base := s[0].Value.Uint64()
	var (
		mu   sync.Mutex
		peak = base
		live = base
		done = make(chan struct{})
		wg   sync.WaitGroup
	)
	wg.Go(func() {
		s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}, {Name: "/gc/heap/live:bytes"}}
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			metrics.Read(s)
			mu.Lock()
			peak = max(peak, s[0].Value.Uint64())
			live = max(live, s[1].Value.Uint64())
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
		return base, peak, live
	}
}
