package idemhttp_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/idemhttp"
)

// testPoisonedRecordAnswers500 (issue 12): a stored record whose status is
// no final HTTP status (0 from a status check that forgot it, written by an
// older version; 42; 1000) is answered with 500 idempotency_record_invalid
// in both modes: never a panic in WriteHeader, never a dropped connection,
// never a second run; the record is left for an operator.
func testPoisonedRecordAnswers500[TTx any](t *testing.T, h harness[TTx]) {
	for _, mode := range []idemhttp.Mode{idemhttp.Transactional, idemhttp.Leased} {
		b := setup(t, h, options[TTx]{cfg: &idemhttp.Config{Mode: mode}, handler: modeHandler[TTx](mode)})
		key := newKey()
		require.Equal(t, http.StatusCreated, b.post(t, key, orderBody).status, mode)
		for _, status := range []int{0, 42, 1000} {
			require.NoError(t, b.ns.setStoredStatus(context.WithoutCancel(t.Context()), status))
			r := b.post(t, key, orderBody)
			require.Equal(t, http.StatusInternalServerError, r.status, "%s, status %d", mode, status)
			require.Equal(t, idemhttp.CodeRecordInvalid, r.code(t), "%s, status %d", mode, status)
			require.False(t, r.replayed())
		}
		require.Equal(t, int64(1), b.calls.Load(), "%s: the handler never runs again", mode)
		require.Equal(t, 1, b.orders(t), mode)
		require.Equal(t, 1, b.records(t), "%s: the record is left as it is", mode)
		recs := b.logs.records(t, "idemhttp: request")
		require.Equal(t, "record_invalid", recs[len(recs)-1]["outcome"])
		require.NotEmpty(t, b.logs.records(t, "idem: stored record is invalid; answering ErrCorruptRecord, the row is left for an operator to delete"),
			"the store logs the record's digest")
	}
}

// modeHandler is createOrder for the transactional mode and its leased
// equivalent, which takes its transaction through idemhttp.Tx.
func modeHandler[TTx any](mode idemhttp.Mode) handlerFunc[TTx] {
	if mode == idemhttp.Transactional {
		return createOrder[TTx]
	}
	return func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, _ TTx, _ bool) {
		tx, ok := idemhttp.Tx[TTx](r.Context())
		createOrder(b, w, r, tx, ok)
	}
}

// testInvalidResponseRefused (issue 12): a handler's response the store
// refuses (a status outside 200-599, a replayed header with a newline) is
// answered with 500 idempotency_response_invalid. Transactional: rolled
// back, nothing stored, the key free. Leased: the record stays processing
// (the outside effect may have happened), so a retry is in progress.
func testInvalidResponseRefused[TTx any](t *testing.T, h harness[TTx]) {
	bad := []struct {
		name  string
		write func(w http.ResponseWriter, r *http.Request)
	}{
		// Failures are stored only when final; 600 is one to WriteHeader.
		{"final status 600", func(w http.ResponseWriter, r *http.Request) {
			require.True(t, idemhttp.MarkFinal(r.Context()))
			w.WriteHeader(600)
		}},
		{"newline in Location", func(w http.ResponseWriter, _ *http.Request) {
			w.Header()["Location"] = []string{"/orders/1\r\nSet-Cookie: a=b"}
			w.WriteHeader(http.StatusCreated)
		}},
	}
	for _, mode := range []idemhttp.Mode{idemhttp.Transactional, idemhttp.Leased} {
		for _, c := range bad {
			handler := func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
				if mode == idemhttp.Leased {
					tx, ok = idemhttp.Tx[TTx](r.Context())
				}
				require.True(t, ok)
				_, err := b.insert(r, tx, 1)
				require.NoError(t, err)
				c.write(w, r)
			}
			b := setup(t, h, options[TTx]{cfg: &idemhttp.Config{Mode: mode}, handler: handler})
			key := newKey()
			r := b.post(t, key, orderBody)
			require.Equal(t, http.StatusInternalServerError, r.status, "%s: %s", mode, c.name)
			require.Equal(t, idemhttp.CodeResponseInvalid, r.code(t), "%s: %s", mode, c.name)
			require.Zero(t, b.orders(t), "%s: %s: the business writes roll back", mode, c.name)
			if mode == idemhttp.Transactional {
				require.Zero(t, b.records(t), "%s: %s: nothing stored", mode, c.name)
				continue
			}
			require.Equal(t, 1, b.records(t), "%s: %s: the record stays processing", mode, c.name)
			again := b.post(t, key, orderBody)
			require.Equal(t, http.StatusConflict, again.status, "%s: %s", mode, c.name)
			require.Equal(t, idemhttp.CodeInProgress, again.code(t))
		}
	}
}

// testCaseVariantMethodRefused (issue 12): "post" is not POST (methods are
// case-sensitive), yet a router that folds case would run the POST handler
// unprotected. The middleware refuses case variants of protected methods
// with 400 idempotency_method_invalid, key or no key; unrelated methods
// still pass through.
func testCaseVariantMethodRefused[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	for _, m := range []string{"post", "Post", "pOST", "patch"} {
		for _, key := range []string{newKey(), ""} {
			r := b.post(t, key, orderBody, method(m))
			require.Equal(t, http.StatusBadRequest, r.status, m)
			require.Equal(t, idemhttp.CodeMethodInvalid, r.code(t), m)
		}
	}
	require.Zero(t, b.calls.Load())
	require.Zero(t, b.records(t))
	r := b.post(t, "", "", method("get"))
	require.Equal(t, http.StatusTeapot, r.status, "a method that is not protected in any case passes through")

	// Config.Methods is matched in upper case, so a lower-case entry
	// protects the upper-case method and refuses the lower-case one.
	putOnly := b.with(idemhttp.Config{Methods: []string{"put"}}, nil)
	r = b.direct(t, putOnly, "", orderBody, method("put"))
	require.Equal(t, idemhttp.CodeMethodInvalid, r.code(t))
}
