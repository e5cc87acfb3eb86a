package idemgin_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	"github.com/gin-gonic/gin"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemgin"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// Example protects a gin route group on SQLite: the order is written on the
// transaction the key is claimed in, a retry is replayed, and a refusal
// passes through, rolled back.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "idemgin-example-")
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
	mw, err := idemgin.New(store, nil)
	if err != nil {
		log.Fatal(err)
	}

	gin.SetMode(gin.ReleaseMode)
	engine := gin.New()
	v1 := engine.Group("/v1", mw.Handler())
	v1.POST("/orders", func(c *gin.Context) {
		var in struct {
			Amount int `json:"amount"`
		}
		if err := c.ShouldBindJSON(&in); err != nil || in.Amount <= 0 {
			c.JSON(http.StatusUnprocessableEntity, gin.H{"error": "amount must be positive"}) // rolled back, key free
			return
		}
		tx, _ := mw.Tx(c) // a *sql.Tx, typed by the store
		res, err := tx.ExecContext(c.Request.Context(), `INSERT INTO orders (amount) VALUES (?)`, in.Amount)
		if err != nil {
			c.JSON(http.StatusInternalServerError, gin.H{"error": "no order"})
			return
		}
		id, _ := res.LastInsertId()
		c.JSON(http.StatusCreated, gin.H{"id": id})
	})
	srv := httptest.NewServer(engine)
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
