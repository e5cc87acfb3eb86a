package conformance

import (
	"bytes"
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/digest"
	"github.com/idemstore/idem/internal/logscan"
)

// Store.Do's first read on the pool (idem.ReplayRead): it may answer only a
// completed, live record of the same fingerprint; everything else falls
// through to Do's transaction, with the answers, logs and events of that
// path. Each case runs with the read on every Do (Always), with it
// switched on by a run of replays (Auto), and without it (Never), which
// must all answer alike.
func replayReadCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "ReplayReadFallsThrough", run: testReplayReadFallsThrough[TTx]},
		{name: "ReplayReadCorruptRecord", run: testReplayReadCorruptRecord[TTx]},
		{name: "ReplayReadBodyRef", run: testReplayReadBodyRef[TTx]},
		{name: "ReplayReadObserved", run: testReplayReadObserved[TTx]},
		{name: "ReplayReadDeadline", run: testReplayReadDeadline[TTx]},
	}
}

// replayModes are the settings every replay-read case runs under.
var replayModes = []struct {
	name string
	mode idem.ReplayRead
}{
	{"always", idem.ReplayReadAlways},
	{"auto", idem.ReplayReadAuto},
	{"never", idem.ReplayReadNever},
}

// replayWarmer replays one completed key of its own often enough that
// ReplayReadAuto reads first on the next Do (a no-op for the other modes,
// which do not learn).
type replayWarmer[TTx any] struct {
	b   *bundle[TTx]
	key string
}

func newReplayWarmer[TTx any](ctx context.Context, t *testing.T, b *bundle[TTx]) *replayWarmer[TTx] {
	t.Helper()
	w := &replayWarmer[TTx]{b: b, key: newKey("warm")}
	_, err := b.store.Do(ctx, "t1/warm", w.key, fp("warm"), orderFn(b.ns, w.key, new(counter)))
	require.NoError(t, err)
	return w
}

func (w *replayWarmer[TTx]) warm(ctx context.Context, t *testing.T) {
	t.Helper()
	for range 40 {
		res, err := w.b.store.Do(ctx, "t1/warm", w.key, fp("warm"), func(context.Context, TTx) (*idem.Response, error) {
			t.Error("the warm key ran again")
			return nil, idem.ErrInvalidResponse
		})
		require.NoError(t, err)
		require.True(t, res.Replayed)
	}
}

// testReplayReadFallsThrough: with the first read on, a completed key of
// the same fingerprint replays byte for byte (a final failure as
// StatusFailed); a new key, another fingerprint, a processing record and a
// record past retention (same fingerprint) each get the transaction's
// answer: fn runs once, ErrFingerprint, ErrInProgress, fn runs again under
// a fresh claim.
func testReplayReadFallsThrough[TTx any](t *testing.T, h Harness[TTx]) {
	for _, m := range replayModes {
		t.Run(m.name, func(t *testing.T) {
			clk := newClock()
			ctx, b := setup(t, h, &idem.Config{LeaseDuration: 30 * time.Second, Retention: time.Hour, Now: clk.Now, ReplayRead: m.mode})
			w := newReplayWarmer(ctx, t, b)
			scope := "t1/create"
			do := func(key, print string, calls *counter) (*idem.Result, error) {
				w.warm(ctx, t)
				return b.store.Do(ctx, scope, key, fp(print), orderFn(b.ns, key, calls))
			}

			key := newKey("new")
			var calls counter
			res, err := do(key, "x", &calls)
			require.NoError(t, err)
			require.False(t, res.Replayed, "a new key runs fn")
			require.Equal(t, 1, calls.get())

			res, err = do(key, "x", &calls)
			require.NoError(t, err)
			require.True(t, res.Replayed)
			require.Equal(t, idem.StatusSucceeded, res.Status)
			requireSameResponse(t, orderResponse(key), res.Response)

			_, err = do(key, "other", &calls)
			require.ErrorIs(t, err, idem.ErrFingerprint, "another fingerprint is a mismatch, not a replay")
			require.Equal(t, 1, calls.get())

			failed := newKey("failed")
			declined := &idem.Response{StatusCode: http.StatusPaymentRequired, Body: []byte(`{"error":"declined"}`)}
			_, err = b.store.Do(ctx, scope, failed, fp("x"), func(context.Context, TTx) (*idem.Response, error) {
				return nil, idem.FinalFailure(declined)
			})
			require.NoError(t, err)
			w.warm(ctx, t)
			res, err = b.store.Do(ctx, scope, failed, fp("x"), orderFn(b.ns, failed, &calls))
			require.NoError(t, err)
			require.True(t, res.Replayed)
			require.Equal(t, idem.StatusFailed, res.Status, "a final failure replays as one")
			require.Equal(t, declined.Body, res.Response.Body)

			held := newKey("held")
			_, err = b.store.Claim(ctx, scope, held, fp("x"))
			require.NoError(t, err)
			var heldCalls counter
			_, err = do(held, "x", &heldCalls)
			require.ErrorIs(t, err, idem.ErrInProgress, "a processing record is in progress, not a replay")
			require.Zero(t, heldCalls.get())

			clk.advance(time.Hour + time.Second) // key's retention runs out (the warm key's too)
			w = newReplayWarmer(ctx, t, b)
			res, err = do(key, "x", &calls)
			require.NoError(t, err, "past retention the key is free")
			require.False(t, res.Replayed)
			require.Equal(t, 2, calls.get(), "fn ran under a fresh claim")
		})
	}
}

