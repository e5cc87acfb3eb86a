package idemhttp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
)

// The leased mode (point 13) on every dialect. Its handlers call a fake
// payment provider, outside the database, then take the transaction
// (idemhttp.Tx begins it) to record the payment.

// leasedCases are the cases of the leased mode, run by TestMiddleware.
func leasedCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{"LeasedHappyPath", testLeasedHappyPath[TTx]},
		{"LeasedInProgress", testLeasedInProgress[TTx]},
		{"LeasedRetryAfter", testLeasedRetryAfter[TTx]},
		{"LeasedCrashedHolder", testLeasedCrashedHolder[TTx]},
		{"LeasedFailures", testLeasedFailures[TTx]},
		{"LeasedLostAtCompletion", testLeasedLostAtCompletion[TTx]},
		{"LeasedLostWhileRunning", testLeasedLostWhileRunning[TTx]},
		{"LeasedPanic", testLeasedPanic[TTx]},
		{"LeasedStoreFailures", testLeasedStoreFailures[TTx]},
		{"LeasedBeginFails", testLeasedBeginFails[TTx]},
	}
}

// provider is a fake payment provider: it counts the charges per key.
type provider struct {
	mu      sync.Mutex
	charges map[string]int
}

func newProvider() *provider { return &provider{charges: map[string]int{}} }

func (p *provider) charge(key string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.charges[key]++
}

func (p *provider) count(key string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.charges[key]
}

func (p *provider) total() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, c := range p.charges {
		n += c
	}
	return n
}

// statusCheck asks the provider whether a crashed holder charged: if so,
// the recovered response points at the payment.
func (p *provider) statusCheck(_ context.Context, rec idem.Record) (idem.Verdict, error) {
	if p.count(rec.Key) == 0 {
		return idem.NotCommitted(), nil
	}
	return idem.Committed(&idem.Response{
		StatusCode: http.StatusCreated,
		Header:     http.Header{"Content-Type": {"application/json"}, "Location": {"/payments/recovered"}},
		Body:       []byte(`{"recovered":true}`),
	}), nil
}

// leasedConfig is the middleware configuration of the leased cases.
func leasedConfig() *idemhttp.Config { return &idemhttp.Config{Mode: idemhttp.Leased} }

