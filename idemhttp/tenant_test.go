package idemhttp_test

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
)

// Scenario 6 of issue 6, tenant isolation at the HTTP layer: a key guessed
// from another tenant never gets that tenant's response, whether the key is
// completed there (replay), used there with another body (mismatch), being
// processed there (in progress), or left behind there by a crashed holder
// (recovery by the retry or the reaper). The conformance suite proves the
// same of the store (conformance/tenant.go); this proves the middleware
// puts each tenant in its own scope.

// isolationTenants are tenants a careless scope could confuse: "acme"
// with another case, with its path escaped, with text that imitates the
// rest of a scope, "café" composed and decomposed, and two tenants whose
// escaped form ("é" is "%C3%A9") makes a scope longer than
// idem.MaxScopeLength, differing only past that length: their scopes are
// digests, which must not truncate them first. (The tenants themselves fit
// the test's orders.tenant VARCHAR(255).)
var isolationTenants = []string{
	"acme", "globex", "ACME", "acme%20", "acme POST /orders", "acme/../globex",
	"caf\u00e9", "cafe\u0301",
	strings.Repeat("\u00e9", 84) + "-a", strings.Repeat("\u00e9", 84) + "-b",
}

// TestTenantIsolationHTTP runs the scenario on every dialect in both modes,
// and prints the figures of docs/reliability.md (run with -v).
func TestTenantIsolationHTTP(t *testing.T) {
	t.Parallel()
	for _, mode := range []idemhttp.Mode{idemhttp.Transactional, idemhttp.Leased} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			t.Run("sqlite", func(t *testing.T) {
				t.Parallel()
				testTenantIsolationModes(t, harness[*sqlTx](sqliteHarness{}), mode)
			})
			t.Run("postgres", func(t *testing.T) {
				t.Parallel()
				testTenantIsolationModes(t, harness[pgxTx](newPGHarness(t)), mode)
			})
			t.Run("mariadb", func(t *testing.T) {
				t.Parallel()
				testTenantIsolationModes(t, harness[*sqlTx](newMySQLHarness(t)), mode)
			})
		})
	}
}

// tenantTally counts the scenario's answers for the figures.
type tenantTally struct {
	requests      int
	answers       map[string]int
	crossReplays  int // replies naming an order created for another tenant
	ownReplays    int
	handlerCalled int
}

func (c *tenantTally) add(t *testing.T, r *reply) {
	t.Helper()
	c.requests++
	a := strconv.Itoa(r.status)
	switch {
	case r.replayed():
		a += " replayed"
	case r.status >= 400:
		a += " " + r.code(t)
	}
	c.answers[a]++
}

// secretOf is the part of a response only its tenant may see.
func secretOf(tenant string) string { return "secret of " + tenant }

