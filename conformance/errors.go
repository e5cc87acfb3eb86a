package conformance

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func errorCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "InvalidKeysAndScopes", run: testInvalidKeysAndScopes[TTx]},
		{name: "LongestKeyAndScopeRoundTrip", run: testLongestKeyAndScopeRoundTrip[TTx]},
		{name: "ClosedPoolIsUnavailable", run: testClosedPoolIsUnavailable[TTx]},
		{name: "UnreachableServerIsUnavailable", run: testUnreachableServerIsUnavailable[TTx]},
		{name: "CanceledContext", run: testCanceledContext[TTx]},
		{name: "NoRawKeyOrScopeInErrors", run: testNoRawKeyOrScopeInErrors[TTx]},
	}
}

func testInvalidKeysAndScopes[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	bad := []struct {
		name string
		text string
	}{
		{"empty", ""},
		{"too long", strings.Repeat("k", idem.MaxKeyLength+1)},
		{"NUL", "abc\x00def"},
		{"newline", "abc\ndef"},
		{"tab", "abc\tdef"},
		{"DEL", "abc\x7f"},
		{"C1 control", "abc\u0085"},
		{"invalid UTF-8", "abc\xff"},
	}
	var calls counter
	for _, tc := range bad {
		_, err := b.store.Claim(ctx, "t1/create", tc.text, fp("x"))
		require.ErrorIs(t, err, idem.ErrInvalidKey, tc.name)
		_, err = b.store.Claim(ctx, tc.text, "valid-key", fp("x"))
		require.ErrorIs(t, err, idem.ErrInvalidScope, tc.name)
		_, err = b.store.Do(ctx, "t1/create", tc.text, fp("x"), orderFn(b.ns, "x", &calls))
		require.ErrorIs(t, err, idem.ErrInvalidKey, tc.name)
		_, err = b.store.Get(ctx, "t1/create", tc.text)
		require.ErrorIs(t, err, idem.ErrInvalidKey, tc.name)

		tx := b.begin(ctx, t)
		_, err = b.store.ClaimTx(ctx, tx, tc.text, "valid-key", fp("x"))
		require.ErrorIs(t, err, idem.ErrInvalidScope, tc.name)
		require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))

		forged := &idem.Claim{Scope: "t1/create", Key: tc.text, Token: 1}
		require.ErrorIs(t, b.store.Complete(ctx, forged, orderResponse("x")), idem.ErrInvalidKey, tc.name)
	}
	require.Zero(t, calls.get())
	require.Zero(t, b.records(ctx, t), "nothing may be written for invalid input")
}

func testLongestKeyAndScopeRoundTrip[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	// Multi-byte characters up to exactly the byte limit.
	key := strings.Repeat("🔑", idem.MaxKeyLength/4) + strings.Repeat("k", idem.MaxKeyLength%4)
	scope := strings.Repeat("é", idem.MaxScopeLength/2) + strings.Repeat("s", idem.MaxScopeLength%2)
	require.Len(t, key, idem.MaxKeyLength)
	require.Len(t, scope, idem.MaxScopeLength)

	c, err := b.store.Claim(ctx, scope, key, fp("x"))
	require.NoError(t, err)
	require.NoError(t, b.store.Complete(ctx, c, orderResponse("long")))
	rec, err := b.store.Get(ctx, scope, key)
	require.NoError(t, err)
	require.Equal(t, key, rec.Key)
	require.Equal(t, scope, rec.Scope)

	// A key differing only in its last byte is another record.
	other := key[:len(key)-1] + "j"
	c2, err := b.store.Claim(ctx, scope, other, fp("x"))
	require.NoError(t, err)
	require.True(t, c2.Acquired())
}

func testClosedPoolIsUnavailable[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	key := newKey("closed")
	c, err := b.store.Claim(ctx, "t1/create", key, fp("x"))
	require.NoError(t, err)
	b.ns.Close()
	requireUnavailable(ctx, t, b.store)
	require.ErrorIs(t, b.store.Complete(ctx, c, orderResponse(key)), idem.ErrStoreUnavailable)
}