// pay is the leased handler: it charges the provider outside any
// transaction, then records the payment in the transaction it takes, and
// answers 201. between, if set, runs between the two; false ends the
// handler there.
func pay[TTx any](p *provider, between func(b *bundle[TTx], w http.ResponseWriter, r *http.Request) bool) handlerFunc[TTx] {
	return func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, _ TTx, _ bool) {
		key, _ := idemhttp.Key(r.Context())
		p.charge(key)
		if between != nil && !between(b, w, r) {
			return
		}
		tx, ok := idemhttp.Tx[TTx](r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		id, err := b.insert(r, tx, 1500)
		if err != nil {
			http.Error(w, "insert failed", http.StatusInternalServerError)
			return
		}
		lease, _ := idemhttp.Lease[TTx](r.Context())
		w.Header().Set("Location", fmt.Sprintf("/payments/%d", id))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"attempt":%d}`, id, lease.Attempt()) //nolint:gosec // test handler writing JSON of two integers: nothing to escape
	}
}

// fingerprintOf returns the fingerprint the middleware stores for a
// request, read from the record of key after a request with it completed.
func (b *bundle[TTx]) fingerprintOf(t *testing.T, scope, key string) idem.Fingerprint {
	t.Helper()
	rec, err := b.store.Get(t.Context(), scope, key)
	require.NoError(t, err)
	return rec.Fingerprint
}

const payScope = "t1 POST /orders"

// testLeasedHappyPath: the outside call runs once; the payment row and the
// stored response commit together; retries replay; the lease is in the
// context while the handler runs, and only then.
func testLeasedHappyPath[TTx any](t *testing.T, h harness[TTx]) {
	p := newProvider()
	type seen struct {
		lease      *idem.Lease[TTx]
		ctx        context.Context
		wrongTx    bool
		wrongLease bool
		retry      bool
	}
	var got atomic.Value
	b := setup(t, h, options[TTx]{cfg: leasedConfig(), handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
		ctx := r.Context()
		lease, _ := idemhttp.Lease[TTx](ctx)
		_, wrongTx := idemhttp.Tx[int](ctx) // must not begin anything
		_, wrongLease := idemhttp.Lease[int](ctx)
		got.Store(seen{lease: lease, ctx: ctx, wrongTx: wrongTx, wrongLease: wrongLease, retry: idemhttp.RetryTransaction(ctx)})
		if r.URL.Path == "/refunds" { // no business write: the response is stored on its own
			p.charge("refund")
			w.WriteHeader(http.StatusAccepted)
			fmt.Fprint(w, "refund accepted")
			return
		}
		pay[TTx](p, nil)(b, w, r, tx, ok)
	}})
	key := newKey()
	first := b.post(t, key, orderBody)
	require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
	require.False(t, first.replayed())
	require.Equal(t, `{"id":1,"attempt":1}`, string(first.body))
	require.Equal(t, 1, p.count(key))
	require.Equal(t, 1, b.orders(t))

	s := got.Load().(seen)
	require.NotNil(t, s.lease, "the handler reaches its lease")
	require.True(t, s.lease.Acquired())
	require.Equal(t, 1, s.lease.Attempt())
	require.NotZero(t, s.lease.Token())
	require.False(t, s.wrongTx, "a wrong transaction type is not a transaction")
	require.False(t, s.wrongLease)
	require.False(t, s.retry, "RetryTransaction is refused in the leased mode")
	_, ok := idemhttp.Lease[TTx](s.ctx)
	require.False(t, ok, "the lease is not reachable after the handler returned")
	_, ok = idemhttp.Tx[TTx](s.ctx)
	require.False(t, ok)

	rec, err := b.store.Get(t.Context(), payScope, key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
	require.Equal(t, first.body, rec.Response.Body)
	require.Equal(t, s.lease.Token(), rec.Token, "completed by the lease's holder")

	again := b.post(t, key, orderBody)
	require.Equal(t, http.StatusCreated, again.status)
	require.True(t, again.replayed())
	require.Equal(t, first.body, again.body)
	require.Equal(t, first.header.Get("Location"), again.header.Get("Location"))
	r := b.post(t, key, `{"amount":1}`)
	require.Equal(t, http.StatusConflict, r.status)
	require.Equal(t, idemhttp.CodeKeyReused, r.code(t))
	require.Equal(t, 1, p.count(key), "the provider was called once")
	require.Equal(t, int64(1), b.calls.Load())

	refund := newKey()
	r = b.post(t, refund, orderBody, path("/refunds"))
	require.Equal(t, http.StatusAccepted, r.status)
	r = b.post(t, refund, orderBody, path("/refunds"))
	require.True(t, r.replayed(), "a handler that never took the transaction is stored too")
	require.Equal(t, "refund accepted", string(r.body))
	require.Equal(t, 1, p.count("refund"))

	recs := b.logs.records(t, "idemhttp: request")
	require.Equal(t, "completed", recs[0]["outcome"])
	require.EqualValues(t, 1, recs[0]["attempt"], "leased requests log their attempt")
}

// testLeasedInProgress: while the handler works outside the transaction, a
// duplicate gets 409 in progress with Retry-After on every dialect, SQLite
// included; KeepAlive renews the lease meanwhile, so a handler slower than
// several leases keeps its key even with BlindTakeover.
func testLeasedInProgress[TTx any](t *testing.T, h harness[TTx]) {
	// Renewed every lease/3, so the lease survives a renewal up to 2/3 of it
	// late. 200ms failed in CI (on SQLite a renewal's commit and fsync, or
	// the goroutine's turn, on two loaded cores under -race, came more than
	// 133ms late); 2s, as in conformance's KeepAlive test, leaves 1.3s.
	const lease = 2 * time.Second
	p := newProvider()
	entered, release := make(chan struct{}, 1), make(chan struct{})
	var before, after atomic.Int64 // the lease's expiry, Unix µs
	b := setup(t, h, options[TTx]{
		cfg:     leasedConfig(),
		idemCfg: &idem.Config{LeaseDuration: lease, BlindTakeover: true},
		handler: pay[TTx](p, func(b *bundle[TTx], w http.ResponseWriter, r *http.Request) bool {
			if b.calls.Load() > 1 {
				return true // a duplicate that took the key over: the test fails below
			}
			l, _ := idemhttp.Lease[TTx](r.Context())
			before.Store(l.ExpiresAt().UnixMicro())
			entered <- struct{}{}
			<-release // the slow provider
			after.Store(l.ExpiresAt().UnixMicro())
			return true
		}),
	})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	defer unblock() // also when a check fails, or the server never shuts down
	key := newKey()
	original := b.postAsync(t, key, orderBody)
	<-entered

	dup := b.post(t, key, orderBody)
	require.Equal(t, http.StatusConflict, dup.status, "%s", dup.body)
	require.Equal(t, idemhttp.CodeInProgress, dup.code(t))
	require.Equal(t, "1", dup.header.Get("Retry-After"), "the lease's time left, at least 1s")

	time.Sleep(5 * lease / 2) // past the first lease: only renewals keep the key
	dup = b.post(t, key, orderBody)
	require.Equal(t, http.StatusConflict, dup.status, "%s", dup.body)
	require.Equal(t, idemhttp.CodeInProgress, dup.code(t))
	unblock()

	first := original()
	require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
	require.Greater(t, after.Load(), before.Load(), "KeepAlive renewed the lease")
	again := b.post(t, key, orderBody)
	require.True(t, again.replayed())
	require.Equal(t, first.body, again.body)
	require.Equal(t, 1, p.count(key))
	require.Equal(t, int64(1), b.calls.Load())
	require.Equal(t, 1, b.orders(t))
}

// testLeasedRetryAfter (issue 14): a duplicate of a leased request in
// progress is not told to wait the whole lease, which KeepAlive keeps near
// LeaseDuration however soon the original finishes: Retry-After is the
// lease's time left capped at InProgressRetryAfter (1s by default).
func testLeasedRetryAfter[TTx any](t *testing.T, h harness[TTx]) {
	p := newProvider()
	entered, release := make(chan struct{}, 1), make(chan struct{})
	b := setup(t, h, options[TTx]{
		cfg:     leasedConfig(),
		idemCfg: &idem.Config{LeaseDuration: 30 * time.Second},
		handler: pay[TTx](p, func(b *bundle[TTx], _ http.ResponseWriter, _ *http.Request) bool {
			if b.calls.Load() == 1 {
				entered <- struct{}{}
				<-release // the slow provider
			}
			return true
		}),
	})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	defer unblock()
	key := newKey()
	original := b.postAsync(t, key, orderBody)
	<-entered

	retryAfter := func(r *reply) int {
		t.Helper()
		require.Equal(t, http.StatusConflict, r.status, "%s", r.body)
		require.Equal(t, idemhttp.CodeInProgress, r.code(t))
		secs, err := strconv.Atoi(r.header.Get("Retry-After"))
		require.NoError(t, err)
		return secs
	}
	require.Equal(t, 1, retryAfter(b.post(t, key, orderBody)), "the default cap, not the 30s lease")
	hinted := b.with(idemhttp.Config{Mode: idemhttp.Leased, InProgressRetryAfter: 10 * time.Second}, nil)
	require.Equal(t, 10, retryAfter(b.direct(t, hinted, key, orderBody)), "InProgressRetryAfter")
	long := b.with(idemhttp.Config{Mode: idemhttp.Leased, InProgressRetryAfter: time.Hour}, nil)
	secs := retryAfter(b.direct(t, long, key, orderBody))
	require.True(t, secs > 20 && secs <= 30, "the lease's time left when shorter than the cap: %d", secs)

	unblock()
	first := original()
	require.Equal(t, http.StatusCreated, first.status, "%s", first.body)
	again := b.post(t, key, orderBody)
	require.True(t, again.replayed())
	require.Equal(t, 1, p.count(key))
	require.Equal(t, int64(1), b.calls.Load())
}

// testLeasedCrashedHolder: a holder that crashed (its lease ran out without
// a completion) is resolved by the store's StatusCheck on the retry: a
// charge that happened is replayed as the recovered response, one that did
// not runs the handler again as attempt 2. The dead holder is fenced.
func testLeasedCrashedHolder[TTx any](t *testing.T, h harness[TTx]) {
	p := newProvider()
	b := setup(t, h, options[TTx]{
		cfg:     leasedConfig(),
		idemCfg: &idem.Config{StatusCheck: p.statusCheck},
		handler: pay[TTx](p, nil),
	})
	k0 := newKey()
	require.Equal(t, http.StatusCreated, b.post(t, k0, orderBody).status)
	fp := b.fingerprintOf(t, payScope, k0)

	// The crashed process: short leases, Acquire, and gone.
	crashed, err := idem.New(b.ns.dialect, &idem.Config{LeaseDuration: 50 * time.Millisecond})
	require.NoError(t, err)
	charged, uncharged := newKey(), newKey()
	deadCharged, err := crashed.Acquire(t.Context(), payScope, charged, fp)
	require.NoError(t, err)
	p.charge(charged) // crashed after the charge, before completing
	deadUncharged, err := crashed.Acquire(t.Context(), payScope, uncharged, fp)
	require.NoError(t, err) // crashed before the charge
	time.Sleep(150 * time.Millisecond)

	r := b.post(t, charged, orderBody)
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	require.True(t, r.replayed(), "the status check's recovered response is replayed")
	require.Equal(t, `{"recovered":true}`, string(r.body))
	require.Equal(t, "/payments/recovered", r.header.Get("Location"))
	require.Equal(t, 1, p.count(charged), "no second charge")

	r = b.post(t, uncharged, orderBody)
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	require.False(t, r.replayed())
	require.Contains(t, string(r.body), `"attempt":2`, "the handler ran again as attempt 2")
	require.Equal(t, 1, p.count(uncharged))
	require.Equal(t, int64(2), b.calls.Load())
	require.Equal(t, 2, b.orders(t))

	resp := &idem.Response{StatusCode: http.StatusCreated, Body: []byte("late")}
	require.ErrorIs(t, deadCharged.Complete(t.Context(), resp), idem.ErrFenced, "the dead holder cannot overwrite")
	require.ErrorIs(t, deadUncharged.Complete(t.Context(), resp), idem.ErrFenced)
	for _, k := range []string{charged, uncharged} {
		r = b.post(t, k, orderBody)
		require.True(t, r.replayed())
	}
	recs := b.logs.records(t, "idemhttp: request")
	require.EqualValues(t, 2, recs[2]["attempt"])
}

// testLeasedFailures: a 4xx or 5xx rolls back and releases the lease (a
// corrected retry with another body acquires the key, where a record left
// behind would answer key_reused); a failure marked final is stored and
// replayed; an oversized response is refused and released; a handler that
// outlives Timeout releases.
func testLeasedFailures[TTx any](t *testing.T, h harness[TTx]) {
	p := newProvider()
	var handler handlerFunc[TTx]
	b := setup(t, h, options[TTx]{
		cfg: &idemhttp.Config{Mode: idemhttp.Leased, MaxResponseBytes: 100},
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			handler(b, w, r, tx, ok)
		},
	})
	handler = func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, _ TTx, _ bool) {
		var in struct {
			Amount int64  `json:"amount"`
			Then   string `json:"then"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if in.Then == "slow" {
			<-r.Context().Done() // Timeout ends it
			http.Error(w, "too slow", http.StatusGatewayTimeout)
			return
		}
		tx, ok := idemhttp.Tx[TTx](r.Context())
		if !ok {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		if _, err := b.insert(r, tx, in.Amount); err != nil {
			http.Error(w, err.Error(), http.StatusTeapot)
			return
		}
		switch {
		case in.Amount <= 0:
			http.Error(w, "amount must be positive", http.StatusUnprocessableEntity)
		case in.Then == "declined":
			key, _ := idemhttp.Key(r.Context())
			p.charge(key)
			idemhttp.MarkFinal(r.Context())
			w.WriteHeader(http.StatusPaymentRequired)
			fmt.Fprint(w, "declined")
		case in.Then == "big":
			w.WriteHeader(http.StatusCreated)
			fmt.Fprint(w, strings.Repeat("z", 101))
		default:
			w.WriteHeader(http.StatusCreated)
			fmt.Fprint(w, "paid")
		}
	}
	key := newKey()
	r := b.post(t, key, `{"amount":0}`)
	require.Equal(t, http.StatusUnprocessableEntity, r.status)
	require.Zero(t, b.records(t), "the lease was released")
	require.Zero(t, b.orders(t), "the write was rolled back")
	r = b.post(t, key, `{"amount":5}`)
	require.Equal(t, http.StatusCreated, r.status, "the corrected retry, another body, acquires the key: %s", r.body)
	require.Equal(t, 1, b.orders(t))

	key = newKey()
	r = b.post(t, key, `{"amount":5,"then":"declined"}`)
	require.Equal(t, http.StatusPaymentRequired, r.status)
	again := b.post(t, key, `{"amount":5,"then":"declined"}`)
	require.Equal(t, http.StatusPaymentRequired, again.status)
	require.True(t, again.replayed(), "a final failure is stored and replayed")
	require.Equal(t, 1, p.count(key))
	require.Equal(t, 2, b.orders(t), "with its writes")

	key = newKey()
	r = b.post(t, key, `{"amount":5,"then":"big"}`)
	require.Equal(t, http.StatusInternalServerError, r.status)
	require.Equal(t, idemhttp.CodeResponseTooLarge, r.code(t))
	require.Equal(t, 2, b.orders(t))
	require.Equal(t, 2, b.records(t), "released: the two earlier keys' records only")

	short := b.with(idemhttp.Config{Mode: idemhttp.Leased, Timeout: 300 * time.Millisecond}, handler)
	key = newKey()
	start := time.Now()
	r = b.direct(t, short, key, `{"amount":5,"then":"slow"}`)
	require.Less(t, time.Since(start), 5*time.Second)
	require.Equal(t, http.StatusGatewayTimeout, r.status, "the handler's own answer to Timeout")
	require.Equal(t, 2, b.records(t), "released")
	r = b.post(t, key, `{"amount":5}`)
	require.Equal(t, http.StatusCreated, r.status)
}

