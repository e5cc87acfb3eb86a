package conformance

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// Cases of bodies stored by reference (Config.BodyStore) in the body stores
// of bh (a DirBodyStore, a real directory, in Run): the faults are real
// ones (a directory gone or a port closed, an object deleted or
// overwritten by hand), never a fake store.
func bodyStoreCases[TTx any](bh BodyStoreHarness) []testCase[TTx] {
	with := func(f func(*testing.T, Harness[TTx], BodyStoreHarness)) func(*testing.T, Harness[TTx]) {
		return func(t *testing.T, h Harness[TTx]) { f(t, h, bh) }
	}
	return []testCase[TTx]{
		{name: "BodyStoreRoundTrip", run: with(testBodyStoreRoundTrip[TTx])},
		{name: "BodyStoreDownRefusesAndLeavesKeyFree", run: with(testBodyStoreDown[TTx])},
		{name: "BodyStoreRolledBackObjectIsSwept", run: with(testBodyStoreOrphanSwept[TTx])},
		{name: "BodyStoreObjectDeletedOrDamaged", run: with(testBodyStoreObjectDamaged[TTx])},
		{name: "BodyStoreReaperDeletesObjectAfterRecord", run: with(testBodyStoreReaper[TTx])},
		{name: "BodyStoreLeasedAndVerdict", run: with(testBodyStoreLeasedAndVerdict[TTx])},
	}
}

const inlineMax = 1 << 10

func bodySetup[TTx any](t *testing.T, h Harness[TTx], bh BodyStoreHarness, cfg *idem.Config) (context.Context, *bundle[TTx], *BodyStoreFixture) {
	t.Helper()
	bs := bh.Open(t.Context(), t)
	c := idem.Config{}
	if cfg != nil {
		c = *cfg
	}
	c.BodyStore, c.InlineBodyMax = bs.Store, inlineMax
	ctx, b := setup(t, h, &c)
	return ctx, b, bs
}

// bigResponse is a response whose body holds every byte value, n bytes long.
func bigResponse(n int) *idem.Response {
	body := make([]byte, n)
	for i := range body {
		body[i] = byte(i*7 + i/251)
	}
	return &idem.Response{StatusCode: http.StatusOK, Header: http.Header{"Content-Type": {"text/csv"}}, Body: body}
}

func readBody[TTx any](ctx context.Context, t *testing.T, s *idem.Store[TTx], resp *idem.Response) ([]byte, error) {
	t.Helper()
	rc, err := s.OpenBody(ctx, resp)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return io.ReadAll(rc)
}

func objects(t *testing.T, bs *BodyStoreFixture) []string {
	t.Helper()
	return listAll(t, bs.Store)
}

// testBodyStoreRoundTrip: a body over InlineBodyMax goes to the body store
// and replays byte for byte with its status and headers; one under it
// stays inline; a Do callback may stream its body with PutBody.
func testBodyStoreRoundTrip[TTx any](t *testing.T, h Harness[TTx], bh BodyStoreHarness) {
	ctx, b, bs := bodySetup(t, h, bh, nil)
	big, small := bigResponse(300<<10), bigResponse(inlineMax)
	for _, c := range []struct {
		name string
		resp *idem.Response
		ref  bool
	}{{"big", big, true}, {"small", small, false}} {
		key := newKey("body")
		var calls counter
		fn := func(ctx context.Context, tx TTx) (*idem.Response, error) {
			calls.inc()
			return c.resp, nil
		}
		_, err := b.store.Do(ctx, "t1/export", key, fp("x"), fn)
		require.NoError(t, err, c.name)
		res, err := b.store.Do(ctx, "t1/export", key, fp("x"), fn)
		require.NoError(t, err, c.name)
		require.True(t, res.Replayed, c.name)
		require.Equal(t, 1, calls.get(), c.name)
		require.Equal(t, c.ref, res.Response.BodyRef != nil, c.name)
		require.Equal(t, c.resp.StatusCode, res.Response.StatusCode)
		require.Equal(t, c.resp.Header, res.Response.Header, c.name+": the reference is not a header of the replay")
		got, err := readBody(ctx, t, b.store, res.Response)
		require.NoError(t, err, c.name)
		require.True(t, bytes.Equal(c.resp.Body, got), c.name)
		rec, err := b.store.Get(ctx, "t1/export", key)
		require.NoError(t, err)
		if c.ref {
			require.Empty(t, rec.Response.Body)
			require.Equal(t, int64(len(big.Body)), rec.Response.BodyRef.Length)
			require.Equal(t, sha256.Sum256(big.Body), rec.Response.BodyRef.SHA256)
		}
	}
	require.Len(t, objects(t, bs), 1)

	// Streamed from the callback: the body never exists as one slice.
	key := newKey("stream")
	_, err := b.store.Do(ctx, "t1/export", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		ref, err := b.store.PutBody(ctx, idem.DoClaim(ctx), bytes.NewReader(big.Body))
		if err != nil {
			return nil, err
		}
		return &idem.Response{StatusCode: 200, BodyRef: ref}, nil
	})
	require.NoError(t, err)
	rec, err := b.store.Get(ctx, "t1/export", key)
	require.NoError(t, err)
	got, err := readBody(ctx, t, b.store, rec.Response)
	require.NoError(t, err)
	require.True(t, bytes.Equal(big.Body, got))

	// A reference put for another claim is refused, nothing stored.
	other := newKey("other")
	_, err = b.store.Do(ctx, "t1/export", other, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		return &idem.Response{StatusCode: 200, BodyRef: rec.Response.BodyRef}, nil
	})
	require.ErrorIs(t, err, idem.ErrInvalidResponse)
	_, err = b.store.Get(ctx, "t1/export", other)
	require.ErrorIs(t, err, idem.ErrNotFound)
}

