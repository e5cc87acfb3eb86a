package sqlite_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/idemstore/idem"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// Example wires a store to a SQLite file and claims a key inside the
// caller's transaction, so the business row and the stored response commit
// together. SQLite runs in-process, so this example runs as a test.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "idem-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	db, err := idemsqlite.Open(filepath.Join(dir, "app.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if err := idemsqlite.Migrate(ctx, db); err != nil {
		log.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY, ref TEXT NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	store, err := idem.New(idemsqlite.New(db), nil)
	if err != nil {
		log.Fatal(err)
	}

	placeOrder := func(key string) (*idem.Response, bool, error) {
		// BEGIN IMMEDIATE, because db comes from Open.
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return nil, false, err
		}
		defer func() { _ = tx.Rollback() }() // no-op after Commit

		fp := idem.NewFingerprint([]byte("POST /orders"), []byte(`{"item":"book"}`))
		claim, err := store.ClaimTx(ctx, tx, "orders", key, fp)
		if err != nil {
			return nil, false, err
		}
		if !claim.Acquired() {
			return claim.Replay.Response, true, nil
		}
		res, err := tx.ExecContext(ctx, `INSERT INTO orders (ref) VALUES (?)`, "book")
		if err != nil {
			return nil, false, err
		}
		id, err := res.LastInsertId()
		if err != nil {
			return nil, false, err
		}
		resp := &idem.Response{StatusCode: 201, Body: fmt.Appendf(nil, `{"id":%d}`, id)}
		if err := store.CompleteTx(ctx, tx, claim, resp); err != nil {
			return nil, false, err
		}
		return resp, false, tx.Commit()
	}

	for range 2 {
		resp, replayed, err := placeOrder("key-1")
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%d %s replayed=%t\n", resp.StatusCode, resp.Body, replayed)
	}
	var orders int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&orders); err != nil {
		log.Fatal(err)
	}
	fmt.Println("orders:", orders)

	// Output:
	// 201 {"id":1} replayed=false
	// 201 {"id":1} replayed=true
	// orders: 1
}