// rival returns a store on b's database whose clock runs an hour ahead and
// that takes expired leases over blindly: from its point of view every
// lease of b's store has run out.
func (b *bundle[TTx]) rival(t *testing.T) *idem.Store[TTx] {
	t.Helper()
	s, err := idem.New(b.ns.dialect, &idem.Config{
		BlindTakeover: true,
		Now:           func() time.Time { return time.Now().Add(time.Hour) },
	})
	require.NoError(t, err)
	return s
}

// takeOver makes the rival take the key of r over, as a new holder would
// after the request's lease ran out.
func (b *bundle[TTx]) takeOver(t *testing.T, rival *idem.Store[TTx], r *http.Request) (*idem.Lease[TTx], error) {
	t.Helper()
	key, _ := idemhttp.Key(r.Context())
	scope, _ := idemhttp.Scope(r.Context())
	rec, err := b.store.Get(r.Context(), scope, key)
	if err != nil {
		return nil, err
	}
	return rival.Acquire(r.Context(), scope, key, rec.Fingerprint)
}

// testLeasedLostAtCompletion: a handler whose key was taken over while it
// worked is fenced at completion: its transaction rolls back, it gets 503
// idempotency_lease_lost, and nothing of it is stored; the new holder's
// result is what retries get.
func testLeasedLostAtCompletion[TTx any](t *testing.T, h harness[TTx]) {
	p := newProvider()
	var taken atomic.Pointer[idem.Lease[TTx]]
	var rival *idem.Store[TTx]
	b := setup(t, h, options[TTx]{
		cfg: leasedConfig(),
		handler: pay[TTx](p, func(b *bundle[TTx], w http.ResponseWriter, r *http.Request) bool {
			l, err := b.takeOver(t, rival, r)
			if !assert.NoError(t, err) {
				return false
			}
			taken.Store(l)
			return true
		}),
	})
	rival = b.rival(t)
	key := newKey()
	r := b.post(t, key, orderBody)
	require.Equal(t, http.StatusServiceUnavailable, r.status, "%s", r.body)
	require.Equal(t, idemhttp.CodeLeaseLost, r.code(t))
	require.NotEmpty(t, r.header.Get("Retry-After"))
	require.Zero(t, b.orders(t), "the payment row was rolled back")
	rec, err := rival.Get(t.Context(), payScope, key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusProcessing, rec.Status, "nothing was stored")
	require.Equal(t, 2, rec.Attempt, "the record is the new holder's")

	l := taken.Load()
	require.NotNil(t, l)
	require.NoError(t, l.Complete(t.Context(), &idem.Response{StatusCode: http.StatusCreated, Body: []byte("attempt 2")}))
	r = b.post(t, key, orderBody)
	require.True(t, r.replayed())
	require.Equal(t, "attempt 2", string(r.body), "retries get the new holder's result")
	require.Equal(t, "lease_lost", b.logs.records(t, "idemhttp: request")[0]["outcome"])
}

