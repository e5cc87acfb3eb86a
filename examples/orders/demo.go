package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
)

// stepResult is one row of the demo's table.
type stepResult struct {
	name     string
	request  string
	status   string
	replayed string
	ordersA  int
	ordersB  int
	problem  string // empty when the step behaved as expected
}

// demo is the scripted client.
type demo struct {
	ctx     context.Context
	base    string
	client  *http.Client
	db      *database
	svc     *service
	tenantA string
	tenantB string
	steps   []stepResult
	notes   []string
}

// answer is a response as the demo saw it.
type answer struct {
	status   int
	replayed bool
	code     string // the error code, for JSON errors
	header   http.Header
	body     []byte
	err      error
}

// playDemo plays the script against the service at base and prints the
// table to out. It returns an error unless every step behaved as expected.
func playDemo(ctx context.Context, out io.Writer, base string, db *database, svc *service, o *options) error {
	run := randomHex(4) // tenants and keys of their own, so a reused database does not matter
	d := &demo{
		ctx:     ctx,
		base:    base,
		client:  &http.Client{Timeout: time.Minute},
		db:      db,
		svc:     svc,
		tenantA: "acme-" + run,
		tenantB: "globex-" + run,
	}
	key := func(n int) string { return fmt.Sprintf("demo-%s-%04d", run, n) }
	const (
		order     = `{"sku":"green-tea","qty":3,"amount_cents":1250}`
		reordered = "{ \"amount_cents\": 1250,\n  \"qty\": 3, \"sku\": \"green-tea\" }"
		changed   = `{"sku":"green-tea","qty":3,"amount_cents":9999}`
	)

	first := d.post(d.tenantA, key(1), order)
	d.expect("first POST", "POST /orders, key 1", first, func(a answer) string {
		return want(a.status == http.StatusCreated && !a.replayed && a.header.Get("Location") != "", "201 with Location, not replayed")
	})
	d.expect("client retries", "the same request again", d.post(d.tenantA, key(1), order), func(a answer) string {
		return want(a.status == http.StatusCreated && a.replayed && bytes.Equal(a.body, first.body) &&
			a.header.Get("Location") == first.header.Get("Location"), "201 replayed: same Location, same body")
	})
	d.expect("JSON keys reordered", "same order, other key order and spacing", d.post(d.tenantA, key(1), reordered), func(a answer) string {
		return want(a.status == http.StatusCreated && a.replayed && bytes.Equal(a.body, first.body), "201 replayed")
	})
	d.expect("amount changed", "key 1 with amount_cents 9999", d.post(d.tenantA, key(1), changed), func(a answer) string {
		return want(a.status == http.StatusConflict && a.code == "idempotency_key_reused", "409 idempotency_key_reused")
	})
	d.concurrent(key(2), order)
	d.expect("no Idempotency-Key", "POST /orders without the header", d.post(d.tenantA, "", order), func(a answer) string {
		return want(a.status == http.StatusBadRequest && a.code == "idempotency_key_missing", "400 idempotency_key_missing")
	})
	d.expect("another tenant, same key", "key 1 as "+d.tenantB, d.post(d.tenantB, key(1), order), func(a answer) string {
		return want(a.status == http.StatusCreated && !a.replayed && a.header.Get("Location") != first.header.Get("Location"),
			"201, its own order")
	})
	d.inFlight(key(3), order, o)
	d.expect("invalid order", "key 4 with qty 0", d.post(d.tenantA, key(4), `{"sku":"green-tea","qty":0,"amount_cents":1250}`), func(a answer) string {
		return want(a.status == http.StatusUnprocessableEntity && a.code == "validation_failed", "422 validation_failed, nothing stored")
	})
	d.expect("corrected retry", "key 4 with qty 1", d.post(d.tenantA, key(4), `{"sku":"green-tea","qty":1,"amount_cents":1250}`), func(a answer) string {
		return want(a.status == http.StatusCreated && !a.replayed, "201: the 422 left the key free")
	})
	d.inFlightPayment(key(5), o)

	// Every step must also leave exactly the orders it should.
	wantOrders := []struct{ a, b int }{{1, 0}, {1, 0}, {1, 0}, {1, 0}, {2, 0}, {2, 0}, {2, 1}, {3, 1}, {3, 1}, {4, 1}, {4, 1}, {4, 1}}
	failed := 0
	for i := range d.steps {
		s := &d.steps[i]
		if i < len(wantOrders) && s.problem == "" && (s.ordersA != wantOrders[i].a || s.ordersB != wantOrders[i].b) {
			s.problem = fmt.Sprintf("expected %d/%d orders", wantOrders[i].a, wantOrders[i].b)
		}
		if s.problem != "" {
			failed++
		}
	}
	if len(d.steps) != len(wantOrders) {
		failed++
	}
	d.print(out)
	if failed > 0 {
		return fmt.Errorf("demo: %d step(s) did not behave as expected", failed)
	}
	fmt.Fprintf(out, "\nAll %d steps behaved as expected.\n", len(d.steps))
	return nil
}

