package conformance

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func txCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "TxRollbackFreesKey", run: testTxRollbackFreesKey[TTx]},
		{name: "TxCommitIsAtomic", run: testTxCommitIsAtomic[TTx]},
		{name: "TxGetSeesOwnClaim", run: testTxGetSeesOwnClaim[TTx]},
		{name: "TxReleaseOrCompleteOnce", run: testTxReleaseOrCompleteOnce[TTx]},
		{name: "TxCommitWithoutCompletion", run: testTxCommitWithoutCompletion[TTx]},
		{name: "DoCallbackErrorRollsBack", run: testDoCallbackErrorRollsBack[TTx]},
		{name: "DoCallbackPanicRollsBack", run: testDoCallbackPanicRollsBack[TTx]},
		{name: "DoFinalFailureIsStoredAndCommitted", run: testDoFinalFailureIsStoredAndCommitted[TTx]},
		{name: "FailTxAndReleaseTxJoinTheTransaction", run: testFailTxAndReleaseTxJoinTheTransaction[TTx]},
	}
}

func testTxRollbackFreesKey[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("rollback")

	tx := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, tx, "t1/create", key, fp("x"))
	require.NoError(t, err)
	require.True(t, c.Acquired())
	require.NoError(t, b.ns.InsertOrder(ctx, tx, key))
	require.NoError(t, b.store.CompleteTx(ctx, tx, c, orderResponse(key)))

	// No other connection sees the claim, the response or the order before commit.
	_, err = b.store.Get(ctx, "t1/create", key)
	require.ErrorIs(t, err, idem.ErrNotFound)
	require.Zero(t, b.records(ctx, t))
	require.Zero(t, b.orders(ctx, t, key))

	require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))

	require.Zero(t, b.records(ctx, t))
	require.Zero(t, b.orders(ctx, t, key))
	var calls counter
	res, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.False(t, res.Replayed, "after a rollback the key must be free")
	require.Equal(t, 1, calls.get())
	require.Equal(t, 1, b.orders(ctx, t, key))
}

// testTxCommitIsAtomic watches from other connections while a transaction
// holding the claim, a business row and the completion commits: a reader
// must never see one without the other.
func testTxCommitIsAtomic[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	for round := range 3 {
		key := newKey(fmt.Sprintf("atomic%d", round))
		tx := b.begin(ctx, t)
		c, err := b.store.ClaimTx(ctx, tx, "t1/create", key, fp("x"))
		require.NoError(t, err)
		require.NoError(t, b.ns.InsertOrder(ctx, tx, key))
		require.NoError(t, b.store.CompleteTx(ctx, tx, c, orderResponse(key)))

		var (
			wg        sync.WaitGroup
			mu        sync.Mutex
			violation error
			polls     int
			seen      bool
		)
		committed := make(chan struct{})
		firstPoll := make(chan struct{})
		wg.Add(1)
		go func() {
			defer wg.Done()
			after := 0
			for after < 20 {
				select {
				case <-committed:
					after++
				default:
				}
				// Order matters: whatever is seen first must imply the other.
				rec, gerr := b.store.Get(ctx, "t1/create", key)
				n, cerr := b.ns.CountOrders(ctx, key)
				n2, cerr2 := b.ns.CountOrders(ctx, key)
				_, gerr2 := b.store.Get(ctx, "t1/create", key)
				mu.Lock()
				polls++
				if polls == 1 {
					close(firstPoll)
				}
				switch {
				case cerr != nil || cerr2 != nil:
					violation = errors.Join(cerr, cerr2)
				case gerr != nil && !errors.Is(gerr, idem.ErrNotFound):
					violation = gerr
				case gerr2 != nil && !errors.Is(gerr2, idem.ErrNotFound):
					violation = gerr2
				case gerr == nil && rec.Status != idem.StatusSucceeded:
					violation = fmt.Errorf("saw a %s record from outside the transaction", rec.Status)
				case gerr == nil && n != 1:
					violation = fmt.Errorf("saw the record but %d orders", n)
				case n2 == 1 && gerr2 != nil:
					violation = errors.New("saw the order but no record")
				}
				if gerr2 == nil {
					seen = true
				}
				stop := violation != nil
				mu.Unlock()
				if stop {
					return
				}
			}
		}()
		<-firstPoll
		time.Sleep(5 * time.Millisecond)
		require.NoError(t, b.ns.Dialect.Commit(ctx, tx))
		close(committed)
		wg.Wait()
		require.NoError(t, violation)
		require.True(t, seen, "the committed record never became visible")
		require.Equal(t, 1, b.orders(ctx, t, key))
	}
}

