package conformance

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// Tenant isolation (issue 6, scenario 6): a scope names a tenant's
// operation, and a key guessed from another tenant must never reach that
// tenant's record, on any path: replay, fingerprint mismatch, a live lease,
// the recovery of a stale lease (by a claimer or by the reaper), and Get.
// Each case puts the same key in two or more scopes that differ as little
// as possible: by case, by a trailing space, by a prefix, by Unicode
// normalisation.
func tenantCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "TenantReplayStaysInScope", run: testTenantReplayStaysInScope[TTx]},
		{name: "TenantMismatchStaysInScope", run: testTenantMismatchStaysInScope[TTx]},
		{name: "TenantInProgressStaysInScope", run: testTenantInProgressStaysInScope[TTx]},
		{name: "TenantRecoveryStaysInScope", run: testTenantRecoveryStaysInScope[TTx]},
		{name: "TenantReaperStaysInScope", run: testTenantReaperStaysInScope[TTx]},
		{name: "TenantGetStaysInScope", run: testTenantGetStaysInScope[TTx]},
	}
}

// tenantScopes are scopes a careless store could confuse with
// "tenant-a/orders": another case, a trailing space, a prefix, an
// extension, and "é" decomposed where the first has it composed.
var tenantScopes = []string{
	"tenant-a/orders",
	"TENANT-A/orders",
	"tenant-a/orders ",
	"tenant-a",
	"tenant-a/orders/x",
	"tenant-b/orders",
}

const (
	composedScope   = "caf\u00e9/orders"  // é as one code point
	decomposedScope = "cafe\u0301/orders" // e and a combining acute accent
)

// tenantResponse is a response only scope's tenant may ever see.
func tenantResponse(scope string) *idem.Response {
	return &idem.Response{
		StatusCode: 201,
		Header:     map[string][]string{"Content-Type": {"application/json"}},
		Body:       []byte(`{"secret of":"` + scope + `"}`),
	}
}

// testTenantReplayStaysInScope: the same key and the same fingerprint in
// every scope; each scope runs its callback once and replays only its own
// response.
func testTenantReplayStaysInScope[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("tenant-replay")
	scopes := append(append([]string(nil), tenantScopes...), composedScope, decomposedScope)
	calls := map[string]int{}
	// The business rows are named by the scope's index: the test table's
	// collation may be case-insensitive and ignore trailing spaces, which
	// idem's own table must not do.
	ref := func(scope string) string { return strconv.Itoa(slices.Index(scopes, scope)) + "|" + key }
	run := func(scope string) *idem.Result {
		res, err := b.store.Do(ctx, scope, key, fp("same body"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
			calls[scope]++
			if err := b.ns.InsertOrder(ctx, tx, ref(scope)); err != nil {
				return nil, err
			}
			return tenantResponse(scope), nil
		})
		require.NoError(t, err, "scope %q", scope)
		return res
	}
	for _, scope := range scopes {
		res := run(scope)
		require.False(t, res.Replayed, "scope %q was answered with another scope's record", scope)
		requireSameResponse(t, tenantResponse(scope), res.Response)
	}
	for _, scope := range scopes {
		res := run(scope)
		require.True(t, res.Replayed, "scope %q", scope)
		requireSameResponse(t, tenantResponse(scope), res.Response)
		require.Equal(t, 1, calls[scope], "scope %q ran its callback again", scope)
		require.Equal(t, 1, b.orders(ctx, t, ref(scope)), "scope %q", scope)
	}
	require.Equal(t, len(scopes), b.records(ctx, t))
}

// testTenantMismatchStaysInScope: another tenant's request under the same
// key, with another fingerprint, is a new request there, not a mismatch
// (which would tell it the key exists elsewhere), and leaves the first
// tenant's record exactly as it was.
func testTenantMismatchStaysInScope[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("tenant-mismatch")
	a, other := tenantScopes[0], tenantScopes[1:]

	c, err := b.store.Claim(ctx, a, key, fp("a's body"))
	require.NoError(t, err)
	require.NoError(t, b.store.Complete(ctx, c, tenantResponse(a)))
	before, err := b.store.Get(ctx, a, key)
	require.NoError(t, err)

	for _, scope := range other {
		c, err := b.store.Claim(ctx, scope, key, fp("another body in "+scope))
		require.NoError(t, err, "scope %q got a mismatch from another scope's record", scope)
		require.True(t, c.Acquired(), "scope %q", scope)
		require.NoError(t, b.store.Complete(ctx, c, tenantResponse(scope)))
	}
	after, err := b.store.Get(ctx, a, key)
	require.NoError(t, err)
	require.Equal(t, before, after, "another tenant's claims changed the record")

	// Within a scope the mismatch still holds, so the cases above did not
	// pass because fingerprints are ignored.
	_, err = b.store.Claim(ctx, a, key, fp("another body in "+other[0]))
	require.ErrorIs(t, err, idem.ErrFingerprint)
}

