package main

import (
	"encoding/csv"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/idemstore/idem"
)

// openBodyStore opens the body store in dir, or in a new temporary
// directory when dir is empty.
func openBodyStore(dir string) (*idem.DirBodyStore, error) {
	if dir == "" {
		var err error
		if dir, err = os.MkdirTemp("", "orders-bodies-"); err != nil {
			return nil, err
		}
	}
	return idem.NewDirBodyStore(dir)
}

// export answers POST /exports with a CSV of the tenant's orders: a large
// generated answer. Behind the middleware, a retry with the same key gets
// the same CSV (the orders as they were at the first request), replayed
// from the body store once it outgrew -inline-body-max; the rows are
// written as they are produced, and idemhttp streams them to the body
// store, so the CSV is never held in memory whole.
func (a *api[TTx]) export(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenantOf(w, r)
	if !ok {
		return
	}
	orders, err := a.orders.list(r.Context(), tenant)
	if err != nil {
		writeError(w, r, http.StatusServiceUnavailable, "database_unavailable", "The orders could not be read.")
		return
	}
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	w.WriteHeader(http.StatusCreated)
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"id", "sku", "qty", "amount_cents", "created_at"})
	for _, o := range orders {
		_ = cw.Write([]string{strconv.FormatInt(o.ID, 10), o.SKU, strconv.FormatInt(o.Qty, 10),
			strconv.FormatInt(o.AmountCents, 10), o.CreatedAt.UTC().Format(time.RFC3339Nano)})
	}
	cw.Flush()
}
