package idemecho_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemecho"
	"github.com/idemstore/idem/idemhttp"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// Example protects an echo route on SQLite: the order is written on the
// transaction the key is claimed in, a retry is replayed, and a refusal the
// handler returns as an error passes through, rolled back.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "idemecho-example-")
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
	mw, err := idemhttp.New(store, &idemhttp.Config{Operation: idemecho.Operation})
	if err != nil {
		log.Fatal(err)
	}

	e := echo.New()
	g := e.Group("/v1", idemecho.Middleware(mw.Wrap))
	g.POST("/orders", func(c echo.Context) error {
		var in struct {
			Amount int `json:"amount"`
		}
		if err := c.Bind(&in); err != nil || in.Amount <= 0 {
			return echo.NewHTTPError(http.StatusUnprocessableEntity, "amount must be positive")
		}
		tx, _ := mw.Tx(c.Request().Context()) // a *sql.Tx, typed by the store
		res, err := tx.ExecContext(c.Request().Context(), `INSERT INTO orders (amount) VALUES (?)`, in.Amount)
		if err != nil {
			return err // echo's 500, rolled back, the key stays free
		}
		id, _ := res.LastInsertId()
		return c.JSON(http.StatusCreated, map[string]int64{"id": id})
	})
	srv := httptest.NewServer(e)
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
