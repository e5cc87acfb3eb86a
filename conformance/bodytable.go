package conformance

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// Cases of bodies stored by reference in the dialect's table body store
// (Namespace.BodyTable, an idem.TxBodyStore over idempotency_bodies): the
// body commits with the record, or not at all. The faults are real ones:
// the table dropped, rows deleted or overwritten by hand with SQL.
func bodyTableCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "BodyTableRoundTrip", run: testBodyTableRoundTrip[TTx]},
		{name: "BodyTableDownRefusesAndLeavesKeyFree", run: testBodyTableDown[TTx]},
		{name: "BodyTableRollbackLeavesNothing", run: testBodyTableRollback[TTx]},
		{name: "BodyTablePoolOrphanIsSwept", run: testBodyTablePoolOrphan[TTx]},
		{name: "BodyTableObjectDeletedOrDamaged", run: testBodyTableDamaged[TTx]},
		{name: "BodyTableReaperDeletesObjectAfterRecord", run: testBodyTableReaper[TTx]},
		{name: "BodyTableLeasedAndVerdict", run: testBodyTableLeasedAndVerdict[TTx]},
	}
}

// tableChunk is the chunk size of the cases: small, so that their bodies
// span several rows.
const tableChunk = 4 << 10

// tableSetup opens a namespace whose store keeps bodies over inlineMax in
// the namespace's table body store; now is the table store's clock (nil:
// time.Now), which SweepBodies compares with time.Now.
func tableSetup[TTx any](t *testing.T, h Harness[TTx], cfg *idem.Config, now func() time.Time) (context.Context, *bundle[TTx], idem.BodyStore) {
	t.Helper()
	ctx := t.Context()
	ns := h.Open(ctx, t)
	bs := ns.BodyTable(&idem.TableBodyStoreConfig{ChunkSize: tableChunk, Now: now})
	c := idem.Config{}
	if cfg != nil {
		c = *cfg
	}
	c.BodyStore, c.InlineBodyMax = bs, inlineMax
	if c.Logger == nil {
		c.Logger = scannedLogger(t)
	}
	store, err := idem.New(ns.Dialect, &c)
	require.NoError(t, err)
	require.True(t, store.BodyStoreInTx(), "the table store writes in the store's transactions")
	return ctx, &bundle[TTx]{ns: ns, store: store, feat: h.Features()}, bs
}

func (b *bundle[TTx]) bodyRows(ctx context.Context, t *testing.T) int {
	t.Helper()
	n, err := b.ns.BodyRows(ctx)
	require.NoError(t, err)
	return n
}

// twoHoursAgo is a table store clock two hours behind, as if every object
// had been written then.
func twoHoursAgo() time.Time { return time.Now().Add(-2 * time.Hour) }

// testBodyTableRoundTrip: a body over InlineBodyMax is written to the
// table in chunks and replays byte for byte, from Do's response, from a
// Do callback's PutBodyTx and from CompleteTx in the caller's transaction;
// the rows are those of one object each.
func testBodyTableRoundTrip[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b, _ := tableSetup(t, h, nil, nil)
	big := bigResponse(10*tableChunk + 123)
	check := func(name, key string) {
		t.Helper()
		c, err := b.store.Claim(ctx, "t1/export", key, fp("x"))
		require.NoError(t, err, name)
		require.NotNil(t, c.Replay, name)
		require.NotNil(t, c.Replay.Response.BodyRef, name)
		require.Equal(t, big.Header, c.Replay.Response.Header, name)
		got, err := readBody(ctx, t, b.store, c.Replay.Response)
		require.NoError(t, err, name)
		require.True(t, bytes.Equal(big.Body, got), name)
	}

	var calls counter
	key := newKey("do")
	_, err := b.store.Do(ctx, "t1/export", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		calls.inc()
		return big, nil
	})
	require.NoError(t, err)
	check("Do", key)
	require.Equal(t, 11, b.bodyRows(ctx, t), "one row per chunk")

	key = newKey("stream")
	_, err = b.store.Do(ctx, "t1/export", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		ref, err := b.store.PutBodyTx(ctx, tx, idem.DoClaim(ctx), bytes.NewReader(big.Body))
		if err != nil {
			return nil, err
		}
		return &idem.Response{StatusCode: 200, Header: big.Header, BodyRef: ref}, nil
	})
	require.NoError(t, err)
	check("PutBodyTx", key)

	key = newKey("tx")
	tx := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, tx, "t1/export", key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.ns.InsertOrder(ctx, tx, key))
	require.NoError(t, b.store.CompleteTx(ctx, tx, c, big))
	require.Equal(t, 22, b.bodyRows(ctx, t), "the caller's transaction is not committed yet")
	require.NoError(t, b.ns.Dialect.Commit(ctx, tx))
	check("CompleteTx", key)
	require.Equal(t, 33, b.bodyRows(ctx, t))
	require.Equal(t, 1, b.orders(ctx, t, key))
	require.Equal(t, 1, calls.get())
}

