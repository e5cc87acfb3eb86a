package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
)

// POST /payments charges a (fake) payment provider: an effect outside the
// database, which no rollback can undo. It runs behind idemhttp's leased
// mode: the key's claim is committed before the provider is called, so a
// duplicate meanwhile gets 409 in progress on every database, and a crashed
// holder is resolved by asking the provider (paymentStatus).

// provider is a fake payment provider. Like a real one, it deduplicates
// charges on the idempotency key it is given: charging a key twice returns
// the first charge. It lives in this process's memory, unless url is set
// (-provider-url): then it is a client of an outside provider that speaks
// the protocol of remoteCharge and remoteLookup, which survives a crash of
// this process (the fault suite runs one).
type provider struct {
	delay   time.Duration // how long a charge takes (-provider-delay)
	url     string        // the outside provider's base URL; empty: in memory
	client  *http.Client
	mu      sync.Mutex
	charges map[string]charge
	calls   int // charge calls, deduplicated or not
}

// charge is one charge of the provider.
type charge struct {
	ID          string `json:"charge_id"`
	AmountCents int64  `json:"amount_cents"`
}

func newProvider(delay time.Duration, url string) *provider {
	return &provider{delay: delay, url: strings.TrimSuffix(url, "/"), client: &http.Client{Timeout: 10 * time.Second}, charges: map[string]charge{}}
}