// want returns "" when ok, else what was expected.
func want(ok bool, expected string) string {
	if ok {
		return ""
	}
	return "expected " + expected
}

// expect records a step: check returns "" when a is what was expected.
func (d *demo) expect(name, request string, a answer, check func(answer) string) {
	s := stepResult{name: name, request: request, status: a.describe(), replayed: yesNo(a.replayed)}
	if a.err != nil {
		s.problem = a.err.Error()
	} else {
		s.problem = check(a)
	}
	d.record(s)
}

// record adds a step with the tenants' order counts after it.
func (d *demo) record(s stepResult) {
	var err error
	if s.ordersA, err = d.db.countOrders(d.ctx, d.tenantA); err == nil {
		s.ordersB, err = d.db.countOrders(d.ctx, d.tenantB)
	}
	if err != nil && s.problem == "" {
		s.problem = "counting orders: " + err.Error()
	}
	d.steps = append(d.steps, s)
}

// concurrent sends 50 copies of one request at once: one runs, the others
// are replayed or told the original is in progress.
func (d *demo) concurrent(key, body string) {
	const n = 50
	answers := make([]answer, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			answers[i] = d.post(d.tenantA, key, body)
		})
	}
	close(start)
	wg.Wait()

	var created, replayed, inProgress, other int
	var problem string
	for _, a := range answers {
		switch {
		case a.err == nil && a.status == http.StatusCreated && !a.replayed:
			created++
		case a.err == nil && a.status == http.StatusCreated:
			replayed++
		case a.err == nil && a.status == http.StatusConflict && a.code == "idempotency_request_in_progress":
			inProgress++
		default:
			other++
			if problem == "" {
				problem = "unexpected answer " + a.describe()
			}
		}
	}
	if problem == "" && created != 1 {
		problem = fmt.Sprintf("expected exactly one 201 that is not a replay, got %d", created)
	}
	d.record(stepResult{
		name:     "50 concurrent duplicates",
		request:  fmt.Sprintf("%d × POST /orders, key 2", n),
		status:   fmt.Sprintf("%d×201, %d×409 in progress", created+replayed, inProgress),
		replayed: fmt.Sprintf("%d of %d", replayed, created+replayed),
		problem:  problem,
	})
}

// inFlight sends a duplicate while the original still sleeps in its
// transaction (-handler-delay).
func (d *demo) inFlight(key, body string, o *options) {
	original := make(chan answer, 1)
	go func() { original <- d.post(d.tenantA, key, body) }()
	time.Sleep(min(o.handlerDelay/4, 150*time.Millisecond)) // the original has claimed the key
	dup := d.post(d.tenantA, key, body)
	orig := <-original

	s := stepResult{name: "in-flight duplicate", request: "key 3 again while the first is running", status: dup.describe(), replayed: yesNo(dup.replayed)}
	wait := o.waitTimeout
	if d.db.dialect == dialectMySQL { // MySQL waits for locks in whole seconds
		wait = max((wait + time.Second - 1).Truncate(time.Second), time.Second)
	}
	switch {
	case dup.err != nil:
		s.problem = dup.err.Error()
	case orig.err != nil || orig.status != http.StatusCreated || orig.replayed:
		s.problem = "the original did not get its 201: " + orig.describe()
	case d.db.dialect == dialectSQLite:
		// SQLite has one writer at a time: the duplicate's transaction
		// waits for the original's to commit, then replays it.
		s.problem = want(dup.status == http.StatusCreated && dup.replayed && bytes.Equal(dup.body, orig.body),
			"201 replayed once the original committed")
		d.notes = append(d.notes, "SQLite writes one transaction at a time: the in-flight duplicate waited for the original and was replayed. "+
			"On PostgreSQL and MySQL it gets 409 with Retry-After once -wait-timeout runs out.")
	case o.handlerDelay > wait:
		s.problem = want(dup.status == http.StatusConflict && dup.code == "idempotency_request_in_progress" && dup.header.Get("Retry-After") != "",
			"409 idempotency_request_in_progress with Retry-After")
		s.status += ", Retry-After: " + dup.header.Get("Retry-After")
	default:
		s.problem = want(dup.status == http.StatusCreated && dup.replayed, "201 replayed (-handler-delay is not longer than -wait-timeout)")
	}
	d.record(s)
}

