package idemhttp_test

import (
	"context"
	"fmt"
	"io"
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

	// The tenant comes from authentication, never from a header the client
	// chooses: a stored response goes to whoever presents its tenant and
	// key. authenticate stands in for real authentication (see
	// docs/security.md) and puts the caller's tenant in the context.
	type tenantKey struct{}
	tokens := map[string]string{"token-of-acme": "acme"} // bearer token -> tenant
	authenticate := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tenant, ok := tokens[strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")]
			if !ok {
				http.Error(w, "unauthenticated", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), tenantKey{}, tenant)))
		})
	}
	mw, err := idemhttp.New(store, &idemhttp.Config{
		Tenant: func(r *http.Request) (string, error) {
			tenant, _ := r.Context().Value(tenantKey{}).(string)
			return tenant, nil // authenticate let no request through without one
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, _ := mw.Tx(r.Context()) // a *sql.Tx: the store's type, checked by the compiler
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
	srv := httptest.NewServer(authenticate(mux))
	defer srv.Close()

	for _, body := range []string{`{"amount": 4200}`, `{ "amount":4200 }`, `{"amount": 1}`} {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer token-of-acme")
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

// Example_leased protects a handler whose effect leaves the database: the
// claim is committed, with a lease, before the handler calls the payment
// provider, and the handler takes the transaction only to record the
// result. The lease is completed in that transaction.
func Example_leased() {
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
	if _, err := db.ExecContext(ctx, `CREATE TABLE payments (id INTEGER PRIMARY KEY, charge TEXT NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	charges := map[string]string{} // the payment provider, deduplicating on the key
	store, err := idem.New(idemsqlite.New(db), &idem.Config{
		// A holder that crashed after its lease: ask the provider.
		StatusCheck: func(_ context.Context, rec idem.Record) (idem.Verdict, error) {
			c, ok := charges[rec.Key]
			if !ok {
				return idem.NotCommitted(), nil // the next attempt charges
			}
			return idem.Committed(&idem.Response{StatusCode: http.StatusCreated,
				Body: fmt.Appendf(nil, `{"charge":%q,"attempt":%d}`, c, rec.Attempt)}), nil
		},
	})
	if err != nil {
		log.Fatal(err)
	}

	mw, err := idemhttp.New(store, &idemhttp.Config{Mode: idemhttp.Leased})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := idemhttp.Key(r.Context())
		lease, _ := mw.Lease(r.Context())
		if _, ok := charges[key]; !ok { // the outside call, with no transaction open
			charges[key] = fmt.Sprintf("ch_%d", len(charges)+1)
		}
		tx, ok := mw.Tx(r.Context()) // begins the transaction
		if !ok {
			http.Error(w, "try again", http.StatusServiceUnavailable) // the lease is released
			return
		}
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO payments (charge) VALUES (?)`, charges[key]); err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge":%q,"attempt":%d}`, charges[key], lease.Attempt())
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for range 2 {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/payments", strings.NewReader(`{"amount": 4200}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "payment-0001-example")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("%d %s replayed=%t\n", resp.StatusCode, body, resp.Header.Get("Idempotency-Replayed") == "true")
	}
	var n int
	_ = db.QueryRowContext(ctx, `SELECT count(*) FROM payments`).Scan(&n)
	fmt.Println("charges:", len(charges), "payments:", n)
	// Output:
	// 201 {"charge":"ch_1","attempt":1} replayed=false
	// 201 {"charge":"ch_1","attempt":1} replayed=true
	// charges: 1 payments: 1
}
