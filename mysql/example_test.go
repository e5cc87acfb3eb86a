package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"
	"net/http"

	"github.com/go-sql-driver/mysql"

	"github.com/idemstore/idem"
	idemmysql "github.com/idemstore/idem/mysql"
)

// ExampleNewConnector opens the pool through idem's connector: on MariaDB,
// every Store.Do (and every request of idemhttp's middleware) then sends
// START TRANSACTION with its claim and COMMIT with its completion, two round
// trips fewer. Everything else on the pool is the driver's. It needs a
// server, so it only compiles here.
func ExampleNewConnector() {
	cfg, err := mysql.ParseDSN("app@tcp(127.0.0.1:3306)/app?parseTime=true&readTimeout=30s&writeTimeout=30s")
	if err != nil {
		log.Fatal(err)
	}
	connector, err := idemmysql.NewConnector(cfg) // turns interpolateParams on
	if err != nil {
		log.Fatal(err)
	}
	db := sql.OpenDB(connector)
	defer db.Close()
	store, err := idem.New(idemmysql.New(db), nil)
	if err != nil {
		log.Fatal(err)
	}
	_ = store
}

// ExampleWithOptimisticDo makes Store.Do claim a free key with a plain read
// and complete with one insert, for a service whose requests rarely share a
// key at the same moment: two that do both run the callback, and the one
// that commits second is rolled back and replays the first. It needs a
// server, so it only compiles here.
func ExampleWithOptimisticDo() {
	cfg, err := mysql.ParseDSN("app@tcp(127.0.0.1:3306)/app?parseTime=true&readTimeout=30s&writeTimeout=30s")
	if err != nil {
		log.Fatal(err)
	}
	connector, err := idemmysql.NewConnector(cfg) // the read with START TRANSACTION, the insert with COMMIT
	if err != nil {
		log.Fatal(err)
	}
	db := sql.OpenDB(connector)
	defer db.Close()
	store, err := idem.New(idemmysql.New(db, idemmysql.WithOptimisticDo()), nil)
	if err != nil {
		log.Fatal(err)
	}
	res, err := store.Do(context.Background(), "tenant-1/orders", "key-from-the-client", idem.Fingerprint{},
		func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
			// Writes through tx only: the callback may run in two overlapping
			// calls, and only one of them commits.
			if _, err := tx.ExecContext(ctx, "INSERT INTO orders (ref) VALUES (?)", "key-from-the-client"); err != nil {
				return nil, err
			}
			return &idem.Response{StatusCode: 201, Body: []byte(`{"ok":true}`)}, nil
		})
	if err != nil {
		log.Fatal(err)
	}
	_ = res.Replayed
}

// Example wires idem into a database/sql application on MySQL or MariaDB:
// migrate at start-up, then claim the key inside the transaction that writes
// the order, so the order and the stored response commit together or not at
// all. It needs a server, so it only compiles here.
func Example() {
	ctx := context.Background()

	cfg := mysql.NewConfig() // Loc defaults to UTC, which idem needs
	cfg.User = "app"
	cfg.Net = "tcp"
	cfg.Addr = "127.0.0.1:3306"
	cfg.DBName = "app"
	cfg.ParseTime = true         // required: DATETIME columns scan into time.Time
	cfg.InterpolateParams = true // recommended: no prepare round trip per statement
	connector, err := mysql.NewConnector(cfg)
	if err != nil {
		log.Fatal(err)
	}
	db := sql.OpenDB(connector)
	defer db.Close()

	// Safe to run from every instance at start-up: concurrent calls take turns.
	if err := idemmysql.Migrate(ctx, db); err != nil {
		log.Fatal(err)
	}
	store, err := idem.New(idemmysql.New(db), nil) // *idem.Store[*sql.Tx]
	if err != nil {
		log.Fatal(err)
	}

	body := []byte(`{"sku":"A-1","qty":2}`)
	resp, err := createOrder(ctx, db, store, "tenant-7/orders", "9b2f6c1e-key", body)
	var inProgress *idem.InProgressError
	switch {
	case errors.As(err, &inProgress):
		fmt.Println("409, Retry-After", inProgress.RetryAfter)
	case errors.Is(err, idem.ErrFingerprint):
		fmt.Println("422: key reused with another request")
	case errors.Is(err, idem.ErrRetryable):
		fmt.Println("deadlock: run the transaction again (Store.Do does so by itself)")
	case errors.Is(err, idem.ErrStoreUnavailable):
		fmt.Println("503: refuse rather than run unprotected")
	case err != nil:
		log.Fatal(err)
	default:
		fmt.Println(resp.StatusCode, string(resp.Body))
	}
}

// createOrder runs one request: a replay returns the stored response, a new
// key writes the order and its response in one transaction.
func createOrder(ctx context.Context, db *sql.DB, store *idem.Store[*sql.Tx], scope, key string, body []byte) (*idem.Response, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback() }() // a no-op after Commit

	claim, err := store.ClaimTx(ctx, tx, scope, key, idem.NewFingerprint([]byte("POST /orders"), body))
	if err != nil {
		return nil, err // the deferred Rollback ends the transaction
	}
	if !claim.Acquired() {
		return claim.Replay.Response, nil
	}

	res, err := tx.ExecContext(ctx, `INSERT INTO orders (body) VALUES (?)`, body)
	if err != nil {
		return nil, err
	}
	id, err := res.LastInsertId()
	if err != nil {
		return nil, err
	}
	resp := &idem.Response{
		StatusCode: http.StatusCreated,
		Header:     http.Header{"Location": {fmt.Sprintf("/orders/%d", id)}},
		Body:       fmt.Appendf(nil, `{"id":%d}`, id),
	}
	if err := store.CompleteTx(ctx, tx, claim, resp); err != nil {
		return nil, err
	}
	return resp, tx.Commit()
}