// testLeasedLostWhileRunning: KeepAlive finds the lease lost while the
// handler works: the handler's context is cancelled with idem.ErrFenced as
// its cause, Tx refuses to begin a transaction, and the client gets 503
// idempotency_lease_lost.
func testLeasedLostWhileRunning[TTx any](t *testing.T, h harness[TTx]) {
	p := newProvider()
	var (
		rival  *idem.Store[TTx]
		cause  atomic.Value
		txOK   atomic.Bool
		timely atomic.Bool
	)
	b := setup(t, h, options[TTx]{
		cfg:     leasedConfig(),
		idemCfg: &idem.Config{LeaseDuration: 300 * time.Millisecond}, // renewed every 100ms
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, _ TTx, _ bool) {
			if _, err := b.takeOver(t, rival, r); !assert.NoError(t, err) {
				return
			}
			select {
			case <-r.Context().Done():
				timely.Store(true)
				cause.Store(context.Cause(r.Context()))
			case <-time.After(5 * time.Second):
			}
			_, ok := idemhttp.Tx[TTx](r.Context())
			txOK.Store(ok)
			w.WriteHeader(http.StatusCreated) // ignored: the lease is lost
		},
	})
	rival = b.rival(t)
	r := b.post(t, newKey(), orderBody)
	require.True(t, timely.Load(), "the handler's context was cancelled")
	require.ErrorIs(t, cause.Load().(error), idem.ErrFenced)
	require.False(t, txOK.Load(), "no transaction for a lost lease")
	require.Equal(t, http.StatusServiceUnavailable, r.status, "%s", r.body)
	require.Equal(t, idemhttp.CodeLeaseLost, r.code(t))
	require.Zero(t, b.orders(t))
	require.Zero(t, p.total())
}

