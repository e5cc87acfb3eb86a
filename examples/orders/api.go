package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
)

// api serves the orders API; TTx is the store's transaction type.
type api[TTx any] struct {
	// idem protects POST /orders (transactional) and idemOutside POST
	// /payments (leased); their Tx and Lease methods are typed by the store.
	idem, idemOutside *idemhttp.Middleware[TTx]
	orders            orderRepo[TTx]
	// delay is how long create sleeps inside its transaction (-handler-delay).
	delay time.Duration
	// provider is the fake payment provider POST /payments charges.
	provider *provider
	// auth authenticates every request; the tenant is its principal's.
	auth *authenticator
}

// routes wires the middleware onto the POSTs only: the GETs are safe to
// repeat by themselves. POST /orders writes to the database only and uses
// the transactional mode; POST /payments calls the payment provider and
// uses the leased mode.
func (a *api[TTx]) routes(store *idem.Store[TTx], logger *slog.Logger) (http.Handler, error) {
	cfg := idemhttp.Config{
		// The tenant is the authenticated principal's (auth.go), never a
		// header the client picks: the stored response of a key goes to
		// whoever presents its tenant and key.
		Tenant: func(r *http.Request) (string, error) {
			if p, ok := principalOf(r.Context()); ok {
				return p.Tenant, nil
			}
			return "", errUnauthenticated
		},
		Logger: logger,
	}
	var err error
	if a.idem, err = idemhttp.New(store, &cfg); err != nil {
		return nil, err
	}
	leased := cfg
	leased.Mode = idemhttp.Leased
	if a.idemOutside, err = idemhttp.New(store, &leased); err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", a.idem.Wrap(http.HandlerFunc(a.create)))
	mux.Handle("POST /payments", a.idemOutside.Wrap(http.HandlerFunc(a.pay)))
	mux.HandleFunc("GET /orders/{id}", a.get)
	mux.HandleFunc("GET /orders", a.list)
	// Authentication runs first, around everything.
	return a.auth.middleware(mux), nil
}

// errUnauthenticated answers a request that reached the API without a
// principal, which authenticate makes impossible; kept as a safety net.
var errUnauthenticated = &idemhttp.Error{Status: http.StatusUnauthorized, Code: "unauthenticated", Message: "Send Authorization: Bearer <token>."}

// tenantOf returns the authenticated tenant of r, or answers 401.
func tenantOf(w http.ResponseWriter, r *http.Request) (string, bool) {
	p, ok := principalOf(r.Context())
	if !ok {
		writeError(w, r, errUnauthenticated.Status, errUnauthenticated.Code, errUnauthenticated.Message)
	}
	return p.Tenant, ok
}

// orderRequest is the body of POST /orders.
type orderRequest struct {
	SKU         string `json:"sku"`
	Qty         int64  `json:"qty"`
	AmountCents int64  `json:"amount_cents"`
}

// create runs inside the transaction the middleware claimed the key in:
// the order and the stored 201 commit together. A 4xx or 5xx rolls back,
// and the key stays free for a corrected retry.
func (a *api[TTx]) create(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	tenant, ok := tenantOf(w, r)
	if !ok {
		return
	}
	tx, ok := a.idem.Tx(ctx)
	key, _ := idemhttp.Key(ctx)
	if !ok {
		writeError(w, r, http.StatusInternalServerError, "internal_error", "No transaction: the route is not behind idemhttp.")
		return
	}
	var in orderRequest
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
		writeError(w, r, http.StatusBadRequest, "invalid_body", `The body must be {"sku": "...", "qty": N, "amount_cents": N}.`)
		return
	}
	if in.SKU == "" || in.Qty <= 0 || in.AmountCents <= 0 {
		writeError(w, r, http.StatusUnprocessableEntity, "validation_failed", "sku must be set; qty and amount_cents must be positive.")
		return
	}
	if a.delay > 0 { // -handler-delay: the transaction stays open meanwhile
		select {
		case <-time.After(a.delay):
		case <-ctx.Done():
			writeError(w, r, http.StatusServiceUnavailable, "timeout", "The order took too long.")
			return
		}
	}
	o := &order{
		Tenant:      tenant,
		SKU:         in.SKU,
		Qty:         in.Qty,
		AmountCents: in.AmountCents,
		CreatedAt:   time.Now().UTC().Truncate(time.Microsecond),
	}
	if err := a.orders.insert(ctx, tx, key, o); err != nil {
		writeError(w, r, http.StatusInternalServerError, "internal_error", "The order could not be saved.")
		return
	}
	crashAt(ctx, crashAfterClaim) // test aid, see faults.go: the claim and the order are written, not committed
	w.Header().Set("Location", fmt.Sprintf("/orders/%d", o.ID))
	writeJSON(w, http.StatusCreated, o)
}

func (a *api[TTx]) get(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenantOf(w, r)
	if !ok {
		return
	}
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil {
		writeError(w, r, http.StatusNotFound, "order_not_found", "No such order.")
		return
	}
	o, err := a.orders.get(r.Context(), tenant, id)
	switch {
	case errors.Is(err, errNoOrder):
		writeError(w, r, http.StatusNotFound, "order_not_found", "No such order.")
	case err != nil:
		writeError(w, r, http.StatusServiceUnavailable, "database_unavailable", "The orders could not be read.")
	default:
		writeJSON(w, http.StatusOK, o)
	}
}

func (a *api[TTx]) list(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenantOf(w, r)
	if !ok {
		return
	}
	orders, err := a.orders.list(r.Context(), tenant)
	if err != nil {
		writeError(w, r, http.StatusServiceUnavailable, "database_unavailable", "The orders could not be read.")
		return
	}
	writeJSON(w, http.StatusOK, struct {
		Count  int     `json:"count"`
		Orders []order `json:"orders"`
	}{len(orders), orders})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		http.Error(w, "encoding failed", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// writeError answers in the same JSON error contract as idemhttp.
func writeError(w http.ResponseWriter, r *http.Request, status int, code, message string) {
	// The request ID is known behind the middleware only; the GETs answer
	// with an empty one.
	idemhttp.WriteError(w, &idemhttp.Error{Status: status, Code: code, Message: message, RequestID: idemhttp.RequestID(r.Context())})
}