// testReplayReadCorruptRecord: a completed record damaged by hand is
// ErrCorruptRecord, with its digest, logged, never replayed, whether the
// first read is on or not.
func testReplayReadCorruptRecord[TTx any](t *testing.T, h Harness[TTx]) {
	for _, m := range replayModes {
		t.Run(m.name, func(t *testing.T) {
			rec := logscan.New()
			for _, s := range suiteSecrets {
				rec.Pattern(s.what, s.re)
			}
			ctx, b := setup(t, h, &idem.Config{Logger: rec.Logger(), ReplayRead: m.mode})
			w := newReplayWarmer(ctx, t, b)
			for _, c := range corruptions() {
				key := newKey("corrupt")
				var calls counter
				_, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
				require.NoError(t, err)
				require.NoError(t, b.ns.CorruptResponse(ctx, "t1/create", key, c.status, c.headers), c.name)
				w.warm(ctx, t)
				res, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
				require.ErrorIs(t, err, idem.ErrCorruptRecord, "%s: replayed %v", c.name, res)
				var corrupt *idem.CorruptRecordError
				require.ErrorAs(t, err, &corrupt, c.name)
				kd := digest.Key("t1/create", key)
				require.Equal(t, kd, corrupt.KeyDigest, c.name)
				require.Equal(t, 1, calls.get(), c.name)
				requireLogged(t, rec, "idem: stored record is invalid", kd)
			}
			rec.Check(t)
		})
	}
}

// testReplayReadBodyRef: a replay of a body kept in the BodyStore carries
// Response.BodyRef, not the stored reference as a header, and its body
// reads back whole.
func testReplayReadBodyRef[TTx any](t *testing.T, h Harness[TTx]) {
	for _, m := range replayModes {
		t.Run(m.name, func(t *testing.T) {
			ctx, b, _ := bodySetup(t, h, dirBodyStores{}, &idem.Config{ReplayRead: m.mode})
			w := newReplayWarmer(ctx, t, b)
			big := bigResponse(200 << 10)
			key := newKey("body")
			var calls counter
			fn := func(context.Context, TTx) (*idem.Response, error) {
				calls.inc()
				return big, nil
			}
			_, err := b.store.Do(ctx, "t1/export", key, fp("x"), fn)
			require.NoError(t, err)
			w.warm(ctx, t)
			res, err := b.store.Do(ctx, "t1/export", key, fp("x"), fn)
			require.NoError(t, err)
			require.True(t, res.Replayed)
			require.Equal(t, 1, calls.get())
			require.NotNil(t, res.Response.BodyRef, "the body is named by its reference")
			require.Empty(t, res.Response.Body)
			require.Equal(t, big.Header, res.Response.Header, "the reference is not a header of the replay")
			loaded, err := b.store.LoadBody(ctx, res.Response)
			require.NoError(t, err)
			require.True(t, bytes.Equal(big.Body, loaded.Body))
		})
	}
}

// testReplayReadObserved: a replay reports one claim event, replayed, and
// logs its outcome, whichever path answered it.
func testReplayReadObserved[TTx any](t *testing.T, h Harness[TTx]) {
	for _, m := range replayModes {
		t.Run(m.name, func(t *testing.T) {
			var (
				mu     sync.Mutex
				events []idem.ClaimEvent
			)
			rec := logscan.New()
			for _, s := range suiteSecrets {
				rec.Pattern(s.what, s.re)
			}
			obs := &idem.Observer{Claim: func(_ context.Context, e idem.ClaimEvent) {
				mu.Lock()
				events = append(events, e)
				mu.Unlock()
			}}
			ctx, b := setup(t, h, &idem.Config{Observer: obs, Logger: rec.Logger(), ReplayRead: m.mode})
			w := newReplayWarmer(ctx, t, b)
			key := newKey("observed")
			_, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, new(counter)))
			require.NoError(t, err)
			w.warm(ctx, t)
			mu.Lock()
			events = nil
			mu.Unlock()
			res, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, new(counter)))
			require.NoError(t, err)
			require.True(t, res.Replayed)
			mu.Lock()
			defer mu.Unlock()
			require.Len(t, events, 1, "one claim event per replay")
			require.Equal(t, idem.ClaimReplayed, events[0].Outcome)
			require.Equal(t, digest.Key("t1/create", key), events[0].KeyDigest)
			require.Equal(t, b.ns.Dialect.Name(), events[0].Dialect)
			requireLogged(t, rec, "idem: replay", digest.Key("t1/create", key))
			rec.Check(t)
		})
	}
}

// testReplayReadDeadline: the pool's ReplayReader returns the record's
// retention deadline as Get does, to the microsecond (the replay cache
// never keeps an entry beyond it), on the server's clock and on a pinned
// one.
func testReplayReadDeadline[TTx any](t *testing.T, h Harness[TTx]) {
	for _, pinned := range []bool{false, true} {
		var now func() time.Time
		if pinned {
			now = newClock().Now
		}
		ctx, b := setup(t, h, &idem.Config{Retention: time.Hour, Now: now})
		rr, ok := b.ns.Dialect.DB().(idem.ReplayReader)
		if !ok {
			t.Skip("the dialect's pool has no ReplayReader")
		}
		key := newKey("deadline")
		_, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, new(counter)))
		require.NoError(t, err)
		var at *time.Time
		if now != nil {
			v := now()
			at = &v
		}
		got, err := rr.GetCompleted(ctx, &idem.GetParams{Scope: "t1/create", Key: key, Now: at})
		require.NoError(t, err)
		full, err := b.ns.Dialect.DB().Get(ctx, &idem.GetParams{Scope: "t1/create", Key: key, Now: at})
		require.NoError(t, err)
		require.False(t, got.ExpiresAt.IsZero())
		require.True(t, full.ExpiresAt.Equal(got.ExpiresAt), "GetCompleted %v, Get %v", got.ExpiresAt, full.ExpiresAt)
		require.Equal(t, time.UTC, got.ExpiresAt.Location())
	}
}