// testLeasedPanic: a panic rolls back, releases the lease, and propagates
// unchanged; the key is free again.
func testLeasedPanic[TTx any](t *testing.T, h harness[TTx]) {
	var (
		recovered atomic.Value
		panics    atomic.Bool
	)
	panics.Store(true)
	p := newProvider()
	sentinel := &panicValue{n: 13}
	b := setup(t, h, options[TTx]{
		cfg: leasedConfig(),
		handler: pay[TTx](p, func(b *bundle[TTx], w http.ResponseWriter, r *http.Request) bool {
			if panics.Swap(false) {
				tx, ok := idemhttp.Tx[TTx](r.Context())
				if !ok {
					return false
				}
				if _, err := b.insert(r, tx, 1); err != nil {
					return false
				}
				panic(sentinel)
			}
			return true
		}),
		outer: func(next http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				defer func() {
					if v := recover(); v != nil {
						recovered.Store(v)
						http.Error(w, "recovered", http.StatusInternalServerError)
					}
				}()
				next.ServeHTTP(w, r)
			})
		},
	})
	key := newKey()
	r := b.post(t, key, orderBody)
	require.Equal(t, http.StatusInternalServerError, r.status)
	require.Same(t, sentinel, recovered.Load())
	require.Zero(t, b.orders(t), "rolled back")
	require.Zero(t, b.records(t), "released")
	require.Equal(t, "panic", b.logs.records(t, "idemhttp: request")[0]["outcome"])
	r = b.post(t, key, orderBody)
	require.Equal(t, http.StatusCreated, r.status, "the key is free again")
	require.Equal(t, 1, b.orders(t))
}