// testTxGetSeesOwnClaim: GetTx sees what the transaction wrote, and no
// other connection sees it before the commit. A dialect with deferred claims
// writes nothing at ClaimTx (GetTx answers ErrNotFound) and the completed
// record at CompleteTx; one without sees its processing record at once.
func testTxGetSeesOwnClaim[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("own")
	tx := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, tx, "t1/create", key, fp("x"))
	require.NoError(t, err)
	rec, err := b.store.GetTx(ctx, tx, "t1/create", key)
	if h.Features().DeferredClaims {
		require.ErrorIs(t, err, idem.ErrNotFound, "a deferred claim writes no record")
	} else {
		require.NoError(t, err)
		require.Equal(t, idem.StatusProcessing, rec.Status)
		require.Equal(t, c.Token, rec.Token)
	}
	require.NoError(t, b.store.CompleteTx(ctx, tx, c, orderResponse(key)))
	rec, err = b.store.GetTx(ctx, tx, "t1/create", key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
	require.Equal(t, c.Token, rec.Token)
	_, err = b.store.Get(ctx, "t1/create", key)
	require.ErrorIs(t, err, idem.ErrNotFound)
	require.NoError(t, b.ns.Dialect.Commit(ctx, tx))
	rec, err = b.store.Get(ctx, "t1/create", key)
	require.NoError(t, err)
	require.Equal(t, c.Token, rec.Token)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
}

func testDoCallbackErrorRollsBack[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("fnerr")
	boom := errors.New("payment declined")
	_, err := b.store.Do(ctx, "t1/create", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		if err := b.ns.InsertOrder(ctx, tx, key); err != nil {
			return nil, err
		}
		return nil, boom
	})
	require.ErrorIs(t, err, boom)
	require.Zero(t, b.orders(ctx, t, key), "the business write must roll back with the claim")
	require.Zero(t, b.records(ctx, t))

	var calls counter
	res, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
	require.NoError(t, err)
	require.False(t, res.Replayed)
	require.Equal(t, 1, b.orders(ctx, t, key))
}

func testDoCallbackPanicRollsBack[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("panic")
	require.PanicsWithValue(t, "handler bug", func() {
		_, _ = b.store.Do(ctx, "t1/create", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
			if err := b.ns.InsertOrder(ctx, tx, key); err != nil {
				return nil, err
			}
			panic("handler bug")
		})
	})
	require.Zero(t, b.orders(ctx, t, key))
	require.Zero(t, b.records(ctx, t))
	c, err := b.store.Claim(ctx, "t1/create", key, fp("x"))
	require.NoError(t, err)
	require.True(t, c.Acquired())
}

// testFailTxAndReleaseTxJoinTheTransaction checks that the Tx variants of
// Fail and Release write inside the caller's transaction: rolled back, they
// leave no trace; committed, they take effect.
func testFailTxAndReleaseTxJoinTheTransaction[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	declined := &idem.Response{StatusCode: 402, Body: []byte(`{"code":"card_declined"}`)}

	key := newKey("failtx")
	tx := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, tx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.store.FailTx(ctx, tx, c, declined))
	require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))
	require.Zero(t, b.records(ctx, t), "a rolled-back FailTx must leave nothing")

	tx = b.begin(ctx, t)
	c, err = b.store.ClaimTx(ctx, tx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.True(t, c.Acquired())
	require.NoError(t, b.store.FailTx(ctx, tx, c, declined))
	require.NoError(t, b.ns.Dialect.Commit(ctx, tx))
	replay, err := b.store.Claim(ctx, "t1/pay", key, fp("x"))
	require.NoError(t, err)
	require.Equal(t, idem.StatusFailed, replay.Replay.Status)
	require.Equal(t, declined.Body, replay.Replay.Response.Body)

	rkey := newKey("releasetx")
	held, err := b.store.Claim(ctx, "t1/pay", rkey, fp("x"))
	require.NoError(t, err)
	tx = b.begin(ctx, t)
	require.NoError(t, b.store.ReleaseTx(ctx, tx, held))
	require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))
	rec, err := b.store.Get(ctx, "t1/pay", rkey)
	require.NoError(t, err, "a rolled-back ReleaseTx must keep the record")
	require.Equal(t, held.Token, rec.Token)

	tx = b.begin(ctx, t)
	require.NoError(t, b.store.ReleaseTx(ctx, tx, held))
	require.NoError(t, b.ns.Dialect.Commit(ctx, tx))
	_, err = b.store.Get(ctx, "t1/pay", rkey)
	require.ErrorIs(t, err, idem.ErrNotFound)
}