// testBodyTableDown: a table store whose statements fail (its table
// dropped) refuses the completion with ErrBodyUnavailable (also
// ErrStoreUnavailable: a 503), on Do's transaction and on the pool; nothing
// is committed and the key is free for a retry.
func testBodyTableDown[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b, _ := tableSetup(t, h, nil, nil)
	require.NoError(t, b.store.Check(ctx))
	require.NoError(t, b.ns.DropBodyTable(ctx))
	err := b.store.Check(ctx)
	require.ErrorIs(t, err, idem.ErrNotReady, "Check sees the body table gone")
	var ce *idem.CheckError
	require.ErrorAs(t, err, &ce)
	require.Len(t, ce.Problems, 1)
	require.Contains(t, ce.Problems[0].What, "idempotency_bodies")
	key := newKey("down")
	_, err = b.store.Do(ctx, "t1/create", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		if err := b.ns.InsertOrder(ctx, tx, key); err != nil {
			return nil, err
		}
		return bigResponse(10 << 10), nil
	})
	require.ErrorIs(t, err, idem.ErrBodyUnavailable)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	require.Equal(t, 0, b.orders(ctx, t, key), "the business rows rolled back with the record")
	require.Equal(t, 0, b.records(ctx, t))

	leased := newKey("leased")
	l, err := b.store.Acquire(ctx, "t1/pay", leased, fp("x"))
	require.NoError(t, err)
	_, err = b.store.PutBody(ctx, l.Claim(), bytes.NewReader(bigResponse(10<<10).Body))
	require.ErrorIs(t, err, idem.ErrBodyUnavailable)
	require.ErrorIs(t, l.Complete(ctx, bigResponse(10<<10)), idem.ErrBodyUnavailable)
	require.NoError(t, l.Release(ctx))

	// The key is free: a small answer, stored inline, needs no body store.
	var calls counter
	res, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.False(t, res.Replayed, "the key was free")
	require.Equal(t, 1, b.orders(ctx, t, key))
}

// testBodyTableRollback: a body written in a transaction that rolls back
// (the caller's after CompleteTx, Do's after its callback failed) leaves
// no row at all: no orphan for the sweep to find.
func testBodyTableRollback[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b, bs := tableSetup(t, h, nil, twoHoursAgo)
	key := newKey("rolled")
	tx := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, tx, "t1/export", key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.store.CompleteTx(ctx, tx, c, bigResponse(6*tableChunk)))
	require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))

	failed := errors.New("the callback failed after its body was written")
	_, err = b.store.Do(ctx, "t1/export", newKey("failed"), fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		if _, err := b.store.PutBodyTx(ctx, tx, idem.DoClaim(ctx), bytes.NewReader(bigResponse(5*tableChunk).Body)); err != nil {
			return nil, err
		}
		return nil, failed
	})
	require.ErrorIs(t, err, failed)

	require.Equal(t, 0, b.bodyRows(ctx, t), "nothing of the bodies is left")
	require.Equal(t, 0, b.records(ctx, t))
	require.Empty(t, listAll(t, bs))
	n, err := b.store.SweepBodies(ctx, time.Hour)
	require.NoError(t, err)
	require.Zero(t, n)
}

// testBodyTablePoolOrphan: on the pool (a leased completion) the object
// commits before the record; when the record never follows, the object is
// an orphan that the sweep deletes once past its grace period, and never
// an object a record names.
func testBodyTablePoolOrphan[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b, bs := tableSetup(t, h, nil, twoHoursAgo)
	kept := newKey("kept")
	l, err := b.store.Acquire(ctx, "t1/pay", kept, fp("x"))
	require.NoError(t, err)
	require.NoError(t, l.Complete(ctx, bigResponse(3*tableChunk)))

	orphan := newKey("orphan")
	l, err = b.store.Acquire(ctx, "t1/pay", orphan, fp("x"))
	require.NoError(t, err)
	_, err = b.store.PutBody(ctx, l.Claim(), bytes.NewReader(bigResponse(2*tableChunk).Body))
	require.NoError(t, err)
	require.NoError(t, l.Release(ctx)) // the completion never came
	require.Len(t, listAll(t, bs), 2)
	require.Equal(t, 5, b.bodyRows(ctx, t))

	n, err := b.store.SweepBodies(ctx, 3*time.Hour)
	require.NoError(t, err)
	require.Zero(t, n, "within the grace period nothing is swept")
	n, err = b.store.SweepBodies(ctx, time.Hour)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, 3, b.bodyRows(ctx, t), "every row of the orphan, and only those")
	c, err := b.store.Claim(ctx, "t1/pay", kept, fp("x"))
	require.NoError(t, err)
	got, err := readBody(ctx, t, b.store, c.Replay.Response)
	require.NoError(t, err)
	require.Len(t, got, 3*tableChunk)
}

