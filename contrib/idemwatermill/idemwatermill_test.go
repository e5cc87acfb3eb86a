package idemwatermill_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemwatermill"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// world is a gochannel Pub/Sub, one SQLite ledger database, and subscribers
// of the events (produced messages) and poison topics.
type world struct {
	path   string
	pubsub *gochannel.GoChannel
	events <-chan *message.Message
	poison <-chan *message.Message
	runs   atomic.Int64
	// failFirst makes the handler fail its first run of each UUID in it.
	failFirst sync.Map
}

func newWorld(t *testing.T) *world {
	t.Helper()
	w := &world{path: filepath.Join(t.TempDir(), "ledger.db")}
	db, err := idemsqlite.Open(w.path)
	require.NoError(t, err)
	defer func() { _ = db.Close() }()
	require.NoError(t, idemsqlite.Migrate(t.Context(), db))
	_, err = db.ExecContext(t.Context(), `
		CREATE TABLE accounts (name TEXT PRIMARY KEY, balance INTEGER NOT NULL);
		CREATE TABLE entries (id INTEGER PRIMARY KEY, message_id TEXT NOT NULL, cents INTEGER NOT NULL);
		INSERT INTO accounts VALUES ('alice', 0);`)
	require.NoError(t, err)
	w.pubsub = gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
	t.Cleanup(func() { _ = w.pubsub.Close() })
	w.events, err = w.pubsub.Subscribe(t.Context(), "events")
	require.NoError(t, err)
	w.poison, err = w.pubsub.Subscribe(t.Context(), "poison")
	require.NoError(t, err)
	return w
}

// consumer starts one router (one consumer process, with its own pool)
// whose "ledger" handler credits alice with the payload's cents.
func (w *world) consumer(t *testing.T) *sql.DB {
	t.Helper()
	db, err := idemsqlite.Open(w.path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	store, err := idem.New(idemsqlite.New(db), nil)
	require.NoError(t, err)
	dedup, err := idemwatermill.Middleware(store, nil)
	require.NoError(t, err)
	poison, err := middleware.PoisonQueueWithFilter(w.pubsub, "poison", idemwatermill.IsPermanent)
	require.NoError(t, err)

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(poison, dedup)
	router.AddHandler("ledger", "credits", w.pubsub, "events", w.pubsub, func(msg *message.Message) ([]*message.Message, error) {
		w.runs.Add(1)
		tx, ok := idemwatermill.Tx[*sql.Tx](msg.Context())
		if !ok {
			return nil, errors.New("no transaction")
		}
		var cents int64
		if _, err := fmt.Sscan(string(msg.Payload), &cents); err != nil {
			return nil, err
		}
		ctx := msg.Context()
		if _, err := tx.ExecContext(ctx, `INSERT INTO entries (message_id, cents) VALUES (?, ?)`, msg.UUID, cents); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, `UPDATE accounts SET balance = balance + ? WHERE name = 'alice'`, cents); err != nil {
			return nil, err
		}
		if _, first := w.failFirst.LoadAndDelete(msg.UUID); first {
			return nil, errors.New("downstream hiccup") // rolled back, nacked, redelivered
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("credited "+msg.UUID))}, nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = router.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		_ = router.Close()
		<-done
	})
	<-router.Running()
	return db
}

func (w *world) publish(t *testing.T, uuid, payload string) {
	t.Helper()
	require.NoError(t, w.pubsub.Publish("credits", message.NewMessage(uuid, []byte(payload))))
}

// next returns the next message of ch, acked.
func next(t *testing.T, ch <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case m := <-ch:
		m.Ack()
		return m
	case <-time.After(20 * time.Second):
		t.Fatal("no message")
		return nil
	}
}

func ledger(t *testing.T, db *sql.DB) (balance int64, entries int) {
	t.Helper()
	require.NoError(t, db.QueryRowContext(t.Context(), `SELECT balance FROM accounts`).Scan(&balance))
	require.NoError(t, db.QueryRowContext(t.Context(), `SELECT count(*) FROM entries`).Scan(&entries))
	return balance, entries
}

func TestRedeliveryReplays(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	db := w.consumer(t)
	w.publish(t, "msg-0001", "500")
	first := next(t, w.events)
	w.publish(t, "msg-0001", "500") // redelivered, or published twice
	again := next(t, w.events)
	require.Equal(t, first.UUID, again.UUID, "the replay publishes the stored messages, with their UUIDs")
	require.Equal(t, string(first.Payload), string(again.Payload))
	require.EqualValues(t, 1, w.runs.Load())
	bal, n := ledger(t, db)
	require.EqualValues(t, 500, bal)
	require.Equal(t, 1, n)
}

func TestFailureRollsBackAndRedelivers(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	db := w.consumer(t)
	w.failFirst.Store("msg-0001", true)
	w.publish(t, "msg-0001", "500")
	next(t, w.events)
	require.EqualValues(t, 2, w.runs.Load(), "the nack redelivered the message and the handler ran again")
	bal, n := ledger(t, db)
	require.EqualValues(t, 500, bal, "the failed run's writes were rolled back")
	require.Equal(t, 1, n)
}

func TestChangedPayloadPoisoned(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	db := w.consumer(t)
	w.publish(t, "msg-0001", "500")
	next(t, w.events)
	w.publish(t, "msg-0001", "50000")
	p := next(t, w.poison)
	require.Equal(t, "msg-0001", p.UUID)
	require.Equal(t, "50000", string(p.Payload))
	require.Contains(t, p.Metadata.Get(middleware.ReasonForPoisonedKey), "key reused with a different request")
	bal, n := ledger(t, db)
	require.EqualValues(t, 500, bal, "a changed payload is not applied")
	require.Equal(t, 1, n)
}

// Two routers with pools of their own, subscribed to the same topic: the
// Pub/Sub hands every message to both, and each is applied once.
func TestTwoConsumers(t *testing.T) {
	t.Parallel()
	w := newWorld(t)
	db := w.consumer(t)
	w.consumer(t)
	const n = 10
	for i := range n {
		w.publish(t, fmt.Sprintf("msg-%04d", i), "10")
	}
	byUUID := map[string]int{}
	for range 2 * n { // each consumer publishes each message's result
		byUUID[string(next(t, w.events).Payload)]++
	}
	require.Len(t, byUUID, n)
	for k, v := range byUUID {
		require.Equal(t, 2, v, k)
	}
	require.EqualValues(t, n, w.runs.Load(), "the handler ran once per message")
	bal, entries := ledger(t, db)
	require.EqualValues(t, 10*n, bal)
	require.Equal(t, n, entries)
}