// testTenantInProgressStaysInScope: a tenant's live lease on a key neither
// blocks nor reveals itself to another tenant using the same key, on the
// pool (Acquire, Claim) or in a transaction (Do).
func testTenantInProgressStaysInScope[TTx any](t *testing.T, h Harness[TTx]) {
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 30 * time.Second, Now: clk.Now})
	key := newKey("tenant-live")
	a := tenantScopes[0]
	held, err := b.store.Acquire(ctx, a, key, fp("x"))
	require.NoError(t, err)
	require.True(t, held.Acquired())

	for i, scope := range tenantScopes[1:] {
		var err error
		switch i % 3 {
		case 0:
			var l *idem.Lease[TTx]
			l, err = b.store.Acquire(ctx, scope, key, fp("x"))
			if err == nil {
				require.True(t, l.Acquired(), "scope %q", scope)
				require.Equal(t, 1, l.Attempt(), "scope %q saw another scope's attempts", scope)
				err = l.Complete(ctx, tenantResponse(scope))
			}
		case 1:
			var c *idem.Claim
			c, err = b.store.Claim(ctx, scope, key, fp("x"))
			if err == nil {
				require.True(t, c.Acquired(), "scope %q", scope)
				err = b.store.Complete(ctx, c, tenantResponse(scope))
			}
		default:
			var res *idem.Result
			res, err = b.store.Do(ctx, scope, key, fp("x"), func(context.Context, TTx) (*idem.Response, error) {
				return tenantResponse(scope), nil
			})
			if err == nil {
				require.False(t, res.Replayed, "scope %q", scope)
			}
		}
		require.NoError(t, err, "scope %q was held up by another scope's lease", scope)
	}

	// The first tenant's lease is untouched and still its own.
	_, err = b.store.Acquire(ctx, a, key, fp("x"))
	require.ErrorIs(t, err, idem.ErrInProgress)
	require.NoError(t, held.Complete(ctx, tenantResponse(a)))
	rec, err := b.store.Get(ctx, a, key)
	require.NoError(t, err)
	requireSameResponse(t, tenantResponse(a), rec.Response)
}

// scopeCheck is a StatusCheck that answers per scope and records which
// scopes it was asked about.
type scopeCheck struct {
	mu        sync.Mutex
	committed map[string]bool // scope -> the effect happened
	asked     []string
}

func (c *scopeCheck) check(_ context.Context, rec idem.Record) (idem.Verdict, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.asked = append(c.asked, rec.Scope)
	if c.committed[rec.Scope] {
		return idem.Committed(tenantResponse(rec.Scope)), nil
	}
	return idem.NotCommitted(), nil
}

func (c *scopeCheck) askedAbout() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.asked...)
}