// testLeasedStoreFailures: an unreachable store runs no handler; a commit
// that fails after a 201 answers 503 and leaves the record processing (the
// outside effect may have happened: the status check decides once the
// lease ran out), so the retry gets 409 in progress, not a second charge.
func testLeasedStoreFailures[TTx any](t *testing.T, h harness[TTx]) {
	down := setup(t, h, options[TTx]{cfg: leasedConfig(), unreachable: true})
	r := down.post(t, newKey(), orderBody)
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, idemhttp.CodeStoreUnavailable, r.code(t))
	require.Zero(t, down.calls.Load())

	p := newProvider()
	b := setup(t, h, options[TTx]{
		cfg: leasedConfig(),
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			pay[TTx](p, nil)(b, w, r, tx, ok)
			if tx, ok := idemhttp.Tx[TTx](r.Context()); ok {
				assert.NoError(t, b.ns.breakTx(r.Context(), tx))
			}
		},
	})
	key := newKey()
	r = b.post(t, key, orderBody)
	require.Equal(t, http.StatusServiceUnavailable, r.status, "%s", r.body)
	require.Equal(t, idemhttp.CodeStoreUnavailable, r.code(t))
	require.Zero(t, b.orders(t))
	rec, err := b.store.Get(t.Context(), payScope, key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusProcessing, rec.Status, "kept for the status check")
	r = b.post(t, key, orderBody)
	require.Equal(t, http.StatusConflict, r.status)
	require.Equal(t, idemhttp.CodeInProgress, r.code(t))
	secs, err := strconv.Atoi(r.header.Get("Retry-After"))
	require.NoError(t, err)
	require.Equal(t, 1, secs, "the lease's time left (over 20s), capped at InProgressRetryAfter")
	require.Equal(t, 1, p.count(key))
}