// testDoFinalFailureIsStoredAndCommitted: a callback that reports a final
// failure commits its writes and the failed response, which retries replay.
func testDoFinalFailureIsStoredAndCommitted[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("final")
	declined := &idem.Response{StatusCode: 402, Body: []byte(`{"code":"card_declined"}`)}
	var calls counter
	fn := func(ctx context.Context, tx TTx) (*idem.Response, error) {
		calls.inc()
		if err := b.ns.InsertOrder(ctx, tx, key); err != nil {
			return nil, err
		}
		return nil, idem.FinalFailure(declined)
	}
	res, err := b.store.Do(ctx, "t1/pay", key, fp("x"), fn)
	require.NoError(t, err)
	require.False(t, res.Replayed)
	require.Equal(t, idem.StatusFailed, res.Status)
	require.Equal(t, 1, b.orders(ctx, t, key), "a final failure commits the transaction's writes")

	again, err := b.store.Do(ctx, "t1/pay", key, fp("x"), fn)
	require.NoError(t, err)
	require.True(t, again.Replayed)
	require.Equal(t, idem.StatusFailed, again.Status)
	require.Equal(t, 402, again.Response.StatusCode)
	require.Equal(t, declined.Body, again.Response.Body)
	require.Equal(t, 1, calls.get())

	// A final failure without a response is a bug: nothing is stored.
	k2 := newKey("final-nil")
	_, err = b.store.Do(ctx, "t1/pay", k2, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
		return nil, idem.FinalFailure(nil)
	})
	require.Error(t, err)
	_, err = b.store.Get(ctx, "t1/pay", k2)
	require.ErrorIs(t, err, idem.ErrNotFound)
}

// testTxReleaseOrCompleteOnce: inside the claiming transaction a claim is
// released or completed once; a second release or completion is fenced,
// whether the claim wrote a record or was deferred. A commit after the
// release leaves the key free; after the completion, completed.
func testTxReleaseOrCompleteOnce[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("release-once")
	tx := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, tx, "t1/create", key, fp("x"))
	require.NoError(t, err)
	require.True(t, c.Acquired())
	require.NoError(t, b.store.ReleaseTx(ctx, tx, c))
	require.ErrorIs(t, b.store.ReleaseTx(ctx, tx, c), idem.ErrFenced, "released already")
	require.ErrorIs(t, b.store.CompleteTx(ctx, tx, c, orderResponse(key)), idem.ErrFenced, "released already")
	require.NoError(t, b.ns.Dialect.Commit(ctx, tx))
	again, err := b.store.Claim(ctx, "t1/create", key, fp("x"))
	require.NoError(t, err)
	require.True(t, again.Acquired(), "the release committed: the key is free")

	key = newKey("complete-once")
	tx = b.begin(ctx, t)
	c, err = b.store.ClaimTx(ctx, tx, "t1/create", key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.store.CompleteTx(ctx, tx, c, orderResponse(key)))
	require.ErrorIs(t, b.store.CompleteTx(ctx, tx, c, orderResponse("other")), idem.ErrFenced, "completed already")
	require.ErrorIs(t, b.store.ReleaseTx(ctx, tx, c), idem.ErrFenced, "completed already")
	require.NoError(t, b.ns.Dialect.Commit(ctx, tx))
	rec, err := b.store.Get(ctx, "t1/create", key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
	require.Equal(t, orderResponse(key).Body, rec.Response.Body, "the first completion stands")
}

// testTxCommitWithoutCompletion: what a commit of the claiming transaction
// without a completion leaves, as Store.ClaimTx documents it. With deferred
// claims, nothing: the key is free, as after a rollback. Without, the
// processing record: the key answers in progress.
func testTxCommitWithoutCompletion[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("no-completion")
	tx := b.begin(ctx, t)
	c, err := b.store.ClaimTx(ctx, tx, "t1/create", key, fp("x"))
	require.NoError(t, err)
	require.True(t, c.Acquired())
	require.NoError(t, b.ns.Dialect.Commit(ctx, tx))
	again, err := b.store.Claim(ctx, "t1/create", key, fp("x"))
	if h.Features().DeferredClaims {
		require.NoError(t, err)
		require.True(t, again.Acquired(), "a deferred claim left nothing behind")
		return
	}
	require.ErrorIs(t, err, idem.ErrInProgress, "the processing record committed")
}