func testTenantIsolationModes[TTx any](t *testing.T, h harness[TTx], mode idemhttp.Mode) {
	clk := &httpClock{now: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}
	var (
		checkMu sync.Mutex
		checked []string // the scopes the status check was asked about
	)
	check := func(_ context.Context, rec idem.Record) (idem.Verdict, error) {
		checkMu.Lock()
		checked = append(checked, rec.Scope)
		checkMu.Unlock()
		// Whatever the record, the check says the effect happened, with a
		// response that must never reach another tenant.
		return idem.Committed(&idem.Response{StatusCode: http.StatusCreated, Body: []byte(secretOf(strings.Fields(rec.Scope)[0]))}), nil
	}
	asked := func() []string {
		checkMu.Lock()
		defer checkMu.Unlock()
		return slices.Clone(checked)
	}
	hold, held := make(chan struct{}), make(chan struct{}, 1)
	b := setup(t, h, options[TTx]{
		cfg:     &idemhttp.Config{Mode: mode},
		idemCfg: &idem.Config{LeaseDuration: 30 * time.Second, Now: clk.Now, StatusCheck: check},
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			if r.Header.Get("X-Hold") != "" {
				held <- struct{}{}
				<-hold // in the leased mode, before the transaction begins
			}
			if mode == idemhttp.Leased {
				tx, ok = idemhttp.Tx[TTx](r.Context())
			}
			createOrder(b, w, r, tx, ok)
		},
	})
	tally := &tenantTally{answers: map[string]int{}}
	owners := map[string]string{} // order Location -> the tenant it was created for
	record := func(r *reply, tn string) {
		t.Helper()
		tally.add(t, r)
		if loc := r.header.Get("Location"); loc != "" {
			if owner, ok := owners[loc]; !ok {
				owners[loc] = tn
			} else if owner != tn {
				tally.crossReplays++
			}
		}
	}
	post := func(key, body, tn string, opts ...opt) *reply {
		t.Helper()
		r := b.post(t, key, body, append([]opt{tenant(tn)}, opts...)...)
		record(r, tn)
		return r
	}

	// Replay: the same key and body in every tenant runs once per tenant;
	// each replays only its own answer.
	key := newKey()
	firsts := map[string]*reply{}
	locations := map[string]string{}
	for _, tn := range isolationTenants {
		r := post(key, orderBody, tn)
		require.Equal(t, http.StatusCreated, r.status, "tenant %q: %s", tn, r.body)
		require.False(t, r.replayed(), "tenant %q got another tenant's response", tn)
		for other, loc := range locations {
			require.NotEqual(t, loc, r.header.Get("Location"), "tenants %q and %q share an order", tn, other)
		}
		locations[tn] = r.header.Get("Location")
		firsts[tn] = r
	}
	for _, tn := range isolationTenants {
		r := post(key, orderBody, tn)
		require.True(t, r.replayed(), "tenant %q", tn)
		require.Equal(t, firsts[tn].body, r.body, "tenant %q", tn)
		require.Equal(t, locations[tn], r.header.Get("Location"), "tenant %q replayed another tenant's order", tn)
		tally.ownReplays++
	}
	require.Equal(t, len(isolationTenants), b.orders(t))

	// Mismatch: another tenant's different body under a used key is a new
	// request there, never key_reused (which would tell that the key exists).
	key = newKey()
	require.Equal(t, http.StatusCreated, post(key, `{"amount":1}`, "acme").status)
	r := post(key, `{"amount":2}`, "globex")
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	require.False(t, r.replayed())
	r = post(key, `{"amount":3}`, "acme")
	require.Equal(t, http.StatusConflict, r.status, "the mismatch still holds within a tenant")
	require.Equal(t, idemhttp.CodeKeyReused, r.code(t))

	// In progress: while acme's request holds the key, globex's request
	// with the same key and body is answered at once, and acme's duplicate
	// waits or gets 409. SQLite's transaction holds the database's write
	// lock, so in the transactional mode only the leased and server
	// dialects can answer while it is held.
	if mode == idemhttp.Leased || !b.feat.waitsAtBegin {
		key = newKey()
		wait := b.postAsync(t, key, orderBody, tenant("acme"), header("X-Hold", "1"))
		<-held
		r = post(key, orderBody, "globex")
		require.Equal(t, http.StatusCreated, r.status, "globex was held up by acme's request: %s", r.body)
		require.False(t, r.replayed())
		if mode == idemhttp.Leased {
			r = post(key, orderBody, "acme")
			require.Equal(t, http.StatusConflict, r.status)
			require.Equal(t, idemhttp.CodeInProgress, r.code(t), "acme's own duplicate sees its request in progress")
		}
		hold <- struct{}{}
		first := wait()
		record(first, "acme")
		require.Equal(t, http.StatusCreated, first.status)
		require.NotEqual(t, r.header.Get("Location"), first.header.Get("Location"))
	}

	// Recovery: acme's holder of a key crashed (a lease left behind, as
	// leased processing leaves it); the status check would recover acme's
	// secret. globex's request with that key must run on its own, without
	// the check being asked, and the reaper must resolve acme's record
	// alone.
	key = newKey()
	_, err := b.store.Acquire(t.Context(), "acme POST /orders", key, idem.NewFingerprint([]byte("crashed")))
	require.NoError(t, err)
	clk.advance(time.Minute)
	r = post(key, orderBody, "globex")
	require.Equal(t, http.StatusCreated, r.status, "%s", r.body)
	require.False(t, r.replayed(), "globex got acme's recovered response")
	require.NotContains(t, string(r.body), secretOf("acme"))
	require.Empty(t, asked(), "globex's request resolved acme's stale record")
	globexAnswer := r

	reaper, err := idem.NewReaper(b.store, nil)
	require.NoError(t, err)
	rep, err := reaper.RunOnce(t.Context())
	require.NoError(t, err)
	require.Equal(t, 1, rep.Finalised, "%+v", rep)
	require.Equal(t, []string{"acme POST /orders"}, asked(), "the reaper resolved only acme's record")
	r = post(key, orderBody, "globex")
	require.True(t, r.replayed())
	require.Equal(t, globexAnswer.body, r.body, "globex replays its own answer, not acme's recovered one")
	tally.ownReplays++

	require.Zero(t, tally.crossReplays, "a tenant got an order created for another")
	tally.handlerCalled = int(b.calls.Load())
	require.Equal(t, b.orders(t), tally.handlerCalled, "every handler run committed exactly one order: no duplicates")

	answers := make([]string, 0, len(tally.answers))
	for a, n := range tally.answers {
		answers = append(answers, fmt.Sprintf("%s: %d", a, n))
	}
	slices.Sort(answers)
	t.Logf("tenant-isolation figures: dialect=%s mode=%s tenants=%d requests=%d handler_runs=%d orders=%d duplicates=0 own_replays=%d cross_tenant_replays=%d answers={%s}",
		h.name(), mode, len(isolationTenants), tally.requests, tally.handlerCalled, b.orders(t), tally.ownReplays, tally.crossReplays, strings.Join(answers, ", "))
}

// httpClock is a pinned clock for the store, so leases run out on demand.
type httpClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *httpClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *httpClock) advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}
