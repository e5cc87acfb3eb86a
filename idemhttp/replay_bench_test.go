package idemhttp_test

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// BenchmarkReplayMiddleware measures the middleware's own work on a replay
// (the request read and fingerprinted, the record read, the stored
// response written), in process, without a network.
func BenchmarkReplayMiddleware(b *testing.B) {
	ctx := context.Background()
	db, err := idemsqlite.Open(filepath.Join(b.TempDir(), "idem.db"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = db.Close() })
	if err := idemsqlite.Migrate(ctx, db); err != nil {
		b.Fatal(err)
	}
	store, err := idem.New(idemsqlite.New(db), &idem.Config{ReplayRead: idem.ReplayReadAlways})
	if err != nil {
		b.Fatal(err)
	}
	mw, err := idemhttp.New(store, nil)
	if err != nil {
		b.Fatal(err)
	}
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/ord_7GQ2V9X4KD8M3N5P")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"ord_7GQ2V9X4KD8M3N5P","status":"created"}`))
	}))
	body := []byte(`{"amount":{"value":"1999","currency":"EUR"},"items":[{"sku":"SKU-1234","qty":2}]}`)
	req := func() *http.Request {
		r := httptest.NewRequest(http.MethodPost, "/orders", bytes.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		r.Header.Set("Idempotency-Key", "3f2c1f8e-0b7a-4d59-9a65-2d1f6c0e8b11")
		return r
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req())
	if w.Code != http.StatusCreated {
		b.Fatalf("first: %d %s", w.Code, w.Body)
	}
	b.ReportAllocs()
	for b.Loop() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req())
		if w.Header().Get("Idempotency-Replayed") != "true" {
			b.Fatalf("not replayed: %d %s", w.Code, w.Body)
		}
	}
}
