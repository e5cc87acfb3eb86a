package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/idemstore/idem"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// openExampleDB opens a migrated SQLite database in a temporary directory
// with an orders table, and returns it with a cleanup function.
func openExampleDB() (*sql.DB, func()) {
	dir, err := os.MkdirTemp("", "idem-example-")
	if err != nil {
		log.Fatal(err)
	}
	db, err := idemsqlite.Open(filepath.Join(dir, "shop.db"))
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	if err := idemsqlite.Migrate(ctx, db); err != nil {
		log.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	return db, func() { _ = db.Close(); _ = os.RemoveAll(dir) }
}

// Example shows the whole flow with Do: the first request runs the business
// transaction and stores its response; the retry gets the same response
// without creating a second order.
func Example() {
	db, cleanup := openExampleDB()
	defer cleanup()
	ctx := context.Background()

	store, err := idem.New(idemsqlite.New(db), nil)
	if err != nil {
		log.Fatal(err)
	}

	body := []byte(`{"amount": 4200}`)
	createOrder := func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
		res, err := tx.ExecContext(ctx, `INSERT INTO orders (amount) VALUES (?)`, 4200)
		if err != nil {
			return nil, err
		}
		id, _ := res.LastInsertId()
		return &idem.Response{StatusCode: 201, Body: fmt.Appendf(nil, `{"order_id": %d}`, id)}, nil
	}

	for range 2 { // a client retrying after a timeout
		res, err := store.Do(ctx, "tenant-42/create-order", "key-5f2b9c", idem.NewFingerprint(body), createOrder)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(res.Response.StatusCode, string(res.Response.Body), "replayed:", res.Replayed)
	}

	var orders int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&orders)
	fmt.Println("orders:", orders)

	// The same key with a different request is a conflict, not a replay.
	_, err = store.Do(ctx, "tenant-42/create-order", "key-5f2b9c", idem.NewFingerprint([]byte(`{"amount": 1}`)), createOrder)
	fmt.Println(errors.Is(err, idem.ErrFingerprint))

	// Output:
	// 201 {"order_id": 1} replayed: false
	// 201 {"order_id": 1} replayed: true
	// orders: 1
	// true
}

// ExampleStore_ClaimTx claims the key inside the caller's own transaction:
// the stored response commits together with the order, or neither does.
func ExampleStore_ClaimTx() {
	db, cleanup := openExampleDB()
	defer cleanup()
	ctx := context.Background()
	store, err := idem.New(idemsqlite.New(db), nil)
	if err != nil {
		log.Fatal(err)
	}

	handle := func(key string, fp idem.Fingerprint) (*idem.Response, bool, error) {
		tx, err := db.BeginTx(ctx, nil) // BEGIN IMMEDIATE through idemsqlite.Open
		if err != nil {
			return nil, false, err
		}
		defer tx.Rollback() // no-op after Commit

		claim, err := store.ClaimTx(ctx, tx, "tenant-42/create-order", key, fp)
		if err != nil {
			return nil, false, err
		}
		if !claim.Acquired() {
			return claim.Replay.Response, true, nil
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO orders (amount) VALUES (?)`, 990); err != nil {
			return nil, false, err
		}
		resp := &idem.Response{StatusCode: 201, Body: []byte(`{"status":"created"}`)}
		if err := store.CompleteTx(ctx, tx, claim, resp); err != nil {
			return nil, false, err
		}
		return resp, false, tx.Commit()
	}

	fp := idem.NewFingerprint([]byte("POST /orders"), []byte(`{"amount": 990}`))
	for range 2 {
		resp, replayed, err := handle("key-0c41d7", fp)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(resp.StatusCode, string(resp.Body), "replayed:", replayed)
	}
	// Output:
	// 201 {"status":"created"} replayed: false
	// 201 {"status":"created"} replayed: true
}

// ExampleStore_Claim commits the claim before work with an outside side
// effect, such as a call to a payment provider, then stores the outcome. A
// concurrent duplicate sees the key in progress instead of charging twice.
func ExampleStore_Claim() {
	db, cleanup := openExampleDB()
	defer cleanup()
	ctx := context.Background()
	store, err := idem.New(idemsqlite.New(db), nil)
	if err != nil {
		log.Fatal(err)
	}
	fp := idem.NewFingerprint([]byte(`{"charge": 500}`))

	claim, err := store.Claim(ctx, "tenant-42/charge", "key-77aa01", fp)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("acquired:", claim.Acquired())

	// A duplicate arriving while the charge runs.
	_, err = store.Claim(ctx, "tenant-42/charge", "key-77aa01", fp)
	var inProgress *idem.InProgressError
	if errors.As(err, &inProgress) {
		fmt.Println("duplicate: in progress, retry within", inProgress.RetryAfter <= 30e9)
	}

	// ... call the payment provider ...
	if err := store.Complete(ctx, claim, &idem.Response{StatusCode: 200, Body: []byte(`{"charged": 500}`)}); err != nil {
		log.Fatal(err)
	}

	again, err := store.Claim(ctx, "tenant-42/charge", "key-77aa01", fp)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("retry replays:", string(again.Replay.Response.Body))
	// Output:
	// acquired: true
	// duplicate: in progress, retry within true
	// retry replays: {"charged": 500}
}
