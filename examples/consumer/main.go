// Command consumer deduplicates an at-least-once message consumer with idem
// on an embedded SQLite file: a ledger that credits accounts from messages,
// keyed by message ID. It shows a redelivery that replays, two consumers
// (two connection pools, as two processes would have) that receive the same
// message at once and apply it once, a changed payload under a known ID that
// is reported and not applied, and a rejection that is recorded once.
//
//	go run ./examples/consumer
//
// docs/integrations.md ("Message consumers") explains the recipe.
package main

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"sync"

	"github.com/idemstore/idem"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

func main() {
	if err := run(context.Background()); err != nil {
		log.Fatal(err)
	}
}

// ledger is one consumer process: its pool on the shared database file.
type ledger struct {
	db       *sql.DB
	consumer *Consumer
}

func openLedger(path string) (*ledger, error) {
	db, err := idemsqlite.Open(path)
	if err != nil {
		return nil, err
	}
	store, err := idem.New(idemsqlite.New(db), nil)
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	c, err := NewConsumer(store, "ledger")
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	return &ledger{db: db, consumer: c}, nil
}

// setupDB migrates idem's table and creates the ledger's tables.
func setupDB(ctx context.Context, path string) error {
	db, err := idemsqlite.Open(path)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := idemsqlite.Migrate(ctx, db); err != nil {
		return err
	}
	_, err = db.ExecContext(ctx, `
		CREATE TABLE accounts (name TEXT PRIMARY KEY, balance INTEGER NOT NULL);
		CREATE TABLE entries (id INTEGER PRIMARY KEY, message_id TEXT NOT NULL, account TEXT NOT NULL, cents INTEGER NOT NULL);
		INSERT INTO accounts VALUES ('alice', 0), ('bob', 0);`)
	return err
}

func (l *ledger) balance(ctx context.Context, account string) (int64, error) {
	var b int64
	err := l.db.QueryRowContext(ctx, `SELECT balance FROM accounts WHERE name = ?`, account).Scan(&b)
	return b, err
}

func run(ctx context.Context) error {
	dir, err := os.MkdirTemp("", "idem-consumer-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "ledger.db")
	if err := setupDB(ctx, path); err != nil {
		return err
	}
	a, err := openLedger(path)
	if err != nil {
		return err
	}
	defer a.db.Close()
	b, err := openLedger(path)
	if err != nil {
		return err
	}
	defer b.db.Close()

	show := func(who string, m Message, h *Handled, err error) {
		act, _ := Decide(err)
		if err != nil {
			fmt.Printf("  %s %s: %v -> %s\n", who, m.ID, err, act)
			return
		}
		replayed := ""
		if h.Replayed {
			replayed = " (replayed)"
		}
		fmt.Printf("  %s %s: %s%s %s -> %s\n", who, m.ID, h.Outcome, replayed, h.Result, act)
	}

	fmt.Println("1. A credit is delivered, its ack is lost, and the queue delivers it again:")
	m1 := Message{ID: "msg-0001", Payload: []byte(`{"account":"alice","cents":500}`)}
	for range 2 {
		h, err := a.consumer.Handle(ctx, m1)
		show("consumer A", m1, h, err)
	}

	fmt.Println("2. Two consumers receive the same message at the same time:")
	m2 := Message{ID: "msg-0002", Payload: []byte(`{"account":"alice","cents":300}`)}
	var wg sync.WaitGroup
	var mu sync.Mutex
	for who, l := range map[string]*ledger{"consumer A": a, "consumer B": b} {
		wg.Go(func() {
			h, err := l.consumer.Handle(ctx, m2)
			mu.Lock()
			defer mu.Unlock()
			show(who, m2, h, err)
		})
	}
	wg.Wait()

	fmt.Println("3. A message reuses msg-0001 with another payload:")
	changed := Message{ID: "msg-0001", Payload: []byte(`{"account":"alice","cents":50000}`)}
	h, err := b.consumer.Handle(ctx, changed)
	show("consumer B", changed, h, err)

	fmt.Println("4. A credit for an unknown account, delivered twice:")
	m4 := Message{ID: "msg-0004", Payload: []byte(`{"account":"carol","cents":100}`)}
	for range 2 {
		h, err := a.consumer.Handle(ctx, m4)
		show("consumer A", m4, h, err)
	}

	bal, err := a.balance(ctx, "alice")
	if err != nil {
		return err
	}
	var entries int
	if err := a.db.QueryRowContext(ctx, `SELECT count(*) FROM entries`).Scan(&entries); err != nil {
		return err
	}
	fmt.Printf("alice's balance: %d cents from %d entries (expected 800 from 2)\n", bal, entries)
	if bal != 800 || entries != 2 {
		return fmt.Errorf("a message was applied twice or lost: balance %d, %d entries", bal, entries)
	}
	return nil
}
