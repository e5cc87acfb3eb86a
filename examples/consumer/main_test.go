package main

import (
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// TestRun keeps the demo working: it fails on any error run reports,
// including a balance that shows a message applied twice.
func TestRun(t *testing.T) {
	t.Parallel()
	require.NoError(t, run(t.Context()))
}

// consumers opens n ledgers (n pools, as n processes) on one new database.
func consumers(t *testing.T, n int) []*ledger {
	t.Helper()
	path := filepath.Join(t.TempDir(), "ledger.db")
	require.NoError(t, setupDB(t.Context(), path))
	out := make([]*ledger, n)
	for i := range out {
		l, err := openLedger(path)
		require.NoError(t, err)
		t.Cleanup(func() { _ = l.db.Close() })
		out[i] = l
	}
	return out
}

func entries(t *testing.T, l *ledger) int {
	t.Helper()
	var n int
	require.NoError(t, l.db.QueryRowContext(t.Context(), `SELECT count(*) FROM entries`).Scan(&n))
	return n
}

func TestRedeliveryReplays(t *testing.T) {
	t.Parallel()
	l := consumers(t, 1)[0]
	m := Message{ID: "msg-1", Payload: []byte(`{"account":"bob","cents":250}`)}
	first, err := l.consumer.Handle(t.Context(), m)
	require.NoError(t, err)
	require.Equal(t, Applied, first.Outcome)
	require.False(t, first.Replayed)
	for range 3 {
		again, err := l.consumer.Handle(t.Context(), m)
		require.NoError(t, err)
		require.True(t, again.Replayed)
		require.Equal(t, Applied, again.Outcome)
		require.JSONEq(t, string(first.Result), string(again.Result), "a redelivery gets the first handling's result")
		act, _ := Decide(err)
		require.Equal(t, Ack, act)
	}
	bal, err := l.balance(t.Context(), "bob")
	require.NoError(t, err)
	require.EqualValues(t, 250, bal)
	require.Equal(t, 1, entries(t, l))
}

// Two consumers with pools of their own receive each message at the same
// time; every message is applied exactly once.
func TestConcurrentConsumers(t *testing.T) {
	t.Parallel()
	ls := consumers(t, 2)
	const rounds = 20
	for i := range rounds {
		m := Message{ID: fmt.Sprintf("msg-%03d", i), Payload: []byte(`{"account":"alice","cents":10}`)}
		var wg sync.WaitGroup
		got := make([]*Handled, len(ls))
		errs := make([]error, len(ls))
		start := make(chan struct{})
		for j, l := range ls {
			wg.Go(func() {
				<-start
				got[j], errs[j] = l.consumer.Handle(t.Context(), m)
			})
		}
		close(start)
		wg.Wait()
		applied := 0
		for j := range ls {
			require.NoError(t, errs[j])
			if !got[j].Replayed {
				applied++
			}
			require.JSONEq(t, string(got[0].Result), string(got[j].Result))
		}
		require.Equal(t, 1, applied, "round %d: one consumer applied it, the other got its result", i)
	}
	bal, err := ls[0].balance(t.Context(), "alice")
	require.NoError(t, err)
	require.EqualValues(t, 10*rounds, bal)
	require.Equal(t, rounds, entries(t, ls[0]))
}

func TestChangedPayload(t *testing.T) {
	t.Parallel()
	l := consumers(t, 1)[0]
	_, err := l.consumer.Handle(t.Context(), Message{ID: "msg-1", Payload: []byte(`{"account":"bob","cents":100}`)})
	require.NoError(t, err)
	h, err := l.consumer.Handle(t.Context(), Message{ID: "msg-1", Payload: []byte(`{"account":"bob","cents":100000}`)})
	require.ErrorIs(t, err, idem.ErrFingerprint, "a changed payload under a known ID is reported")
	require.Nil(t, h)
	act, _ := Decide(err)
	require.Equal(t, DeadLetter, act)
	bal, err := l.balance(t.Context(), "bob")
	require.NoError(t, err)
	require.EqualValues(t, 100, bal, "and not applied")
	require.Equal(t, 1, entries(t, l))
}

func TestRejectionRecordedOnce(t *testing.T) {
	t.Parallel()
	l := consumers(t, 1)[0]
	m := Message{ID: "msg-1", Payload: []byte(`{"account":"nobody","cents":100}`)}
	first, err := l.consumer.Handle(t.Context(), m)
	require.NoError(t, err)
	require.Equal(t, Rejected, first.Outcome)
	require.False(t, first.Replayed)
	again, err := l.consumer.Handle(t.Context(), m)
	require.NoError(t, err)
	require.Equal(t, Rejected, again.Outcome)
	require.True(t, again.Replayed)
	require.Equal(t, first.Result, again.Result)
}

func TestBadMessages(t *testing.T) {
	t.Parallel()
	l := consumers(t, 1)[0]
	for _, m := range []Message{
		{ID: "msg-1", Payload: []byte(`not json`)},
		{ID: "", Payload: []byte(`{"account":"bob","cents":1}`)},
		{ID: "bad\nid", Payload: []byte(`{"account":"bob","cents":1}`)},
	} {
		_, err := l.consumer.Handle(t.Context(), m)
		act, _ := Decide(err)
		require.Equal(t, DeadLetter, act, "%q: %v", m.ID, err)
	}
	require.Equal(t, 0, entries(t, l))
}

func TestDecide(t *testing.T) {
	act, delay := Decide(&idem.InProgressError{RetryAfter: 2 * time.Second})
	require.Equal(t, Retry, act)
	require.Equal(t, 2*time.Second, delay)
	act, _ = Decide(fmt.Errorf("wrapped: %w", idem.ErrStoreUnavailable))
	require.Equal(t, Retry, act)
	act, _ = Decide(errors.New("the effect failed"))
	require.Equal(t, Retry, act, "an error of the effect rolled back: redeliver")
}