// inFlightPayment pays, sends a duplicate while the provider is still
// charging (-provider-delay), then retries once the original answered.
// POST /payments uses the leased mode: its claim is committed before the
// provider is called, so the duplicate gets 409 on every database.
func (d *demo) inFlightPayment(key string, o *options) {
	const body = `{"amount_cents":4200}`
	original := make(chan answer, 1)
	go func() { original <- d.postTo("/payments", d.tenantA, key, body) }()
	time.Sleep(min(o.providerDelay/4, 150*time.Millisecond)) // the original is at the provider
	dup := d.postTo("/payments", d.tenantA, key, body)
	orig := <-original

	s := stepResult{name: "in-flight payment duplicate", request: "POST /payments, key 5, again while the provider charges",
		status: dup.describe(), replayed: yesNo(dup.replayed)}
	switch {
	case dup.err != nil:
		s.problem = dup.err.Error()
	case orig.err != nil || orig.status != http.StatusCreated || orig.replayed:
		s.problem = "the original did not get its 201: " + orig.describe()
	case o.providerDelay >= 300*time.Millisecond:
		s.problem = want(dup.status == http.StatusConflict && dup.code == "idempotency_request_in_progress" && dup.header.Get("Retry-After") != "",
			"409 idempotency_request_in_progress with Retry-After, on every database")
		s.status += ", Retry-After: " + dup.header.Get("Retry-After")
	default: // -provider-delay too short to be sure the duplicate meets the original at work
		s.problem = want(dup.status == http.StatusCreated && dup.replayed || dup.code == "idempotency_request_in_progress",
			"201 replayed or 409 in progress")
	}
	d.record(s)

	retry := d.postTo("/payments", d.tenantA, key, body)
	d.expect("payment retried", "key 5 again after the 201", retry, func(a answer) string {
		return want(a.status == http.StatusCreated && a.replayed && bytes.Equal(a.body, orig.body) && d.svc.providerCalls() == 1,
			"201 replayed, and the provider called once")
	})
	d.notes = append(d.notes, "POST /payments calls a payment provider (a fake one here): idemhttp's leased mode commits its claim "+
		"before the call, so an in-flight duplicate gets 409 on every database, SQLite included, and the provider is called once.")
}

// post sends POST /orders as tenant, with key unless it is empty.
func (d *demo) post(tenant, key, body string) answer { return d.postTo("/orders", tenant, key, body) }

// postTo sends a POST to path as tenant, with key unless it is empty.
func (d *demo) postTo(path, tenant, key, body string) answer {
	req, err := http.NewRequestWithContext(d.ctx, http.MethodPost, d.base+path, strings.NewReader(body))
	if err != nil {
		return answer{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+d.svc.token(tenant)) // the demo signs its own tokens
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := d.client.Do(req)
	if err != nil {
		return answer{err: err}
	}
	defer resp.Body.Close()
	a := answer{status: resp.StatusCode, header: resp.Header, replayed: resp.Header.Get("Idempotency-Replayed") == "true"}
	if a.body, a.err = io.ReadAll(resp.Body); a.err != nil {
		return a
	}
	if resp.StatusCode >= 400 {
		var e struct {
			Code string `json:"code"`
		}
		_ = json.Unmarshal(a.body, &e)
		a.code = e.Code
	}
	return a
}

func (a answer) describe() string {
	switch {
	case a.err != nil:
		return "error"
	case a.code != "":
		return fmt.Sprintf("%d %s", a.status, a.code)
	default:
		return fmt.Sprintf("%d", a.status)
	}
}

func (d *demo) print(out io.Writer) {
	fmt.Fprintf(out, "\nTenants %s (A) and %s (B); keys are demo-<run>-000N.\n\n", d.tenantA, d.tenantB)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "#\tstep\trequest\tstatus\treplayed\torders A/B\tresult")
	for i, s := range d.steps {
		result := "ok"
		if s.problem != "" {
			result = "FAILED: " + s.problem
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%d/%d\t%s\n", i+1, s.name, s.request, s.status, s.replayed, s.ordersA, s.ordersB, result)
	}
	_ = tw.Flush()
	for _, n := range d.notes {
		fmt.Fprintln(out, "\nNote:", n)
	}
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
