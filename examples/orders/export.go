package main

import (
	"encoding/csv"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/idemstore/idem"
)

// bodiesTable is the -bodies value that selects the table body store.
const bodiesTable = "table"

// openBodyStore opens the body store of -bodies: the dialect's table store
// (idempotency_bodies, where a body commits with its order and record) for
// "table", a DirBodyStore in dir otherwise, or in a new temporary
// directory when dir is empty.
func openBodyStore(dir string, table idem.BodyStore) (idem.BodyStore, error) {
	if dir == bodiesTable {
		return table, nil
	}
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