// beginFailingDialect is a dialect whose Begin fails while failBegin is set,
// as when SQLite's write lock stays taken past the busy timeout or the
// connection pool is exhausted.
type beginFailingDialect[TTx any] struct {
	idem.Dialect[TTx]
	failBegin *atomic.Bool
}

func (d beginFailingDialect[TTx]) Begin(ctx context.Context) (TTx, error) {
	if d.failBegin.Load() {
		var zero TTx
		return zero, fmt.Errorf("begin: %w", idem.ErrStoreUnavailable)
	}
	return d.Dialect.Begin(ctx)
}

// The fault suite found it: the handler charged the provider, its Tx could
// not begin, it answered 503 as documented, and the key was released, so
// the retry charged again. The outside call comes before Tx in this mode,
// so a failed begin must keep the key for the status check.
func testLeasedBeginFails[TTx any](t *testing.T, h harness[TTx]) {
	p := newProvider()
	var failBegin atomic.Bool
	b := setup(t, h, options[TTx]{
		cfg:     leasedConfig(),
		idemCfg: &idem.Config{StatusCheck: p.statusCheck},
		wrapDialect: func(d idem.Dialect[TTx]) idem.Dialect[TTx] {
			return beginFailingDialect[TTx]{Dialect: d, failBegin: &failBegin}
		},
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, _ TTx, _ bool) {
			key, _ := idemhttp.Key(r.Context())
			p.charge(key)
			if _, ok := idemhttp.Tx[TTx](r.Context()); !ok {
				http.Error(w, "the payment could not be recorded", http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
		},
	})
	key := newKey()
	failBegin.Store(true)
	r := b.post(t, key, orderBody)
	require.Equal(t, http.StatusServiceUnavailable, r.status, "%s", r.body)
	require.Equal(t, idemhttp.CodeStoreUnavailable, r.code(t))
	rec, err := b.store.Get(t.Context(), payScope, key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusProcessing, rec.Status, "kept for the status check, not released")

	failBegin.Store(false)
	r = b.post(t, key, orderBody)
	require.Equal(t, http.StatusConflict, r.status, "%s", r.body)
	require.Equal(t, idemhttp.CodeInProgress, r.code(t))
	require.Equal(t, 1, p.count(key), "the retry must not charge again")
	require.EqualValues(t, 1, b.calls.Load())
}
