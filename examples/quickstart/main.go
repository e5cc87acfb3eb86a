// Command quickstart shows idem on an embedded SQLite file: twenty
// concurrent copies of one "create order" request, a retry after the fact, a
// retry that changed the request, and a failed attempt that is retried.
//
//	go run ./examples/quickstart
package main

import (
	"context"
	"database/sql"
	"errors"
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

func run(ctx context.Context) error {
	dir, err := os.MkdirTemp("", "idem-quickstart-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	db, err := idemsqlite.Open(filepath.Join(dir, "shop.db"))
	if err != nil {
		return err
	}
	defer db.Close()
	if err := idemsqlite.Migrate(ctx, db); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		return err
	}
	store, err := idem.New(idemsqlite.New(db), nil)
	if err != nil {
		return err
	}

	createOrder := func(amount int) func(context.Context, *sql.Tx) (*idem.Response, error) {
		return func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
			res, err := tx.ExecContext(ctx, `INSERT INTO orders (amount) VALUES (?)`, amount)
			if err != nil {
				return nil, err
			}
			id, err := res.LastInsertId()
			if err != nil {
				return nil, err
			}
			return &idem.Response{StatusCode: 201, Body: fmt.Appendf(nil, `{"order_id":%d,"amount":%d}`, id, amount)}, nil
		}
	}
	request := func(amount int) idem.Fingerprint {
		return idem.NewFingerprint(fmt.Appendf(nil, `{"amount":%d}`, amount))
	}
	const scope = "tenant-42/create-order"

	fmt.Println("1. Twenty concurrent copies of one request (same Idempotency-Key):")
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		outcomes = map[string]int{}
	)
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := store.Do(ctx, scope, "order-key-0001", request(4200), createOrder(4200))
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err != nil:
				outcomes["error: "+err.Error()]++
			case res.Replayed:
				outcomes["replayed "+string(res.Response.Body)]++
			default:
				outcomes["executed "+string(res.Response.Body)]++
			}
		}()
	}
	wg.Wait()
	for outcome, n := range outcomes {
		fmt.Printf("   %2d × %s\n", n, outcome)
	}
	fmt.Println("   orders in the table:", countOrders(ctx, db))

	fmt.Println("2. The client retries after a timeout:")
	res, err := store.Do(ctx, scope, "order-key-0001", request(4200), createOrder(4200))
	if err != nil {
		return err
	}
	fmt.Printf("   %d %s (replayed: %t)\n", res.Response.StatusCode, res.Response.Body, res.Replayed)

	fmt.Println("3. The client reuses the key for a different amount:")
	_, err = store.Do(ctx, scope, "order-key-0001", request(1), createOrder(1))
	fmt.Printf("   conflict: %t (%v)\n", errors.Is(err, idem.ErrFingerprint), err)

	fmt.Println("4. An attempt fails and rolls back; the retry runs again:")
	declined := errors.New("payment declined")
	_, err = store.Do(ctx, scope, "order-key-0002", request(990), func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
		if _, err := createOrder(990)(ctx, tx); err != nil {
			return nil, err
		}
		return nil, declined
	})
	fmt.Printf("   first attempt: %v\n", err)
	res, err = store.Do(ctx, scope, "order-key-0002", request(990), createOrder(990))
	if err != nil {
		return err
	}
	fmt.Printf("   retry: %d %s (replayed: %t)\n", res.Response.StatusCode, res.Response.Body, res.Replayed)
	fmt.Println("   orders in the table:", countOrders(ctx, db))
	return nil
}

func countOrders(ctx context.Context, db *sql.DB) int {
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	return n
}