// testBodyStoreDown: a body store that fails refuses the completion with
// ErrBodyUnavailable (also ErrStoreUnavailable: a 503), commits nothing,
// and leaves the key free for a retry once the store is back.
func testBodyStoreDown[TTx any](t *testing.T, h Harness[TTx], bh BodyStoreHarness) {
	ctx, b, bs := bodySetup(t, h, bh, nil)
	bs.Break(t)
	key := newKey("down")
	var calls counter
	_, err := b.store.Do(ctx, "t1/create", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		calls.inc()
		if err := b.ns.InsertOrder(ctx, tx, key); err != nil {
			return nil, err
		}
		return bigResponse(10 << 10), nil
	})
	require.ErrorIs(t, err, idem.ErrBodyUnavailable)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	require.Equal(t, 0, b.orders(ctx, t, key), "the business rows rolled back with the record")
	require.Equal(t, 0, b.records(ctx, t))

	bs.Mend(t)
	res, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.False(t, res.Replayed, "the key was free")
	require.Equal(t, 1, b.orders(ctx, t, key))
}

// testBodyStoreOrphanSwept: an object written for a completion whose
// transaction rolled back is named by no record; the sweep deletes it
// once past its grace period, and never an object a record names.
func testBodyStoreOrphanSwept[TTx any](t *testing.T, h Harness[TTx], bh BodyStoreHarness) {
	ctx, b, bs := bodySetup(t, h, bh, nil)
	kept := newKey("kept")
	_, err := b.store.Do(ctx, "t1/export", kept, fp("x"), func(context.Context, TTx) (*idem.Response, error) {
		return bigResponse(5 << 10), nil
	})
	require.NoError(t, err)

	orphan := newKey("orphan")
	tx := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, tx, "t1/export", orphan, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.store.CompleteTx(ctx, tx, c, bigResponse(6<<10)))
	require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))
	require.Len(t, objects(t, bs), 2, "the object was written before the record, which rolled back")

	n, err := b.store.SweepBodies(ctx, time.Hour)
	require.NoError(t, err)
	require.Equal(t, 0, n, "within the grace period nothing is swept")
	bs.Age(t)
	n, err = b.store.SweepBodies(ctx, time.Hour)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Len(t, objects(t, bs), 1)
	rec, err := b.store.Get(ctx, "t1/export", kept)
	require.NoError(t, err)
	got, err := readBody(ctx, t, b.store, rec.Response)
	require.NoError(t, err)
	require.Len(t, got, 5<<10)
}