// testTenantRecoveryStaysInScope: tenant A's holder crashed after its
// effect (its lease ran out). Tenant B's claims of the same key acquire at
// once, without asking the status check about A's record; A's own retry
// recovers A's response, which B never gets.
func testTenantRecoveryStaysInScope[TTx any](t *testing.T, h Harness[TTx]) {
	sc := &scopeCheck{committed: map[string]bool{"tenant-a/orders": true}}
	ctx, b, clk := leaseSetup(t, h, sc.check)
	key := newKey("tenant-recover")
	a, bScope := "tenant-a/orders", "tenant-b/orders"
	_, err := b.store.Acquire(ctx, a, key, fp("x"))
	require.NoError(t, err) // ... and the holder dies
	clk.advance(31 * time.Second)

	l, err := b.store.Acquire(ctx, bScope, key, fp("x"))
	require.NoError(t, err)
	require.True(t, l.Acquired(), "tenant B got tenant A's recovered response")
	require.Equal(t, 1, l.Attempt())
	require.Empty(t, sc.askedAbout(), "tenant B's claim resolved tenant A's record")
	require.NoError(t, l.Complete(ctx, tenantResponse(bScope)))

	// A case-variant of A's scope is another tenant too.
	var calls counter
	res, err := b.store.Do(ctx, "TENANT-A/orders", key, fp("x"), orderFn(b.ns, "upper|"+key, &calls))
	require.NoError(t, err)
	require.False(t, res.Replayed, "a scope differing by case got tenant A's recovered response")
	require.Empty(t, sc.askedAbout())

	rec, err := b.store.Get(ctx, a, key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusProcessing, rec.Status, "tenant A's stale record was touched")

	// A's retry recovers A's response, and only A's record was checked.
	c, err := b.store.Claim(ctx, a, key, fp("x"))
	require.NoError(t, err)
	require.False(t, c.Acquired())
	requireSameResponse(t, tenantResponse(a), c.Replay.Response)
	require.Equal(t, []string{a}, sc.askedAbout())

	// B's record still replays B's own response.
	again, err := b.store.Acquire(ctx, bScope, key, fp("x"))
	require.NoError(t, err)
	require.False(t, again.Acquired())
	requireSameResponse(t, tenantResponse(bScope), again.Replay.Response)
}

// testTenantReaperStaysInScope: two tenants' holders of the same key both
// crashed; only A's effect happened. The reaper resolves each record from
// its own scope's verdict: A's is finalised with A's response, B's handed
// over, and B's retry runs B's work instead of getting A's response.
func testTenantReaperStaysInScope[TTx any](t *testing.T, h Harness[TTx]) {
	sc := &scopeCheck{committed: map[string]bool{"tenant-a/orders": true}}
	ctx, b, clk := leaseSetup(t, h, sc.check)
	key := newKey("tenant-reap")
	a, bScope := "tenant-a/orders", "tenant-b/orders"
	for _, scope := range []string{a, bScope} {
		_, err := b.store.Acquire(ctx, scope, key, fp("x"))
		require.NoError(t, err)
	}
	clk.advance(31 * time.Second)

	reaper, err := idem.NewReaper(b.store, nil)
	require.NoError(t, err)
	rep, err := reaper.RunOnce(ctx)
	require.NoError(t, err)
	require.Equal(t, idem.ReapReport{Finalised: 1, HandedOver: 1}, rep)
	require.ElementsMatch(t, []string{a, bScope}, sc.askedAbout(), "each record checked once, under its own scope")

	rec, err := b.store.Get(ctx, a, key)
	require.NoError(t, err)
	require.Equal(t, idem.StatusSucceeded, rec.Status)
	requireSameResponse(t, tenantResponse(a), rec.Response)
	_, err = b.store.Get(ctx, bScope, key)
	require.ErrorIs(t, err, idem.ErrNotFound, "tenant B's record must be handed over, not given A's verdict")

	var calls counter
	res, err := b.store.Do(ctx, bScope, key, fp("x"), orderFn(b.ns, "b|"+key, &calls))
	require.NoError(t, err)
	require.False(t, res.Replayed, "tenant B's retry got tenant A's recovered response")
	require.Equal(t, 1, calls.get())
}

// testTenantGetStaysInScope: Get finds a record only under its exact scope
// and key.
func testTenantGetStaysInScope[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("tenant-get")
	c, err := b.store.Claim(ctx, composedScope, key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.store.Complete(ctx, c, tenantResponse(composedScope)))
	c, err = b.store.Claim(ctx, tenantScopes[0], key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.store.Complete(ctx, c, tenantResponse(tenantScopes[0])))

	for _, scope := range append([]string{decomposedScope, "CAF\u00c9/orders"}, tenantScopes[1:]...) {
		_, err := b.store.Get(ctx, scope, key)
		require.ErrorIs(t, err, idem.ErrNotFound, "scope %q read another scope's record", scope)
	}
	for _, scope := range []string{composedScope, tenantScopes[0]} {
		rec, err := b.store.Get(ctx, scope, key)
		require.NoError(t, err)
		require.Equal(t, scope, rec.Scope)
		requireSameResponse(t, tenantResponse(scope), rec.Response)
	}
}