func testUnreachableServerIsUnavailable[TTx any](t *testing.T, h Harness[TTx]) {
	ctx := t.Context()
	store, err := idem.New(h.Unreachable(ctx, t), &idem.Config{WaitTimeout: time.Second})
	require.NoError(t, err)
	requireUnavailable(ctx, t, store)
}

// requireUnavailable checks that every entry point fails closed.
func requireUnavailable[TTx any](ctx context.Context, t *testing.T, store *idem.Store[TTx]) {
	t.Helper()
	key := newKey("down")
	_, err := store.Claim(ctx, "t1/create", key, fp("x"))
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	_, err = store.Get(ctx, "t1/create", key)
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	ran := false
	_, err = store.Do(ctx, "t1/create", key, fp("x"), func(context.Context, TTx) (*idem.Response, error) {
		ran = true
		return &idem.Response{StatusCode: 200}, nil
	})
	require.ErrorIs(t, err, idem.ErrStoreUnavailable)
	require.False(t, ran, "the business effect ran without idempotency protection")
}

func testCanceledContext[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, nil)
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	key := newKey("canceled")
	_, err := b.store.Claim(canceled, "t1/create", key, fp("x"))
	require.ErrorIs(t, err, context.Canceled)
	var calls counter
	_, err = b.store.Do(canceled, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
	require.ErrorIs(t, err, context.Canceled)
	require.Zero(t, calls.get())
	require.Zero(t, b.records(ctx, t))
}

// testNoRawKeyOrScopeInErrors provokes every error a caller can see and
// checks none of them reveals the key or the scope.
func testNoRawKeyOrScopeInErrors[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b := setup(t, h, &idem.Config{WaitTimeout: time.Second})
	const scope = "SECRET-SCOPE-4242/op"
	key := newKey("SECRET-KEY-1717")
	var errs []error
	record := func(err error) {
		t.Helper()
		require.Error(t, err)
		errs = append(errs, err)
	}

	c, err := b.store.Claim(ctx, scope, key, fp("x"))
	require.NoError(t, err)
	_, err = b.store.Claim(ctx, scope, key, fp("x"))
	record(err) // in progress
	_, err = b.store.Claim(ctx, scope, key, fp("y"))
	record(err) // mismatch
	stale := *c
	stale.Token--
	record(b.store.Complete(ctx, &stale, orderResponse("x"))) // fenced
	record(b.store.Release(ctx, &stale))
	_, err = b.store.Get(ctx, scope, newKey("SECRET-KEY-1717"))
	record(err) // not found
	_, err = b.store.Claim(ctx, scope, key+strings.Repeat("x", idem.MaxKeyLength), fp("x"))
	record(err) // invalid
	_, err = b.store.Claim(ctx, scope+"\n", key, fp("x"))
	record(err)

	if !b.feat.SingleWriter {
		k2 := newKey("SECRET-KEY-1717")
		holder := b.begin(ctx, t)
		_, err = b.store.ClaimTx(ctx, holder, scope, k2, fp("x"))
		require.NoError(t, err)
		_, err = b.store.Claim(ctx, scope, k2, fp("x"))
		record(err) // in progress, uncommitted holder
		require.NoError(t, b.ns.Dialect.Rollback(ctx, holder))
	}

	b.ns.Close()
	_, err = b.store.Claim(ctx, scope, key, fp("x"))
	record(err) // unavailable
	_, err = b.store.Do(ctx, scope, key, fp("x"), func(context.Context, TTx) (*idem.Response, error) { return nil, nil })
	record(err)

	for _, err := range errs {
		msg := err.Error()
		require.NotContains(t, msg, "SECRET-KEY-1717")
		require.NotContains(t, msg, "SECRET-SCOPE-4242")
	}
}
