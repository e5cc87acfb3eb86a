package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

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

// ExampleStore_Acquire shows leased processing for work with an outside
// side effect: the claim commits before the payment provider is called, the
// completion is fenced by the lease's token, and a status check settles a
// holder that crashed between the charge and the completion.
func ExampleStore_Acquire() {
	db, cleanup := openExampleDB()
	defer cleanup()
	ctx := context.Background()

	// A fake payment provider that, like real ones, remembers charges by
	// idempotency key.
	charges := map[string]int{}
	charge := func(key string, cents int) { charges[key] = cents }

	// The status check answers from the provider's records, never from time.
	check := func(ctx context.Context, rec idem.Record) (idem.Verdict, error) {
		cents, ok := charges[rec.Key]
		if !ok {
			return idem.NotCommitted(), nil
		}
		return idem.Committed(&idem.Response{StatusCode: 200, Body: fmt.Appendf(nil, `{"charged": %d}`, cents)}), nil
	}
	clock := time.Date(2030, 1, 1, 12, 0, 0, 0, time.UTC) // a pinned clock, to skip the wait
	store, err := idem.New(idemsqlite.New(db), &idem.Config{
		LeaseDuration: 30 * time.Second,
		StatusCheck:   check,
		Now:           func() time.Time { return clock },
	})
	if err != nil {
		log.Fatal(err)
	}
	fp := idem.NewFingerprint([]byte(`{"charge": 500}`))

	// First attempt: acquire, charge, and crash before completing.
	lease, err := store.Acquire(ctx, "tenant-42/charge", "key-9d00e1", fp)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("attempt", lease.Attempt(), "acquired:", lease.Acquired())
	charge("key-9d00e1", 500)

	// The client retries after the lease ran out: the check finds the charge.
	clock = clock.Add(time.Minute)
	retry, err := store.Acquire(ctx, "tenant-42/charge", "key-9d00e1", fp)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("retry acquired:", retry.Acquired(), "replay:", string(retry.Replay.Response.Body))

	// The crashed holder wakes up: its completion is fenced.
	err = lease.Complete(ctx, &idem.Response{StatusCode: 200})
	fmt.Println("late completion fenced:", errors.Is(err, idem.ErrFenced))

	// A normal leased request: acquire, keep the lease alive, call out,
	// complete inside the business transaction.
	next, err := store.Acquire(ctx, "tenant-42/charge", "key-51c7aa", fp)
	if err != nil {
		log.Fatal(err)
	}
	workCtx, stop := next.KeepAlive(ctx)
	_ = workCtx // pass it to the provider call, which stops if the lease is lost
	charge("key-51c7aa", 500)
	if err := stop(); err != nil {
		log.Fatal(err) // the lease was lost: do not complete
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback()
	if err := next.CompleteTx(ctx, tx, &idem.Response{StatusCode: 200, Body: []byte(`{"charged": 500}`)}); err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}
	fmt.Println("charges:", len(charges))
	// Output:
	// attempt 1 acquired: true
	// retry acquired: false replay: {"charged": 500}
	// late completion fenced: true
	// charges: 2
}

// ExampleReaper runs the reaper for one pass, as a cron job would; a
// service runs reaper.Run(ctx) in a goroutine instead.
func ExampleReaper() {
	db, cleanup := openExampleDB()
	defer cleanup()
	ctx := context.Background()
	clock := time.Date(2030, 1, 1, 12, 0, 0, 0, time.UTC)
	store, err := idem.New(idemsqlite.New(db), &idem.Config{
		Retention: time.Hour,
		Now:       func() time.Time { return clock },
	})
	if err != nil {
		log.Fatal(err)
	}
	for _, key := range []string{"key-a1", "key-b2", "key-c3"} {
		_, err := store.Do(ctx, "tenant-42/create-order", key, idem.NewFingerprint([]byte(key)),
			func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
				return &idem.Response{StatusCode: 201}, nil
			})
		if err != nil {
			log.Fatal(err)
		}
	}
	clock = clock.Add(2 * time.Hour) // past retention

	reaper, err := idem.NewReaper(store, &idem.ReaperConfig{BatchSize: 2})
	if err != nil {
		log.Fatal(err)
	}
	report, err := reaper.RunOnce(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("deleted %d expired records\n", report.Deleted)
	// Output:
	// deleted 3 expired records
}

// ExampleReplayCacheConfig turns on the in-process replay cache: the retry
// is answered from memory, without a round trip to the database.
func ExampleReplayCacheConfig() {
	db, cleanup := openExampleDB()
	defer cleanup()
	ctx := context.Background()

	store, err := idem.New(idemsqlite.New(db), &idem.Config{
		ReplayCache: &idem.ReplayCacheConfig{MaxEntries: 50_000, MaxAge: 30 * time.Second},
	})
	if err != nil {
		log.Fatal(err)
	}
	fp := idem.NewFingerprint([]byte(`{"amount": 4200}`))
	createOrder := func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
		if _, err := tx.ExecContext(ctx, `INSERT INTO orders (amount) VALUES (?)`, 4200); err != nil {
			return nil, err
		}
		return &idem.Response{StatusCode: 201, Body: []byte(`{"status": "created"}`)}, nil
	}
	if _, err := store.Do(ctx, "tenant-42/create-order", "key-cache-1", fp, createOrder); err != nil {
		log.Fatal(err)
	}
	_ = db.Close() // the retry below does not need the database

	res, err := store.Do(ctx, "tenant-42/create-order", "key-cache-1", fp, createOrder)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(res.Response.StatusCode, string(res.Response.Body), "replayed:", res.Replayed)
	// Output:
	// 201 {"status": "created"} replayed: true
}