// charge charges amount under key, or returns the charge already made
// under key.
func (p *provider) charge(ctx context.Context, key string, amount int64) (charge, error) {
	select {
	case <-time.After(p.delay):
	case <-ctx.Done():
		return charge{}, context.Cause(ctx)
	}
	p.mu.Lock()
	p.calls++
	p.mu.Unlock()
	if p.url != "" {
		c, err := p.remoteCharge(ctx, key, amount)
		if err == nil {
			crashAt(ctx, crashDuringProviderCall) // test aid, see faults.go
		}
		return c, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	c, ok := p.charges[key]
	if !ok {
		c = charge{ID: "ch_" + randomHex(8), AmountCents: amount}
		p.charges[key] = c
	}
	crashAt(ctx, crashDuringProviderCall) // test aid, see faults.go
	return c, nil
}

// callCount returns how often charge was called.
func (p *provider) callCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

// lookup returns the charge made under key, if any.
func (p *provider) lookup(ctx context.Context, key string) (charge, bool, error) {
	if p.url != "" {
		return p.remoteLookup(ctx, key)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	c, ok := p.charges[key]
	return c, ok, nil
}

// providerRequest is the body of both calls to an outside provider. The key
// travels in the body, not the URL, so that it stays out of access logs.
type providerRequest struct {
	Key         string `json:"key"`
	AmountCents int64  `json:"amount_cents,omitempty"`
}

// remoteCharge is POST {url}/charges {"key": k, "amount_cents": n} → 200
// and the charge, the first one made under k if there was one.
func (p *provider) remoteCharge(ctx context.Context, key string, amount int64) (charge, error) {
	c, found, err := p.post(ctx, "/charges", providerRequest{Key: key, AmountCents: amount})
	if err == nil && !found {
		err = errors.New("provider: charge not found after charging")
	}
	return c, err
}

// remoteLookup is POST {url}/charges/lookup {"key": k} → 200 and the
// charge made under k, or 404 if none was.
func (p *provider) remoteLookup(ctx context.Context, key string) (charge, bool, error) {
	return p.post(ctx, "/charges/lookup", providerRequest{Key: key})
}

func (p *provider) post(ctx context.Context, path string, in providerRequest) (charge, bool, error) {
	body, err := json.Marshal(in)
	if err != nil {
		return charge{}, false, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url+path, bytes.NewReader(body))
	if err != nil {
		return charge{}, false, fmt.Errorf("provider: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.client.Do(req)
	if err != nil {
		return charge{}, false, fmt.Errorf("provider: %w", err)
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		var c charge
		if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
			return charge{}, false, fmt.Errorf("provider: decode %s: %w", path, err)
		}
		return c, true, nil
	case http.StatusNotFound:
		return charge{}, false, nil
	default:
		return charge{}, false, fmt.Errorf("provider: %s answered %d", path, resp.StatusCode)
	}
}

// providerKey is the idempotency key the service gives the provider: the
// client's key within its scope (tenant and operation), so two tenants'
// keys never meet at the provider.
func providerKey(scope, key string) string { return scope + "\x1f" + key }

// paymentsRoute is the operation of POST /payments as it appears at the
// end of a scope.
const paymentsRoute = " POST /payments"

// paymentStatus is the store's StatusCheck: it asks the provider whether
// the holder of a POST /payments key whose lease ran out (a crashed
// process) charged. The recovered response carries the charge; the payment
// row, if the holder never wrote it, is for reconciliation to add.
func (p *provider) paymentStatus(ctx context.Context, rec idem.Record) (idem.Verdict, error) {
	if !strings.HasSuffix(rec.Scope, paymentsRoute) {
		// POST /orders claims inside its transaction: its records never
		// outlive their holder while processing.
		return idem.Unknown(), nil
	}
	c, ok, err := p.lookup(ctx, providerKey(rec.Scope, rec.Key))
	if err != nil {
		return idem.Unknown(), fmt.Errorf("look the charge up: %w", err)
	}
	if !ok {
		return idem.NotCommitted(), nil
	}
	body, err := json.Marshal(struct {
		charge
		Recovered bool `json:"recovered"`
	}{c, true})
	if err != nil {
		return idem.Unknown(), err
	}
	return idem.Committed(&idem.Response{
		StatusCode: http.StatusCreated,
		Header:     http.Header{"Content-Type": {"application/json"}},
		Body:       append(body, '\n'),
	}), nil
}

// paymentRequest is the body of POST /payments.
type paymentRequest struct {
	AmountCents int64 `json:"amount_cents"`
}

// payment is one row of the payments table, and its JSON form.
type payment struct {
	ID          int64     `json:"id"`
	Tenant      string    `json:"tenant"`
	ChargeID    string    `json:"charge_id"`
	AmountCents int64     `json:"amount_cents"`
	Attempt     int       `json:"attempt"`
	CreatedAt   time.Time `json:"created_at"`
}

// pay charges the provider outside any transaction, then records the
// payment in the transaction it takes from idemhttp.Tx (which begins it),
// where the middleware also completes the lease.
func (a *api[TTx]) pay(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	tenant, ok := tenantOf(w, r)
	if !ok {
		return
	}
	key, _ := idemhttp.Key(ctx)
	scope, _ := idemhttp.Scope(ctx)
	lease, ok := a.idemOutside.Lease(ctx)
	if !ok {
		writeError(w, r, http.StatusInternalServerError, "internal_error", "No lease: the route is not behind a leased idemhttp middleware.")
		return
	}
	var in paymentRequest
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
		writeError(w, r, http.StatusBadRequest, "invalid_body", `The body must be {"amount_cents": N}.`)
		return
	}
	if in.AmountCents <= 0 {
		writeError(w, r, http.StatusUnprocessableEntity, "validation_failed", "amount_cents must be positive.")
		return
	}
	crashAt(ctx, crashBeforeProviderCall) // test aid, see faults.go
	// The provider deduplicates on the key, so a second attempt after a
	// crash (or after this request is released and retried) never charges
	// twice.
	c, err := a.provider.charge(ctx, providerKey(scope, key), in.AmountCents)
	if err != nil {
		// Not final: the lease is released and the client may retry.
		writeError(w, r, http.StatusBadGateway, "provider_unavailable", "The payment provider did not answer.")
		return
	}
	tx, ok := a.idemOutside.Tx(ctx)
	if !ok {
		// The provider has charged and the charge cannot be recorded (the
		// store is failing, or the lease was lost). idemhttp keeps the key
		// processing whatever is answered here, so no retry calls the
		// provider again before the status check, once the lease ran out,
		// has found the charge.
		writeError(w, r, http.StatusServiceUnavailable, "payment_unrecorded", "The payment could not be recorded yet; retry later with the same key.")
		return
	}
	p := &payment{
		Tenant:      tenant,
		ChargeID:    c.ID,
		AmountCents: c.AmountCents,
		Attempt:     lease.Attempt(),
		CreatedAt:   time.Now().UTC().Truncate(time.Microsecond),
	}
	if err := a.orders.insertPayment(ctx, tx, key, p); err != nil {
		writeError(w, r, http.StatusInternalServerError, "internal_error", "The payment could not be recorded.")
		return
	}
	w.Header().Set("Location", fmt.Sprintf("/payments/%d", p.ID))
	writeJSON(w, http.StatusCreated, p)
}
