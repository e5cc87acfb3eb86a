//go:build faults

package faults

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/testdb"
	idemmysql "github.com/idemstore/idem/mysql"
)

// TestWireMySQLReadTimeout checks what mysql/doc.go and docs/dialects.md
// recommend: with the DSN's readTimeout, a connection that goes half-open at
// the COMMIT fails the request after readTimeout, as ErrStoreUnavailable,
// instead of holding it until the connection dies (database/sql's
// Tx.Commit takes no context, so the request's deadline cannot). Without
// readTimeout, the same stall holds Do for the whole stall: the contrast
// shows the setting, not the stall, decides.
func TestWireMySQLReadTimeout(t *testing.T) {
	const stall = 6 * time.Second
	cases := []struct {
		name        string
		readTimeout time.Duration
		// returned bounds how long Do may take, from its start.
		atLeast, atMost time.Duration
	}{
		{"with_readTimeout", time.Second, 900 * time.Millisecond, stall - time.Second},
		{"without", 0, stall - 500*time.Millisecond, 3 * stall},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx := t.Context()
			mcfg := inprocMySQLConfig(t, testdb.MySQLDSN(t, inprocMySQLAddr))
			admin := inprocMySQLDB(t, mcfg, 1)
			name := testdb.Name()
			if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
				t.Fatalf("create database: %v", err)
			}
			t.Cleanup(func() {
				cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				_, _ = admin.ExecContext(cctx, "DROP DATABASE IF EXISTS "+name)
			})
			proxy := newWireProxy(t, wireMySQL, mcfg.Addr)
			scfg := mcfg.Clone()
			scfg.DBName = name
			scfg.Addr = proxy.Addr()
			scfg.ReadTimeout = c.readTimeout
			scfg.WriteTimeout = c.readTimeout
			db := inprocMySQLDB(t, scfg, 2)
			if err := idemmysql.Migrate(ctx, db); err != nil {
				t.Fatalf("migrate: %v", err)
			}
			if _, err := db.ExecContext(ctx, inprocMySQLOrders); err != nil {
				t.Fatalf("create orders: %v", err)
			}
			store, err := idem.New(idemmysql.New(db), &idem.Config{WaitTimeout: time.Second})
			if err != nil {
				t.Fatalf("idem.New: %v", err)
			}

			key := inprocNewKey("readtimeout")
			fired := proxy.Arm(wireRule{Fault: wireStall, Marker: key, AtCommit: true, Stall: stall})
			rctx, cancel := context.WithTimeout(ctx, 2*time.Second) // the request's own deadline
			defer cancel()
			start := time.Now()
			_, err = store.Do(rctx, "acme", key, sha256.Sum256([]byte("order")), func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
				if _, err := tx.ExecContext(ctx, `INSERT INTO orders (tenant, idem_key, amount) VALUES (?, ?, ?)`, "acme", key, 1); err != nil {
					return nil, err
				}
				return &idem.Response{StatusCode: http.StatusCreated}, nil
			})
			took := time.Since(start)
			ev, werr := wireWait(fired, 10*time.Second)
			if werr != nil {
				t.Fatalf("the stall never fired: %v", werr)
			}
			if !ev.AtCommit {
				t.Fatalf("the stall hit before the COMMIT (after %d messages)", ev.Forwarded)
			}
			if err == nil {
				t.Fatalf("Do succeeded through a stalled COMMIT")
			}
			if !errors.Is(err, idem.ErrStoreUnavailable) {
				t.Errorf("Do's error does not match ErrStoreUnavailable: %v", err)
			}
			if took < c.atLeast || took > c.atMost {
				t.Errorf("Do returned after %s, want between %s and %s", took.Round(time.Millisecond), c.atLeast, c.atMost)
			}
			t.Logf("Do returned after %s: %v", took.Round(time.Millisecond), err)

			// The COMMIT reached the server before the stall: the retry,
			// on a healthy connection, replays it and runs nothing.
			proxy.Disarm(key)
			ran := false
			res, err := store.Do(ctx, "acme", key, sha256.Sum256([]byte("order")), func(context.Context, *sql.Tx) (*idem.Response, error) {
				ran = true
				return &idem.Response{StatusCode: http.StatusCreated}, nil
			})
			if err != nil || ran || !res.Replayed {
				t.Errorf("retry: err %v, ran %v, result %+v; want the replay", err, ran, res)
			}
			var orders int
			if err := db.QueryRowContext(ctx, "SELECT count(*) FROM orders").Scan(&orders); err != nil || orders != 1 {
				t.Errorf("orders: %d (%v), want 1", orders, err)
			}
		})
	}
}