// testBodyStoreObjectDamaged: a record whose object was deleted, truncated
// or overwritten by hand answers ErrCorruptRecord before any byte, never a
// wrong body; the record is left as it is.
func testBodyStoreObjectDamaged[TTx any](t *testing.T, h Harness[TTx], bh BodyStoreHarness) {
	ctx, b, bs := bodySetup(t, h, bh, nil)
	rewrite := func(edit func([]byte) []byte) func(context.Context, *testing.T, string) {
		return func(ctx context.Context, t *testing.T, a string) { bs.Rewrite(ctx, t, a, edit) }
	}
	for _, c := range []struct {
		name   string
		damage func(ctx context.Context, t *testing.T, address string)
	}{
		{"deleted", bs.Remove},
		{"truncated", rewrite(func(b []byte) []byte { return b[:100] })},
		{"overwritten", rewrite(func(b []byte) []byte {
			b[len(b)/2] ^= 1
			return b
		})},
		{"grown", rewrite(func(b []byte) []byte { return append(b, 'x') })},
	} {
		key := newKey("damaged")
		_, err := b.store.Do(ctx, "t1/export", key, fp("x"), func(context.Context, TTx) (*idem.Response, error) {
			return bigResponse(4 << 10), nil
		})
		require.NoError(t, err, c.name)
		rec, err := b.store.Get(ctx, "t1/export", key)
		require.NoError(t, err)
		c.damage(ctx, t, rec.Response.BodyRef.Address)

		res, err := b.store.Do(ctx, "t1/export", key, fp("x"), func(context.Context, TTx) (*idem.Response, error) {
			t.Error("the callback ran for a completed key")
			return nil, errors.New("ran")
		})
		require.NoError(t, err, c.name)
		require.True(t, res.Replayed)
		got, err := readBody(ctx, t, b.store, res.Response)
		require.ErrorIs(t, err, idem.ErrCorruptRecord, c.name)
		require.Nil(t, got, c.name)
		var corrupt *idem.CorruptRecordError
		require.ErrorAs(t, err, &corrupt)
		require.Equal(t, idem.KeyDigest("t1/export", key), corrupt.KeyDigest)
		require.NotErrorIs(t, err, idem.ErrStoreUnavailable, c.name)
		_, err = b.store.Get(ctx, "t1/export", key)
		require.NoError(t, err, "the record is left for an operator")
	}
}

// testBodyStoreReaper: the reaper deletes an expired record, then (once
// past the grace period) its object; an object of a live record stays.
func testBodyStoreReaper[TTx any](t *testing.T, h Harness[TTx], bh BodyStoreHarness) {
	clk := newClock()
	ctx, b, bs := bodySetup(t, h, bh, &idem.Config{Retention: time.Hour, Now: clk.Now})
	reaper, err := idem.NewReaper(b.store, &idem.ReaperConfig{BodyGrace: time.Minute, BodySweepEvery: time.Nanosecond})
	require.NoError(t, err)
	old, live := newKey("old"), newKey("live")
	do := func(key string) {
		_, err := b.store.Do(ctx, "t1/export", key, fp("x"), func(context.Context, TTx) (*idem.Response, error) {
			return bigResponse(3 << 10), nil
		})
		require.NoError(t, err)
	}
	do(old)
	clk.advance(2 * time.Hour)
	do(live)
	bs.Age(t)
	require.Len(t, objects(t, bs), 2)

	// Past retention but not yet deleted: the record still names its object.
	n, err := b.store.SweepBodies(ctx, time.Minute)
	require.NoError(t, err)
	require.Equal(t, 0, n)

	rep, err := reaper.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Deleted)
	require.Equal(t, 1, rep.BodiesDeleted)
	require.Len(t, objects(t, bs), 1)
	rec, err := b.store.Get(ctx, "t1/export", live)
	require.NoError(t, err)
	_, err = readBody(ctx, t, b.store, rec.Response)
	require.NoError(t, err)
}

// testBodyStoreLeasedAndVerdict: a leased completion streams its body with
// PutBody, and a status check's committed verdict with a large body is
// stored by reference too; both replay byte for byte.
func testBodyStoreLeasedAndVerdict[TTx any](t *testing.T, h Harness[TTx], bh BodyStoreHarness) {
	clk := newClock()
	recovered := bigResponse(20 << 10)
	check := func(context.Context, idem.Record) (idem.Verdict, error) { return idem.Committed(recovered), nil }
	ctx, b, _ := bodySetup(t, h, bh, &idem.Config{LeaseDuration: time.Minute, Retention: time.Hour, Now: clk.Now, StatusCheck: check})

	leased := newKey("leased")
	l, err := b.store.Acquire(ctx, "t1/pay", leased, fp("x"))
	require.NoError(t, err)
	big := bigResponse(70 << 10)
	ref, err := b.store.PutBody(ctx, l.Claim(), bytes.NewReader(big.Body))
	require.NoError(t, err)
	require.NoError(t, l.Complete(ctx, &idem.Response{StatusCode: 200, Header: big.Header, BodyRef: ref}))

	stale := newKey("stale")
	_, err = b.store.Acquire(ctx, "t1/pay", stale, fp("x"))
	require.NoError(t, err)
	clk.advance(2 * time.Minute)

	for key, want := range map[string]*idem.Response{leased: big, stale: recovered} {
		c, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
		require.NoError(t, err)
		require.NotNil(t, c.Replay)
		require.NotNil(t, c.Replay.Response.BodyRef)
		got, err := readBody(ctx, t, b.store, c.Replay.Response)
		require.NoError(t, err)
		require.True(t, bytes.Equal(want.Body, got))
	}
}
