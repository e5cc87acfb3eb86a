package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemstore/idem"
	idempg "github.com/idemstore/idem/postgres"
)

// Example wires idem into a pgx application: migrate at start-up, then claim
// the key inside the transaction that writes the order, so the order and the
// stored response commit together or not at all.
func Example() {
	ctx := context.Background()
	// default_query_exec_mode=exec also works through PgBouncer in
	// transaction pooling mode; WithSchema names the schema of
	// idempotency_keys in every statement, whatever the search_path.
	pool, err := pgxpool.New(ctx, "postgres://app@127.0.0.1:5432/app?default_query_exec_mode=exec")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	schema := idempg.WithSchema("public")
	if err := idempg.Migrate(ctx, pool, schema); err != nil {
		log.Fatal(err)
	}
	store, err := idem.New(idempg.New(pool, schema), nil) // *idem.Store[pgx.Tx]
	if err != nil {
		log.Fatal(err)
	}

	body := []byte(`{"sku":"A-1","qty":2}`)
	resp, err := createOrder(ctx, pool, store, "tenant-7/orders", "9b2f6c1e-key", body)
	var inProgress *idem.InProgressError
	switch {
	case errors.As(err, &inProgress):
		fmt.Println("409, Retry-After", inProgress.RetryAfter)
	case errors.Is(err, idem.ErrFingerprint):
		fmt.Println("422: key reused with another request")
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
func createOrder(ctx context.Context, pool *pgxpool.Pool, store *idem.Store[pgx.Tx], scope, key string, body []byte) (*idem.Response, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback(ctx) }() // a no-op after Commit

	claim, err := store.ClaimTx(ctx, tx, scope, key, idem.NewFingerprint([]byte("POST /orders"), body))
	if err != nil {
		return nil, err // on PostgreSQL the transaction is aborted: the deferred Rollback ends it
	}
	if !claim.Acquired() {
		return claim.Replay.Response, nil
	}

	var id int64
	if err := tx.QueryRow(ctx, `INSERT INTO orders (body) VALUES ($1) RETURNING id`, body).Scan(&id); err != nil {
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
	return resp, tx.Commit(ctx)
}

// ExampleNew_pgBouncer configures a pool for PgBouncer in transaction pooling
// mode: the simple protocol needs no server-side prepared statements, and
// idem's statements carry explicit casts so they work under it unchanged.
func ExampleNew_pgBouncer() {
	cfg, err := pgxpool.ParseConfig("postgres://app@127.0.0.1:6432/app")
	if err != nil {
		log.Fatal(err)
	}
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	// Run Migrate on a direct connection instead: its advisory lock is
	// session-level, which transaction pooling does not preserve.
	store, err := idem.New(idempg.New(pool), nil)
	if err != nil {
		log.Fatal(err)
	}
	_ = store
}
