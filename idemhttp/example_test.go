package idemhttp_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// Example wires the middleware onto one route of a ServeMux, on SQLite. The
// handler writes the order on the transaction the key is claimed in; the
// retry is answered from the store.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "idemhttp-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	db, err := idemsqlite.Open(filepath.Join(dir, "shop.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if err := idemsqlite.Migrate(ctx, db); err != nil {
		log.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	store, err := idem.New(idemsqlite.New(db), nil)
	if err != nil {
		log.Fatal(err)
	}

	mw := idemhttp.New(store, &idemhttp.Config{
		Tenant: func(r *http.Request) (string, error) { return r.Header.Get("X-Tenant-ID"), nil },
	})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := idemhttp.Tx[*sql.Tx](r.Context())
		res, err := tx.ExecContext(r.Context(), `INSERT INTO orders (amount) VALUES (4200)`)
		if err != nil {
			http.Error(w, "no order", http.StatusInternalServerError) // rolled back, key free
			return
		}
		id, _ := res.LastInsertId()
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for _, body := range []string{`{"amount": 4200}`, `{ "amount":4200 }`, `{"amount": 1}`} {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Tenant-ID", "acme")
		req.Header.Set("Idempotency-Key", "order-0001-example")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
		fmt.Printf("%d location=%q replayed=%t\n", resp.StatusCode, resp.Header.Get("Location"), resp.Header.Get("Idempotency-Replayed") == "true")
	}
	var n int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n)
	fmt.Println("orders:", n)
	// Output:
	// 201 location="/orders/1" replayed=false
	// 201 location="/orders/1" replayed=true
	// 409 location="" replayed=false
	// orders: 1
}