// testBodyTableDamaged: a record whose object's rows were deleted,
// truncated, overwritten or extended by hand answers ErrCorruptRecord
// before any byte, never a wrong body; the record is left as it is.
func testBodyTableDamaged[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b, bs := tableSetup(t, h, nil, nil)
	const size = 3*tableChunk + 100 // rows 0..3, the last of 100 bytes
	body := bigResponse(size).Body
	flipped := bytes.Clone(body[tableChunk : 2*tableChunk])
	flipped[10] ^= 1
	for _, c := range []struct {
		name   string
		damage func(addr string) error
	}{
		{"deleted", func(a string) error { return bs.Delete(ctx, a) }},
		{"last row deleted", func(a string) error { return b.ns.SetBodyChunk(ctx, a, 3, nil) }},
		{"middle row deleted", func(a string) error { return b.ns.SetBodyChunk(ctx, a, 1, nil) }},
		{"truncated", func(a string) error { return b.ns.SetBodyChunk(ctx, a, 3, body[3*tableChunk:3*tableChunk+10]) }},
		{"overwritten", func(a string) error { return b.ns.SetBodyChunk(ctx, a, 1, flipped) }},
		{"grown", func(a string) error {
			return b.ns.SetBodyChunk(ctx, a, 3, append(bytes.Clone(body[3*tableChunk:]), 'x'))
		}},
	} {
		key := newKey("damaged")
		_, err := b.store.Do(ctx, "t1/export", key, fp("x"), func(context.Context, TTx) (*idem.Response, error) {
			return bigResponse(size), nil
		})
		require.NoError(t, err, c.name)
		rec, err := b.store.Get(ctx, "t1/export", key)
		require.NoError(t, err)
		got, err := readBody(ctx, t, b.store, rec.Response)
		require.NoError(t, err, c.name)
		require.True(t, bytes.Equal(body, got), c.name)
		require.NoError(t, c.damage(rec.Response.BodyRef.Address), c.name)

		res, err := b.store.Do(ctx, "t1/export", key, fp("x"), func(context.Context, TTx) (*idem.Response, error) {
			t.Error("the callback ran for a completed key")
			return nil, errors.New("ran")
		})
		require.NoError(t, err, c.name)
		require.True(t, res.Replayed)
		got, err = readBody(ctx, t, b.store, res.Response)
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

// testBodyTableReaper: the reaper deletes an expired record, then (past
// the grace period) every row of its object; an object of a live record
// stays.
func testBodyTableReaper[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b, _ := tableSetup(t, h, &idem.Config{Retention: time.Hour, Now: clk.Now}, twoHoursAgo)
	reaper, err := idem.NewReaper(b.store, &idem.ReaperConfig{BodyGrace: time.Minute, BodySweepEvery: time.Nanosecond})
	require.NoError(t, err)
	old, live := newKey("old"), newKey("live")
	do := func(key string) {
		_, err := b.store.Do(ctx, "t1/export", key, fp("x"), func(context.Context, TTx) (*idem.Response, error) {
			return bigResponse(2 * tableChunk), nil
		})
		require.NoError(t, err)
	}
	do(old)
	clk.advance(2 * time.Hour)
	do(live)
	require.Equal(t, 4, b.bodyRows(ctx, t))

	// Past retention but not yet deleted: the record still names its object.
	n, err := b.store.SweepBodies(ctx, time.Minute)
	require.NoError(t, err)
	require.Equal(t, 0, n)

	rep, err := reaper.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.Deleted)
	require.Equal(t, 1, rep.BodiesDeleted)
	require.Equal(t, 2, b.bodyRows(ctx, t))
	rec, err := b.store.Get(ctx, "t1/export", live)
	require.NoError(t, err)
	_, err = readBody(ctx, t, b.store, rec.Response)
	require.NoError(t, err)
}

// testBodyTableLeasedAndVerdict: a leased completion streams its body with
// PutBody on the pool, and a status check's committed verdict with a large
// body is stored by reference too; both replay byte for byte.
func testBodyTableLeasedAndVerdict[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	recovered := bigResponse(5*tableChunk + 7)
	check := func(context.Context, idem.Record) (idem.Verdict, error) { return idem.Committed(recovered), nil }
	ctx, b, _ := tableSetup(t, h, &idem.Config{LeaseDuration: time.Minute, Retention: time.Hour, Now: clk.Now, StatusCheck: check}, nil)

	leased := newKey("leased")
	l, err := b.store.Acquire(ctx, "t1/pay", leased, fp("x"))
	require.NoError(t, err)
	big := bigResponse(9*tableChunk + 1)
	ref, err := b.store.PutBody(ctx, l.Claim(), bytes.NewReader(big.Body))
	require.NoError(t, err)
	require.NoError(t, l.Complete(ctx, &idem.Response{StatusCode: 200, Header: big.Header, BodyRef: ref}))

	stale := newKey("stale")
	_, err = b.store.Acquire(ctx, "t1/pay", stale, fp("x"))
	require.NoError(t, err)
	clk.advance(2 * time.Minute)

	for _, c := range []struct {
		key  string
		want *idem.Response
	}{{leased, big}, {stale, recovered}} {
		cl, err := b.store.Claim(ctx, "t1/pay", c.key, fp("x"))
		require.NoError(t, err)
		require.NotNil(t, cl.Replay)
		require.NotNil(t, cl.Replay.Response.BodyRef)
		got, err := readBody(ctx, t, b.store, cl.Replay.Response)
		require.NoError(t, err)
		require.True(t, bytes.Equal(c.want.Body, got))
	}
}
