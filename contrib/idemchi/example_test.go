package idemchi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	"github.com/go-chi/chi/v5"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemchi"
	"github.com/idemstore/idem/idemhttp"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// Example protects the routes of a chi subrouter on SQLite: the order is
// written on the transaction the key is claimed in, a retry is replayed,
// and a refusal passes through, rolled back.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "idemchi-example-")
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
	mw, err := idemhttp.New(store, &idemhttp.Config{Operation: idemchi.Operation})
	if err != nil {
		log.Fatal(err)
	}

	r := chi.NewRouter()
	r.Route("/v1", func(r chi.Router) {
		r.Use(mw.Wrap) // the operation is "POST /v1/orders", not the mount's "/v1/*"
		r.Post("/orders", func(w http.ResponseWriter, r *http.Request) {
			var in struct {
				Amount int `json:"amount"`
			}
			if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Amount <= 0 {
				http.Error(w, "amount must be positive", http.StatusUnprocessableEntity) // rolled back, key free
				return
			}
			tx, _ := mw.Tx(r.Context()) // a *sql.Tx, typed by the store
			res, err := tx.ExecContext(r.Context(), `INSERT INTO orders (amount) VALUES (?)`, in.Amount)
			if err != nil {
				http.Error(w, "no order", http.StatusInternalServerError)
				return
			}
			id, _ := res.LastInsertId()
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"id":%d}`, id)
		})
	})
	srv := httptest.NewServer(r)
	defer srv.Close()

	for _, s := range []struct{ key, body string }{
		{"order-0001-example", `{"amount": 4200}`},
		{"order-0001-example", `{"amount": 4200}`},
		{"order-0002-example", `{"amount": 0}`},
	} {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/orders", strings.NewReader(s.body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", s.key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
		fmt.Printf("%d replayed=%t\n", resp.StatusCode, resp.Header.Get("Idempotency-Replayed") == "true")
	}
	var n int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n)
	fmt.Println("orders:", n)
	// Output:
	// 201 replayed=false
	// 201 replayed=true
	// 422 replayed=false
	// orders: 1
}
