package idemhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
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

// TestMiddleware runs every case on every dialect: SQLite always,
// PostgreSQL and MariaDB when reachable (and required under CI). The point
// of issue 4 each case covers is in its comment.
func TestMiddleware(t *testing.T) {
	t.Parallel()
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		runCases(t, harness[*sqlTx](sqliteHarness{}))
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		runCases(t, harness[pgxTx](newPGHarness(t)))
	})
	t.Run("mariadb", func(t *testing.T) {
		t.Parallel()
		runCases(t, harness[*sqlTx](newMySQLHarness(t)))
	})
}

type testCase[TTx any] struct {
	name string
	run  func(t *testing.T, h harness[TTx])
}

func runCases[TTx any](t *testing.T, h harness[TTx]) {
	t.Helper()
	for _, c := range cases[TTx]() {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t, h)
		})
	}
}

// cases lists the cases in a fixed order.
func cases[TTx any]() []testCase[TTx] {
	return append([]testCase[TTx]{
		{"MethodsPassThrough", testMethodsPassThrough[TTx]},
		{"KeyMissing", testKeyMissing[TTx]},
		{"KeyInvalid", testKeyInvalid[TTx]},
		{"TenantIsolation", testTenantIsolation[TTx]},
		{"ScopeAndRoute", testScopeAndRoute[TTx]},
		{"JSONVariantsReplay", testJSONVariantsReplay[TTx]},
		{"GzipBodies", testGzipBodies[TTx]},
		{"BodyLimits", testBodyLimits[TTx]},
		{"FingerprintHook", testFingerprintHook[TTx]},
		{"CommitsWithBusinessWrites", testCommitsWithBusinessWrites[TTx]},
		{"CommitFailureGives503", testCommitFailureGives503[TTx]},
		{"FailureRollsBack", testFailureRollsBack[TTx]},
		{"MarkFinalStoresFailure", testMarkFinalStoresFailure[TTx]},
		{"PanicRollsBackAndPropagates", testPanicRollsBackAndPropagates[TTx]},
		{"RetryTransactionRunsAgain", testRetryTransactionRunsAgain[TTx]},
		{"ClientDisconnectStillCommits", testClientDisconnectStillCommits[TTx]},
		{"ServerTimeoutBoundsTransaction", testServerTimeoutBoundsTransaction[TTx]},
		{"ReplayHeadersAndStatus", testReplayHeadersAndStatus[TTx]},
		{"MismatchConflict", testMismatchConflict[TTx]},
		{"InProgressLease", testInProgressLease[TTx]},
		{"InProgressUncommitted", testInProgressUncommitted[TTx]},
		{"StoreUnavailable", testStoreUnavailable[TTx]},
		{"StoreFailing", testStoreFailing[TTx]},
		{"ErrorContract", testErrorContract[TTx]},
		{"ContextAccessors", testContextAccessors[TTx]},
		{"LogsCarryNoSecrets", testLogsCarryNoSecrets[TTx]},
		{"ResponseSizeLimit", testResponseSizeLimit[TTx]},
		{"ConcurrentDuplicates", testConcurrentDuplicates[TTx]},
		{"PoisonedRecordAnswers500", testPoisonedRecordAnswers500[TTx]},
		{"InvalidResponseRefused", testInvalidResponseRefused[TTx]},
		{"CaseVariantMethodRefused", testCaseVariantMethodRefused[TTx]},
	}, leasedCases[TTx]()...)
}

const orderBody = `{"amount":1500}`

// testMethodsPassThrough (point 1): only POST and PATCH are protected by
// default; other methods reach the handler untouched, without a key or a
// transaction. Config.Methods changes the set.
func testMethodsPassThrough[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	for _, m := range []string{http.MethodGet, http.MethodPut, http.MethodDelete} {
		r := b.post(t, "", "", method(m))
		require.Equal(t, http.StatusTeapot, r.status, "%s reaches the handler without a transaction", m)
		require.Empty(t, r.header.Get("X-Request-Id"), "%s is untouched", m)
	}
	r := b.post(t, newKey(), orderBody, method(http.MethodPatch))
	require.Equal(t, http.StatusCreated, r.status, "PATCH is protected")
	require.Equal(t, 1, b.records(t))

	putOnly := b.with(idemhttp.Config{Methods: []string{"put"}}, nil)
	r = b.direct(t, putOnly, "", orderBody, method(http.MethodPut))
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, idemhttp.CodeKeyMissing, r.code(t))
	r = b.direct(t, putOnly, "", orderBody)
	require.Equal(t, http.StatusTeapot, r.status, "POST is not protected when Methods lists PUT only")
	require.Equal(t, 1, b.records(t))
}

// testKeyMissing (point 2): no key is 400 idempotency_key_missing, with
// nothing stored and the handler not called, unless the route is optional.
func testKeyMissing[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{cfg: &idemhttp.Config{
		KeyOptional: func(r *http.Request) bool { return r.URL.Path == "/refunds" },
	}})
	r := b.post(t, "", orderBody)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, idemhttp.CodeKeyMissing, r.code(t))
	require.Zero(t, b.calls.Load())
	require.Zero(t, b.records(t))

	r = b.post(t, "", orderBody, path("/refunds"))
	require.Equal(t, http.StatusTeapot, r.status, "an optional route passes through without a transaction")
	require.Equal(t, int64(1), b.calls.Load())

	r = b.post(t, newKey(), orderBody, path("/refunds"))
	require.Equal(t, http.StatusCreated, r.status, "an optional route with a key is protected")
	require.Equal(t, 1, b.records(t))
}

// testKeyInvalid (point 2): malformed keys are 400 idempotency_key_invalid
// with nothing stored; the raw and the quoted form are one key.
func testKeyInvalid[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	invalid := []struct {
		name string
		opts []opt
	}{
		{"too short", []opt{header("Idempotency-Key", "abc")}},
		{"too long", []opt{header("Idempotency-Key", strings.Repeat("a", 65))}},
		{"bad character", []opt{header("Idempotency-Key", "abcdefghijkl$")}},
		{"space inside", []opt{header("Idempotency-Key", "abcdef ghijkl")}},
		{"empty", []opt{header("Idempotency-Key", "")}},
		{"unterminated quote", []opt{header("Idempotency-Key", `"abcdefghijkl`)}},
		{"quoted bad character", []opt{header("Idempotency-Key", `"abcdefghijkl$"`)}},
		{"two lines", []opt{header("Idempotency-Key", "abcdefghijkl"), header("Idempotency-Key", "abcdefghijkm")}},
	}
	for _, c := range invalid {
		r := b.post(t, "", orderBody, c.opts...)
		require.Equal(t, http.StatusBadRequest, r.status, c.name)
		require.Equal(t, idemhttp.CodeKeyInvalid, r.code(t), c.name)
	}
	// A client library refuses to send control characters; a proxy might not.
	for _, v := range []string{"abcdefghij\x00kl", "abcdefghijkl\x7f", "abcdef\nghijkl"} {
		r := b.direct(t, b.mux, "", orderBody, func(r *http.Request) { r.Header["Idempotency-Key"] = []string{v} })
		require.Equal(t, http.StatusBadRequest, r.status)
		require.Equal(t, idemhttp.CodeKeyInvalid, r.code(t))
	}
	require.Zero(t, b.calls.Load())
	require.Zero(t, b.records(t))

	key := newKey()
	r := b.post(t, `"`+key+`"`, orderBody)
	require.Equal(t, http.StatusCreated, r.status)
	again := b.post(t, key, orderBody)
	require.Equal(t, http.StatusCreated, again.status)
	require.True(t, again.replayed(), "the quoted and the raw form name the same key")
	require.Equal(t, r.body, again.body)
	require.Equal(t, int64(1), b.calls.Load())

	hexKeys := b.with(idemhttp.Config{KeyFormat: regexp.MustCompile(`^[0-9a-f]{8}$`)}, nil)
	r = b.direct(t, hexKeys, "deadbeef", orderBody)
	require.Equal(t, http.StatusCreated, r.status, "a custom format accepts its keys")
	r = b.direct(t, hexKeys, newKey(), orderBody)
	require.Equal(t, http.StatusBadRequest, r.status, "a custom format refuses others")
	require.Equal(t, idemhttp.CodeKeyInvalid, r.code(t))
}

// testTenantIsolation (point 3): the same key in another tenant is another
// record with its own order; the tenant hook can refuse a request.
func testTenantIsolation[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	key := newKey()
	a := b.post(t, key, orderBody, tenant("acme"))
	require.Equal(t, http.StatusCreated, a.status)
	o := b.post(t, key, orderBody, tenant("globex"))
	require.Equal(t, http.StatusCreated, o.status)
	require.False(t, o.replayed(), "another tenant never gets acme's response")
	require.NotEqual(t, a.header.Get("Location"), o.header.Get("Location"))
	require.Equal(t, 2, b.orders(t))
	require.Equal(t, 2, b.records(t))

	again := b.post(t, key, orderBody, tenant("acme"))
	require.True(t, again.replayed())
	require.Equal(t, a.body, again.body)

	r := b.post(t, newKey(), orderBody, tenant(""))
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, "tenant_missing", r.code(t), "an *Error from the hook is answered as it is")
	r = b.post(t, newKey(), orderBody, tenant("?"))
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, idemhttp.CodeTenantInvalid, r.code(t))
	r = b.post(t, newKey(), orderBody, tenant("!"))
	require.Equal(t, http.StatusBadRequest, r.status, "an *Error without a 4xx or 5xx status gets 400")
	require.Equal(t, "tenant_blocked", r.code(t))
	require.Equal(t, 2, b.records(t))
	require.Equal(t, int64(2), b.calls.Load())
}

// testScopeAndRoute (points 3 and 4): the operation is the route pattern;
// the fingerprint covers the actual path and query.
func testScopeAndRoute[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	key := newKey()
	r := b.post(t, key, orderBody, path("/orders/1/items"))
	require.Equal(t, http.StatusCreated, r.status)
	r = b.post(t, key, orderBody, path("/orders/2/items"))
	require.Equal(t, http.StatusConflict, r.status, "same pattern, other path: the key is bound to /orders/1/items")
	require.Equal(t, idemhttp.CodeKeyReused, r.code(t))
	r = b.post(t, key, orderBody, path("/refunds"))
	require.Equal(t, http.StatusCreated, r.status, "another operation is another record")
	require.False(t, r.replayed())
	require.Equal(t, 2, b.records(t))

	key = newKey()
	r = b.post(t, key, orderBody, path("/orders?b=2&a=1&a=0"))
	require.Equal(t, http.StatusCreated, r.status)
	r = b.post(t, key, orderBody, path("/orders?a=1&a=0&b=2"))
	require.True(t, r.replayed(), "query parameter order does not matter")
	r = b.post(t, key, orderBody, path("/orders?a=0&a=1&b=2"))
	require.Equal(t, http.StatusConflict, r.status, "the order of a repeated parameter does")
	require.Equal(t, int64(3), b.calls.Load())
}

// testJSONVariantsReplay (point 4): JSON that differs only in member order,
// whitespace and string escapes replays; numbers keep their exact literal,
// however long.
func testJSONVariantsReplay[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	key := newKey()
	first := b.post(t, key, `{"amount":1500,"items":[{"sku":"A-1","qty":2},{"sku":"B","qty":1}],"note":"gift"}`)
	require.Equal(t, http.StatusCreated, first.status)
	for _, variant := range []string{
		`{"note":"gift","items":[{"qty":2,"sku":"A-1"},{"qty":1,"sku":"B"}],"amount":1500}`,
		"\n{ \"amount\" : 1500 ,\t\"items\" : [ { \"sku\" : \"A-1\" , \"qty\" : 2 } , {\"sku\":\"B\",\"qty\":1} ] , \"note\" : \"gift\" }\r\n",
		`{"amount":1500,"items":[{"sku":"A\u002d1","qty":2},{"sku":"\u0042","qty":1}],"note":"g\u0069ft"}`,
	} {
		r := b.post(t, key, variant)
		require.Equal(t, http.StatusCreated, r.status, variant)
		require.True(t, r.replayed(), variant)
		require.Equal(t, first.body, r.body)
	}
	for _, changed := range []string{
		`{"amount":1500.0,"items":[{"sku":"A-1","qty":2},{"sku":"B","qty":1}],"note":"gift"}`,
		`{"amount":1500,"items":[{"sku":"B","qty":1},{"sku":"A-1","qty":2}],"note":"gift"}`,
		`{"amount":1500,"items":[{"sku":"A-1","qty":2},{"sku":"B","qty":1}],"note":"Gift"}`,
	} {
		r := b.post(t, key, changed)
		require.Equal(t, http.StatusConflict, r.status, changed)
		require.Equal(t, idemhttp.CodeKeyReused, r.code(t))
	}

	digits := strings.Repeat("1234567890", 1000) // a 10 000-digit number
	key = newKey()
	big := `{"amount":7,"ref":` + digits + `}`
	require.Equal(t, http.StatusCreated, b.post(t, key, big).status)
	require.True(t, b.post(t, key, `{ "ref": `+digits+`, "amount": 7 }`).replayed())
	r := b.post(t, key, `{"amount":7,"ref":`+digits[:len(digits)-1]+`1}`)
	require.Equal(t, http.StatusConflict, r.status, "numbers are never rounded: the last of 10 000 digits counts")
	require.Equal(t, int64(2), b.calls.Load())
	require.Equal(t, 2, b.orders(t))
}

// testGzipBodies (point 4): a gzip body is decoded before fingerprinting,
// so it replays the plain request; the handler gets the decoded body. Bombs
// and broken gzip are refused.
func testGzipBodies[TTx any](t *testing.T, h harness[TTx]) {
	var sawEncoding atomic.Value
	b := setup(t, h, options[TTx]{
		cfg: &idemhttp.Config{MaxBodyBytes: 64 << 10},
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			sawEncoding.Store(r.Header.Get("Content-Encoding"))
			createOrder(b, w, r, tx, ok)
		},
	})
	key := newKey()
	r := b.post(t, key, `{"amount":42, "note":"gz"}`, gzipped())
	require.Equal(t, http.StatusCreated, r.status, "the handler decoded the body: %s", r.body)
	require.Contains(t, string(r.body), `"amount":42`)
	require.Empty(t, sawEncoding.Load(), "the handler's request describes the decoded body")
	plain := b.post(t, key, `{"note":"gz","amount":42}`)
	require.True(t, plain.replayed(), "plain JSON replays the gzip request")
	require.Equal(t, r.body, plain.body)
	require.True(t, b.post(t, key, `{"amount":42,"note":"gz"}`, gzipped()).replayed())

	bomb := gzipBytes(make([]byte, 1<<20)) // 1 MiB of zeros in about 1 KiB
	r = b.post(t, newKey(), string(bomb), header("Content-Encoding", "gzip"))
	require.Equal(t, http.StatusRequestEntityTooLarge, r.status)
	require.Equal(t, idemhttp.CodeBodyTooLarge, r.code(t))
	r = b.post(t, newKey(), "not gzip at all", header("Content-Encoding", "gzip"))
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, idemhttp.CodeBodyInvalid, r.code(t))
	require.Equal(t, int64(1), b.calls.Load())
	require.Equal(t, 1, b.records(t))
}

// testBodyLimits (point 4): oversized, too deeply nested and malformed JSON
// bodies are refused before anything is stored; other media types are
// hashed as bytes.
func testBodyLimits[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	small := b.with(idemhttp.Config{MaxBodyBytes: 1024}, nil)
	big := `{"amount":1,"pad":"` + strings.Repeat("x", 1024) + `"}`
	r := b.direct(t, small, newKey(), big)
	require.Equal(t, http.StatusRequestEntityTooLarge, r.status, "refused by its Content-Length")
	require.Equal(t, idemhttp.CodeBodyTooLarge, r.code(t))
	r = b.direct(t, small, newKey(), big, func(r *http.Request) { r.ContentLength = -1 })
	require.Equal(t, http.StatusRequestEntityTooLarge, r.status, "refused while reading")
	require.Equal(t, idemhttp.CodeBodyTooLarge, r.code(t))

	deep := strings.Repeat("[", 100_000) + strings.Repeat("]", 100_000)
	r = b.post(t, newKey(), deep)
	require.Equal(t, http.StatusBadRequest, r.status, "100 000 levels of nesting")
	require.Equal(t, idemhttp.CodeBodyInvalid, r.code(t))
	for _, bad := range []string{`{"amount":`, `{"amount":1}{}`, `{"amount":01}`, `[1,]`, `{'a':1}`} {
		r = b.post(t, newKey(), bad)
		require.Equal(t, http.StatusBadRequest, r.status, bad)
		require.Equal(t, idemhttp.CodeBodyInvalid, r.code(t), bad)
	}
	require.Zero(t, b.calls.Load())
	require.Zero(t, b.records(t))

	// Other media types are hashed as the bytes they are.
	text := b.with(idemhttp.Config{}, func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
		w.WriteHeader(http.StatusAccepted)
	})
	key := newKey()
	r = b.direct(t, text, key, `{"a":1, "b":2}`, contentType("text/plain"))
	require.Equal(t, http.StatusAccepted, r.status)
	require.True(t, b.direct(t, text, key, `{"a":1, "b":2}`, contentType("text/plain; charset=utf-8")).replayed())
	r = b.direct(t, text, key, `{"b":2, "a":1}`, contentType("text/plain"))
	require.Equal(t, http.StatusConflict, r.status, "non-JSON bodies are hashed byte for byte")
	require.Equal(t, idemhttp.CodeKeyReused, r.code(t))
	r = b.direct(t, text, key, `{"a":1, "b":2}`, contentType("application/octet-stream"))
	require.Equal(t, http.StatusConflict, r.status, "the media type is part of the request")
}

// testFingerprintHook (point 4): the hook chooses what counts; its errors
// are rendered.
func testFingerprintHook[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	amountAndCurrency := b.with(idemhttp.Config{
		Fingerprint: func(r *http.Request, body []byte) ([]byte, error) {
			var in struct {
				Amount json.Number `json:"amount"`
			}
			if err := json.Unmarshal(body, &in); err != nil {
				return nil, err
			}
			if in.Amount == "" {
				return nil, &idemhttp.Error{Status: http.StatusUnprocessableEntity, Code: "amount_missing", Message: "amount is required"}
			}
			return []byte(in.Amount.String() + "\x00" + r.Header.Get("X-Currency")), nil
		},
	}, nil)
	key := newKey()
	r := b.direct(t, amountAndCurrency, key, `{"amount":5,"note":"a"}`, header("X-Currency", "EUR"))
	require.Equal(t, http.StatusCreated, r.status)
	r = b.direct(t, amountAndCurrency, key, `{"amount":5,"note":"b"}`, header("X-Currency", "EUR"))
	require.True(t, r.replayed(), "fields the hook leaves out do not count")
	r = b.direct(t, amountAndCurrency, key, `{"amount":5,"note":"a"}`, header("X-Currency", "USD"))
	require.Equal(t, http.StatusConflict, r.status, "a header the hook adds counts")

	r = b.direct(t, amountAndCurrency, newKey(), `{"note":"a"}`)
	require.Equal(t, http.StatusUnprocessableEntity, r.status)
	require.Equal(t, "amount_missing", r.code(t))
	r = b.direct(t, amountAndCurrency, newKey(), `[]`)
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, idemhttp.CodeFingerprintFailed, r.code(t))
	require.Equal(t, 1, b.records(t))
}

// testCommitsWithBusinessWrites (point 5): the handler's writes on Tx and
// the stored response are both committed when the client gets the 2xx.
func testCommitsWithBusinessWrites[TTx any](t *testing.T, h harness[TTx]) {
	var scope atomic.Value
	b := setup(t, h, options[TTx]{handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
		s, _ := idemhttp.Scope(r.Context())
		scope.Store(s)
		createOrder(b, w, r, tx, ok)
	}})
	key := newKey()
	r := b.post(t, key, orderBody)
	require.Equal(t, http.StatusCreated, r.status)
	require.False(t, r.replayed())
	require.Equal(t, 1, b.orders(t), "the order is committed when the client has the answer")
	rec, err := b.store.Get(t.Context(), scope.Load().(string), key)
	require.NoError(t, err, "and so is the stored response")
	require.Equal(t, idem.StatusSucceeded, rec.Status)
	require.Equal(t, http.StatusCreated, rec.Response.StatusCode)
	require.Equal(t, r.body, rec.Response.Body)
	require.Equal(t, r.header.Get("Location"), rec.Response.Header.Get("Location"))
}

// testCommitFailureGives503 (point 5): when the transaction cannot commit
// after the handler answered 201, the client gets 503 and nothing was
// stored; the response is sent only after the commit.
func testCommitFailureGives503[TTx any](t *testing.T, h harness[TTx]) {
	var sabotage atomic.Bool
	sabotage.Store(true)
	b := setup(t, h, options[TTx]{handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
		createOrder(b, w, r, tx, ok) // writes the order and answers 201
		if sabotage.Swap(false) {
			assert.NoError(t, b.ns.breakTx(r.Context(), tx))
		}
	}})
	key := newKey()
	r := b.post(t, key, orderBody)
	require.Equal(t, http.StatusServiceUnavailable, r.status, "the 201 is never sent when the commit fails: %s", r.body)
	require.Equal(t, idemhttp.CodeStoreUnavailable, r.code(t))
	require.NotEmpty(t, r.header.Get("Retry-After"))
	require.Zero(t, b.orders(t))
	require.Zero(t, b.records(t))

	r = b.post(t, key, orderBody)
	require.Equal(t, http.StatusCreated, r.status, "the retry runs the handler again")
	require.False(t, r.replayed())
	require.Equal(t, 1, b.orders(t))
}

// testFailureRollsBack (point 5): a 4xx or 5xx rolls back the handler's
// writes, passes through, and leaves the key free for a corrected retry.
func testFailureRollsBack[TTx any](t *testing.T, h harness[TTx]) {
	var status atomic.Int64
	b := setup(t, h, options[TTx]{handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
		if s := int(status.Load()); s != 0 {
			if _, err := b.insert(r, tx, 1); err != nil {
				http.Error(w, err.Error(), http.StatusTeapot)
				return
			}
			w.Header().Set("Set-Cookie", "seen=1")
			w.Header().Set("Content-Type", "text/plain")
			w.WriteHeader(s)
			fmt.Fprintf(w, "failed with %d", s)
			return
		}
		createOrder(b, w, r, tx, ok)
	}})
	for i, s := range []int{http.StatusUnprocessableEntity, http.StatusInternalServerError, http.StatusBadGateway} {
		status.Store(int64(s))
		key := newKey()
		r := b.post(t, key, orderBody)
		require.Equal(t, s, r.status)
		require.Equal(t, fmt.Sprintf("failed with %d", s), string(r.body), "passed through as written")
		require.Equal(t, "seen=1", r.header.Get("Set-Cookie"), "with every header")
		require.False(t, r.replayed())
		require.Equal(t, i, b.orders(t), "the handler's write was rolled back")
		require.Equal(t, i, b.records(t), "nothing was stored")

		status.Store(0)
		r = b.post(t, key, orderBody)
		require.Equal(t, http.StatusCreated, r.status, "the key is free for the corrected retry")
		require.False(t, r.replayed())
		require.Equal(t, i+1, b.orders(t))
	}
}

// testMarkFinalStoresFailure (point 5): a failure marked final is stored,
// committed with the handler's writes, and replayed.
func testMarkFinalStoresFailure[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
		if _, err := b.insert(r, tx, 1); err != nil { // the declined payment is recorded
			http.Error(w, err.Error(), http.StatusTeapot)
			return
		}
		if !idemhttp.MarkFinal(r.Context()) {
			http.Error(w, "not in the middleware", http.StatusTeapot)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusPaymentRequired)
		fmt.Fprint(w, `{"code":"card_declined"}`)
	}})
	key := newKey()
	r := b.post(t, key, orderBody)
	require.Equal(t, http.StatusPaymentRequired, r.status)
	require.False(t, r.replayed())
	require.Equal(t, 1, b.orders(t), "a final failure commits the handler's writes")
	again := b.post(t, key, orderBody)
	require.Equal(t, http.StatusPaymentRequired, again.status)
	require.True(t, again.replayed())
	require.Equal(t, r.body, again.body)
	require.Equal(t, "application/json", again.header.Get("Content-Type"))
	require.Equal(t, int64(1), b.calls.Load())
	require.Equal(t, 1, b.orders(t))
}

// panicValue is what the panicking handler panics with.
type panicValue struct{ n int }

// testPanicRollsBackAndPropagates (point 5): a panic rolls the transaction
// back, nothing is stored or sent, and the panic reaches an outer recovery
// middleware unchanged. The key stays free.
func testPanicRollsBackAndPropagates[TTx any](t *testing.T, h harness[TTx]) {
	var (
		recovered atomic.Value
		panics    atomic.Bool
	)
	panics.Store(true)
	sentinel := &panicValue{n: 7}
	b := setup(t, h, options[TTx]{
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			if panics.Swap(false) {
				if _, err := b.insert(r, tx, 1); err != nil {
					http.Error(w, err.Error(), http.StatusTeapot)
					return
				}
				w.Header().Set("X-Partial", "yes")
				w.WriteHeader(http.StatusCreated)
				panic(sentinel)
			}
			createOrder(b, w, r, tx, ok)
		},
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
	require.Equal(t, http.StatusInternalServerError, r.status, "nothing of the handler's response was sent")
	require.Empty(t, r.header.Get("X-Partial"))
	require.Same(t, sentinel, recovered.Load(), "the panic value reaches the outer middleware unchanged")
	require.Zero(t, b.orders(t))
	require.Zero(t, b.records(t))
	require.Len(t, b.logs.records(t, "idemhttp: request"), 1)
	require.Equal(t, "panic", b.logs.records(t, "idemhttp: request")[0]["outcome"])

	r = b.post(t, key, orderBody)
	require.Equal(t, http.StatusCreated, r.status, "the key is free again")
	require.Equal(t, 1, b.orders(t))
}

// testRetryTransactionRunsAgain (point 5): a retried transaction runs the
// handler again with a fresh body and a fresh response.
func testRetryTransactionRunsAgain[TTx any](t *testing.T, h harness[TTx]) {
	var (
		mu     sync.Mutex
		bodies []string
		always atomic.Bool
	)
	b := setup(t, h, options[TTx]{
		idemCfg: &idem.Config{MaxTxRetries: 2},
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			raw := make([]byte, 64)
			n, _ := r.Body.Read(raw)
			mu.Lock()
			bodies = append(bodies, string(raw[:n]))
			attempt := len(bodies)
			mu.Unlock()
			if _, err := b.insert(r, tx, int64(attempt)); err != nil {
				http.Error(w, err.Error(), http.StatusTeapot)
				return
			}
			w.Header().Set("X-Attempt", strconv.Itoa(attempt))
			if attempt == 1 || always.Load() {
				w.Header().Set("X-Stale", "yes")
				fmt.Fprint(w, "stale")
				assert.True(t, idemhttp.RetryTransaction(r.Context()))
				return
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "attempt %d", attempt)
		},
	})
	r := b.post(t, newKey(), orderBody)
	require.Equal(t, http.StatusCreated, r.status)
	require.Equal(t, "attempt 2", string(r.body), "only the last attempt's response is sent")
	require.Equal(t, "2", r.header.Get("X-Attempt"))
	require.Empty(t, r.header.Get("X-Stale"))
	require.Equal(t, []string{orderBody, orderBody}, bodies, "each attempt reads the whole body")
	require.Equal(t, 1, b.orders(t), "the first attempt's write was rolled back")

	always.Store(true)
	mu.Lock()
	bodies = nil
	mu.Unlock()
	r = b.post(t, newKey(), orderBody)
	require.Equal(t, http.StatusServiceUnavailable, r.status, "retries are bounded by MaxTxRetries")
	require.Equal(t, idemhttp.CodeStoreUnavailable, r.code(t))
	require.Len(t, bodies, 3)
	require.Equal(t, 1, b.orders(t))
}

// testClientDisconnectStillCommits (point 5): a client that times out does
// not cancel the claimed transaction; it commits, and the retry replays it.
func testClientDisconnectStillCommits[TTx any](t *testing.T, h harness[TTx]) {
	var (
		done      = make(chan struct{})
		cancelled atomic.Bool
	)
	b := setup(t, h, options[TTx]{handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
		defer close(done)
		select {
		case <-time.After(600 * time.Millisecond): // slower than the client's patience
		case <-r.Context().Done():
			cancelled.Store(true)
		}
		createOrder(b, w, r, tx, ok)
	}})
	key := newKey()
	impatient := &http.Client{Timeout: 150 * time.Millisecond, Transport: b.srv.Client().Transport}
	_, err := impatient.Do(b.newRequest(t, key, orderBody))
	require.Error(t, err, "the client gave up")
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not finish")
	}
	require.False(t, cancelled.Load(), "the handler's context outlives the client")
	require.Eventually(t, func() bool {
		// No require in here: the condition runs in a goroutine that may outlive the test.
		n, err := b.ns.countRecords(context.WithoutCancel(t.Context()))
		return err == nil && n == 1
	}, 5*time.Second, 10*time.Millisecond)
	r := b.post(t, key, orderBody)
	require.Equal(t, http.StatusCreated, r.status)
	require.True(t, r.replayed(), "the retry gets the committed result")
	require.Equal(t, 1, b.orders(t))
	require.Equal(t, int64(1), b.calls.Load())
}

// testServerTimeoutBoundsTransaction (point 5): Config.Timeout bounds the
// detached transaction; a handler that outlives it stores nothing.
func testServerTimeoutBoundsTransaction[TTx any](t *testing.T, h harness[TTx]) {
	var slow atomic.Bool
	slow.Store(true)
	b := setup(t, h, options[TTx]{
		cfg: &idemhttp.Config{Timeout: 500 * time.Millisecond},
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			if slow.Swap(false) {
				select {
				case <-r.Context().Done():
				case <-time.After(10 * time.Second):
				}
				w.WriteHeader(http.StatusCreated) // too late
				return
			}
			createOrder(b, w, r, tx, ok)
		},
	})
	key := newKey()
	start := time.Now()
	r := b.post(t, key, orderBody)
	require.Less(t, time.Since(start), 5*time.Second, "the timeout ended the transaction")
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, idemhttp.CodeStoreUnavailable, r.code(t))
	require.Zero(t, b.records(t))
	r = b.post(t, key, orderBody)
	require.Equal(t, http.StatusCreated, r.status)
	require.False(t, r.replayed())
}

// testReplayHeadersAndStatus (point 6): a stored 201 is replayed as 201 with
// Location and the allowlisted headers, never Set-Cookie, and the body byte
// for byte, without calling the handler.
func testReplayHeadersAndStatus[TTx any](t *testing.T, h harness[TTx]) {
	var scope atomic.Value
	b := setup(t, h, options[TTx]{
		cfg: &idemhttp.Config{ReplayHeaders: []string{"x-extra", "Set-Cookie", "Connection", "Keep-Alive", "Authorization"}},
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			s, _ := idemhttp.Scope(r.Context())
			scope.Store(s)
			id, err := b.insert(r, tx, 1)
			if err != nil {
				http.Error(w, err.Error(), http.StatusTeapot)
				return
			}
			hd := w.Header()
			hd.Set("Location", fmt.Sprintf("/orders/%d", id))
			hd.Set("ETag", `"v1"`)
			hd.Set("Cache-Control", "no-store")
			hd.Set("X-Extra", "kept")
			hd.Set("X-Custom", "not kept")
			hd.Set("Set-Cookie", "session=secret")
			hd.Set("Keep-Alive", "timeout=5")
			hd.Set("Authorization", "Bearer secret")
			hd.Set("Content-Type", "application/vnd.order+json")
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "{\"id\": %d,\n \"raw\":\"bytes \\u00e9\"}  ", id) //nolint:gosec // test handler writing fixed JSON with an integer: nothing to escape
		},
	})
	key := newKey()
	first := b.post(t, key, orderBody)
	require.Equal(t, http.StatusCreated, first.status)
	require.Equal(t, "session=secret", first.header.Get("Set-Cookie"), "the original response is sent whole")
	require.Equal(t, "not kept", first.header.Get("X-Custom"))

	again := b.post(t, key, orderBody)
	require.Equal(t, http.StatusCreated, again.status, "201 is replayed as 201")
	require.True(t, again.replayed())
	require.Equal(t, first.header.Get("Location"), again.header.Get("Location"))
	require.Equal(t, `"v1"`, again.header.Get("ETag"))
	require.Equal(t, "no-store", again.header.Get("Cache-Control"))
	require.Equal(t, "application/vnd.order+json", again.header.Get("Content-Type"))
	require.Equal(t, "kept", again.header.Get("X-Extra"))
	require.Empty(t, again.header.Get("X-Custom"))
	require.Empty(t, again.header.Values("Set-Cookie"), "never replayed, even when listed")
	require.Empty(t, again.header.Values("Authorization"), "never replayed, even when listed")
	require.Equal(t, first.body, again.body, "byte for byte")
	require.Equal(t, int64(1), b.calls.Load())

	rec, err := b.store.Get(t.Context(), scope.Load().(string), key)
	require.NoError(t, err)
	stored := make([]string, 0, len(rec.Response.Header))
	for k := range rec.Response.Header {
		stored = append(stored, k)
	}
	require.ElementsMatch(t, []string{"Content-Type", "Location", "Etag", "Cache-Control", "X-Extra"}, stored)
}

// testMismatchConflict (point 7): the same key with another body is 409
// idempotency_key_reused (422 with the IETF preset), and the stored record
// is unchanged.
func testMismatchConflict[TTx any](t *testing.T, h harness[TTx]) {
	var scope atomic.Value
	b := setup(t, h, options[TTx]{handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
		s, _ := idemhttp.Scope(r.Context())
		scope.Store(s)
		createOrder(b, w, r, tx, ok)
	}})
	key := newKey()
	first := b.post(t, key, `{"amount":100}`)
	require.Equal(t, http.StatusCreated, first.status)
	before, err := b.store.Get(t.Context(), scope.Load().(string), key)
	require.NoError(t, err)

	r := b.post(t, key, `{"amount":200}`)
	require.Equal(t, http.StatusConflict, r.status)
	require.Equal(t, idemhttp.CodeKeyReused, r.code(t))
	require.Empty(t, r.header.Get("Retry-After"), "a new key is needed, not a wait")
	after, err := b.store.Get(t.Context(), scope.Load().(string), key)
	require.NoError(t, err)
	require.Equal(t, before.Fingerprint, after.Fingerprint)
	require.Equal(t, before.Response, after.Response)
	require.Equal(t, before.UpdatedAt, after.UpdatedAt)
	require.True(t, b.post(t, key, `{"amount":100}`).replayed(), "the original still replays")

	ietf := b.with(idemhttp.Config{MismatchStatus: idemhttp.MismatchStatusIETF}, nil)
	r = b.direct(t, ietf, key, `{"amount":300}`)
	require.Equal(t, http.StatusUnprocessableEntity, r.status)
	require.Equal(t, idemhttp.CodeKeyReused, r.code(t))
	require.Equal(t, int64(1), b.calls.Load())
	require.Equal(t, 1, b.orders(t))
}

// testInProgressLease (point 8): a committed processing record with a live
// lease (held by a pool-level claim, as a leased holder would) answers 409
// idempotency_request_in_progress with the lease's time left in
// Retry-After.
func testInProgressLease[TTx any](t *testing.T, h harness[TTx]) {
	var scope atomic.Value
	b := setup(t, h, options[TTx]{
		cfg:     &idemhttp.Config{InProgressRetryAfter: time.Minute}, // above the lease: the time left shows
		idemCfg: &idem.Config{LeaseDuration: 30 * time.Second},
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			s, _ := idemhttp.Scope(r.Context())
			scope.Store(s)
			createOrder(b, w, r, tx, ok)
		},
	})
	// The fingerprint of this body, as the middleware computes it, is the
	// one stored for a first key.
	k1 := newKey()
	require.Equal(t, http.StatusCreated, b.post(t, k1, orderBody).status)
	rec, err := b.store.Get(t.Context(), scope.Load().(string), k1)
	require.NoError(t, err)

	k2 := newKey()
	claim, err := b.store.Claim(t.Context(), scope.Load().(string), k2, rec.Fingerprint)
	require.NoError(t, err)
	require.True(t, claim.Acquired())

	r := b.post(t, k2, orderBody)
	require.Equal(t, http.StatusConflict, r.status)
	require.Equal(t, idemhttp.CodeInProgress, r.code(t))
	secs, err := strconv.Atoi(r.header.Get("Retry-After"))
	require.NoError(t, err)
	require.True(t, secs >= 20 && secs <= 30, "Retry-After %d is the lease's time left", secs)
	r = b.direct(t, b.with(idemhttp.Config{}, nil), k2, orderBody)
	require.Equal(t, http.StatusConflict, r.status)
	require.Equal(t, "1", r.header.Get("Retry-After"), "capped at the default InProgressRetryAfter")

	r = b.post(t, k2, `{"amount":1}`)
	require.Equal(t, http.StatusConflict, r.status)
	require.Equal(t, idemhttp.CodeKeyReused, r.code(t), "the two 409s are told apart by code")
	require.Equal(t, int64(1), b.calls.Load())

	require.NoError(t, b.store.Complete(t.Context(), claim, &idem.Response{StatusCode: http.StatusAccepted, Body: []byte("done")}))
	r = b.post(t, k2, orderBody)
	require.Equal(t, http.StatusAccepted, r.status)
	require.True(t, r.replayed())
	require.Equal(t, "done", string(r.body))
}

// testInProgressUncommitted (point 8): a duplicate of a request whose
// transaction is still open waits up to WaitTimeout, then gets 409 with
// Retry-After, and once the original commits, the replay. On SQLite the
// duplicate queues for the database lock instead and gets the replay.
func testInProgressUncommitted[TTx any](t *testing.T, h harness[TTx]) {
	var (
		entered = make(chan struct{}, 1)
		release = make(chan struct{})
	)
	b := setup(t, h, options[TTx]{
		idemCfg: &idem.Config{WaitTimeout: max(h.features().minWait, 200*time.Millisecond)},
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			entered <- struct{}{}
			<-release
			createOrder(b, w, r, tx, ok)
		},
	})
	key := newKey()
	original := b.postAsync(t, key, orderBody)
	<-entered

	if b.feat.waitsAtBegin {
		dup := b.postAsync(t, key, orderBody)
		time.Sleep(300 * time.Millisecond) // the duplicate is waiting for the lock
		close(release)
		first, second := original(), dup()
		require.Equal(t, http.StatusCreated, first.status)
		require.Equal(t, http.StatusCreated, second.status)
		require.True(t, second.replayed(), "the queued duplicate is replayed")
		require.Equal(t, first.body, second.body)
	} else {
		r := b.post(t, key, orderBody)
		close(release)
		require.Equal(t, http.StatusConflict, r.status)
		require.Equal(t, idemhttp.CodeInProgress, r.code(t))
		secs, err := strconv.Atoi(r.header.Get("Retry-After"))
		require.NoError(t, err)
		require.GreaterOrEqual(t, secs, 1)
		first := original()
		require.Equal(t, http.StatusCreated, first.status)
		again := b.post(t, key, orderBody)
		require.True(t, again.replayed(), "once the original committed, the retry replays it")
		require.Equal(t, first.body, again.body)
	}
	require.Equal(t, int64(1), b.calls.Load())
	require.Equal(t, 1, b.orders(t))
}

// testStoreUnavailable (point 9): an unreachable store gives 503 with
// Retry-After; the handler never runs unprotected.
func testStoreUnavailable[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{unreachable: true, cfg: &idemhttp.Config{UnavailableRetryAfter: 3 * time.Second}})
	r := b.post(t, newKey(), orderBody)
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, idemhttp.CodeStoreUnavailable, r.code(t))
	require.Equal(t, "3", r.header.Get("Retry-After"))
	require.Zero(t, b.calls.Load())
}

// testStoreFailing (point 9): a store that answers with errors (here its
// table is gone) also gives 503, with the handler not run.
func testStoreFailing[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	require.NoError(t, b.ns.dropKeys(t.Context()))
	r := b.post(t, newKey(), orderBody)
	require.Equal(t, http.StatusServiceUnavailable, r.status)
	require.Equal(t, idemhttp.CodeStoreUnavailable, r.code(t))
	require.Equal(t, "2", r.header.Get("Retry-After"), "the default UnavailableRetryAfter")
	require.Zero(t, b.calls.Load())
	require.Zero(t, b.orders(t))
}

// testErrorContract (point 10): errors are JSON with code, message and
// request_id; the request ID comes from X-Request-Id or is generated and is
// sent as a header; a hook can render problem+json.
func testErrorContract[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	r := b.post(t, "", orderBody, header("X-Request-Id", "req-42.a:b"))
	require.Equal(t, http.StatusBadRequest, r.status)
	code, message, id := r.errorBody(t)
	require.Equal(t, idemhttp.CodeKeyMissing, code)
	require.NotEmpty(t, message)
	require.Equal(t, "req-42.a:b", id)
	require.Equal(t, "req-42.a:b", r.header.Get("X-Request-Id"))

	for _, bad := range []string{"", strings.Repeat("x", 129), "has space", "quote\"d"} {
		r = b.post(t, "", orderBody, header("X-Request-Id", bad))
		_, _, id = r.errorBody(t)
		require.NotEmpty(t, id, "generated for %q", bad)
		require.NotEqual(t, bad, id)
		require.Equal(t, id, r.header.Get("X-Request-Id"))
	}
	r2 := b.post(t, "", orderBody)
	_, _, id2 := r2.errorBody(t)
	require.NotEqual(t, id, id2, "each request gets its own ID")

	r = b.post(t, newKey(), orderBody, header("X-Request-Id", "ok-1"))
	require.Equal(t, http.StatusCreated, r.status)
	require.Equal(t, "ok-1", r.header.Get("X-Request-Id"), "the handler's responses carry it too")

	problem := b.with(idemhttp.Config{RenderError: func(w http.ResponseWriter, r *http.Request, e *idemhttp.Error) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(e.Status)
		_ = json.NewEncoder(w).Encode(map[string]any{"type": "urn:idem:" + e.Code, "status": e.Status, "instance": e.RequestID})
	}}, nil)
	r = b.direct(t, problem, "", orderBody, header("X-Request-Id", "p-1"))
	require.Equal(t, http.StatusBadRequest, r.status)
	require.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
	require.Equal(t, "p-1", r.header.Get("X-Request-Id"))
	require.JSONEq(t, `{"type":"urn:idem:idempotency_key_missing","status":400,"instance":"p-1"}`, string(r.body))
}

// testContextAccessors (point 11): the handler reads the parsed key, scope
// and request ID from its context; the transaction is gone once it returned.
func testContextAccessors[TTx any](t *testing.T, h harness[TTx]) {
	type seen struct {
		key, scope, requestID string
		ctx                   context.Context
		lease                 bool
	}
	var got atomic.Value
	b := setup(t, h, options[TTx]{handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
		key, _ := idemhttp.Key(r.Context())
		scope, _ := idemhttp.Scope(r.Context())
		_, lease := idemhttp.Lease[TTx](r.Context())
		got.Store(seen{key: key, scope: scope, requestID: idemhttp.RequestID(r.Context()), ctx: r.Context(), lease: lease})
		createOrder(b, w, r, tx, ok)
	}})
	key := newKey()
	r := b.post(t, `"`+key+`"`, orderBody, tenant("acme"), header("X-Request-Id", "rid-1"))
	require.Equal(t, http.StatusCreated, r.status)
	s := got.Load().(seen)
	require.Equal(t, key, s.key, "the key as parsed, unquoted")
	require.Equal(t, "acme POST /orders", s.scope)
	require.Equal(t, "rid-1", s.requestID)
	require.False(t, s.lease, "no lease in the transactional mode")
	_, ok := idemhttp.Tx[TTx](s.ctx)
	require.False(t, ok, "the transaction is not reachable after the handler returned")
	require.False(t, idemhttp.MarkFinal(s.ctx))
	require.False(t, idemhttp.RetryTransaction(s.ctx))
	_, ok = idemhttp.Tx[int](s.ctx)
	require.False(t, ok, "a wrong transaction type is not a transaction")
}

// testLogsCarryNoSecrets (point 12): the logs of every outcome carry
// digests, never the raw key, tenant or any body.
func testLogsCarryNoSecrets[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	secretKey := "SECRETKEY" + newKey()
	secretTenant := "SECRETTENANT" + newKey()
	secretBody := "SECRETBODY" + newKey()
	body := `{"amount":9,"card":"` + secretBody + `"}`
	require.Equal(t, http.StatusCreated, b.post(t, secretKey, body, tenant(secretTenant)).status)
	require.True(t, b.post(t, secretKey, body, tenant(secretTenant)).replayed())
	require.Equal(t, http.StatusConflict, b.post(t, secretKey, `{"amount":10,"card":"`+secretBody+`"}`, tenant(secretTenant)).status)
	invalidKey := "SECRETINVALID$" + newKey()
	require.Equal(t, http.StatusBadRequest, b.post(t, invalidKey, body, tenant(secretTenant)).status)
	require.Equal(t, http.StatusBadRequest, b.post(t, secretKey, `{"card":"`+secretBody+`"`, tenant(secretTenant)).status)

	logs := b.logs.String()
	require.NotEmpty(t, logs)
	for _, secret := range []string{secretKey, secretTenant, secretBody, invalidKey, "SECRET"} {
		require.NotContains(t, logs, secret)
	}
	recs := b.logs.records(t, "idemhttp: request")
	require.Len(t, recs, 5)
	outcomes := make([]string, 0, len(recs))
	for _, rec := range recs {
		outcomes = append(outcomes, rec["outcome"].(string))
		require.Contains(t, rec, "latency")
		require.Contains(t, rec, "request_id")
		if rec["outcome"] != "key_invalid" {
			require.Regexp(t, `^[0-9a-f]{16}$`, rec["key"])
			require.Regexp(t, `^[0-9a-f]{16}$`, rec["scope"])
		}
	}
	require.Equal(t, []string{"completed", "replayed", "key_reused", "key_invalid", "body_rejected"}, outcomes)
	require.Regexp(t, `^[0-9a-f]{12}$`, recs[0]["fingerprint"])
	require.Equal(t, recs[0]["key"], recs[1]["key"], "the same key has the same digest")
}

// testResponseSizeLimit (point 14): a response that would be stored but is
// larger than MaxResponseBytes is refused with 500 and rolled back, never
// stored truncated; failures pass through whatever their size.
func testResponseSizeLimit[TTx any](t *testing.T, h harness[TTx]) {
	const limit = 1000
	type spec struct {
		Size   int  `json:"size"`
		Status int  `json:"status"`
		Final  bool `json:"final"`
	}
	b := setup(t, h, options[TTx]{
		cfg: &idemhttp.Config{MaxResponseBytes: limit},
		handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
			var s spec
			if err := json.NewDecoder(r.Body).Decode(&s); err != nil {
				http.Error(w, err.Error(), http.StatusTeapot)
				return
			}
			if _, err := b.insert(r, tx, int64(s.Size)); err != nil {
				http.Error(w, err.Error(), http.StatusTeapot)
				return
			}
			if s.Final {
				idemhttp.MarkFinal(r.Context())
			}
			w.WriteHeader(s.Status)
			chunk := []byte(strings.Repeat("z", 100))
			for left := s.Size; left > 0; left -= len(chunk) {
				if _, err := w.Write(chunk[:min(left, len(chunk))]); err != nil {
					assert.ErrorIs(t, err, idemhttp.ErrResponseTooLarge)
					return
				}
			}
		},
	})
	body := func(s spec) string { out, _ := json.Marshal(s); return string(out) }

	key := newKey()
	r := b.post(t, key, body(spec{Size: limit + 1, Status: http.StatusOK}))
	require.Equal(t, http.StatusInternalServerError, r.status)
	require.Equal(t, idemhttp.CodeResponseTooLarge, r.code(t))
	require.Zero(t, b.orders(t), "the transaction was rolled back")
	require.Zero(t, b.records(t), "nothing is stored, truncated or not")
	r = b.post(t, key, body(spec{Size: limit + 1, Status: http.StatusOK}))
	require.Equal(t, idemhttp.CodeResponseTooLarge, r.code(t), "the key is free: the handler runs again")
	require.Equal(t, int64(2), b.calls.Load())

	key = newKey()
	r = b.post(t, key, body(spec{Size: limit, Status: http.StatusOK}))
	require.Equal(t, http.StatusOK, r.status)
	require.Len(t, r.body, limit)
	again := b.post(t, key, body(spec{Size: limit, Status: http.StatusOK}))
	require.True(t, again.replayed())
	require.Equal(t, r.body, again.body, "a response of exactly the limit is stored whole")

	r = b.post(t, newKey(), body(spec{Size: 5 * limit, Status: http.StatusConflict}))
	require.Equal(t, http.StatusConflict, r.status)
	require.Len(t, r.body, 5*limit, "a failure that is not stored passes through whole")

	r = b.post(t, newKey(), body(spec{Size: limit + 1, Status: http.StatusPaymentRequired, Final: true}))
	require.Equal(t, http.StatusInternalServerError, r.status, "a final failure must be stored too")
	require.Equal(t, idemhttp.CodeResponseTooLarge, r.code(t))
	require.Equal(t, 1, b.orders(t))
	require.Equal(t, 1, b.records(t))
}

// testConcurrentDuplicates: 50 identical requests at once against a slow
// handler run it once; every answer is the original, a replay or an
// in-progress 409.
func testConcurrentDuplicates[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{handler: func(b *bundle[TTx], w http.ResponseWriter, r *http.Request, tx TTx, ok bool) {
		time.Sleep(200 * time.Millisecond)
		createOrder(b, w, r, tx, ok)
	}})
	key := newKey()
	const n = 50
	replies := make([]*reply, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			replies[i], errs[i] = b.tryPost(t, key, orderBody)
		})
	}
	close(start)
	wg.Wait()
	require.NoError(t, errors.Join(errs...))

	var originals, replays, inProgress int
	var body []byte
	for _, r := range replies {
		switch {
		case r.status == http.StatusCreated && !r.replayed():
			originals++
			body = r.body
		case r.status == http.StatusCreated:
			replays++
		case r.status == http.StatusConflict && r.code(t) == idemhttp.CodeInProgress:
			inProgress++
		default:
			t.Fatalf("unexpected answer %d %s", r.status, r.body)
		}
	}
	require.Equal(t, 1, originals)
	require.Equal(t, n, originals+replays+inProgress)
	for _, r := range replies {
		if r.status == http.StatusCreated {
			require.Equal(t, body, r.body, "every replay is the original")
		}
	}
	require.Equal(t, int64(1), b.calls.Load())
	require.Equal(t, 1, b.orders(t))
	require.Equal(t, 1, b.records(t))
	t.Logf("%d original, %d replays, %d in progress", originals, replays, inProgress)
}

// TestNewRefusesInvalidConfig: configuration mistakes surface at start-up,
// as errors.
func TestNewRefusesInvalidConfig(t *testing.T) {
	t.Parallel()
	_, err := idemhttp.New[*sqlTx](nil, nil)
	require.ErrorContains(t, err, "needs a store")
	store := newSQLiteStore(t)
	for _, cfg := range []idemhttp.Config{
		{MismatchStatus: http.StatusOK},
		{MaxBodyBytes: -1},
		{MaxResponseBytes: -1},
		{Timeout: -time.Second},
		{InProgressRetryAfter: -time.Second},
		{Mode: idemhttp.Leased + 1},
		{Header: "Idempotency Key"},
		{ReplayedHeader: "Replayed:"},
	} {
		mw, err := idemhttp.New(store, &cfg)
		require.ErrorContains(t, err, "idemhttp: invalid config: ", "%+v", cfg)
		require.Nil(t, mw)
	}
	mw, err := idemhttp.New(store, nil)
	require.NoError(t, err)
	require.NotNil(t, mw)
}

// TestAccessorsOutsideMiddleware: nothing is found in a plain context.
func TestAccessorsOutsideMiddleware(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, ok := idemhttp.Tx[*sqlTx](ctx)
	require.False(t, ok)
	_, ok = idemhttp.Key(ctx)
	require.False(t, ok)
	_, ok = idemhttp.Lease[*sqlTx](ctx)
	require.False(t, ok)
	_, ok = idemhttp.Scope(ctx)
	require.False(t, ok)
	require.Empty(t, idemhttp.RequestID(ctx))
	require.False(t, idemhttp.MarkFinal(ctx))
	require.False(t, idemhttp.RetryTransaction(ctx))
}

// TestWriteError: the JSON error contract, with its headers.
func TestWriteError(t *testing.T) {
	t.Parallel()
	rec := httptest.NewRecorder()
	idemhttp.WriteError(rec, &idemhttp.Error{Status: http.StatusConflict, Code: idemhttp.CodeInProgress,
		Message: "wait", RequestID: "r1", RetryAfter: 1500 * time.Millisecond})
	require.Equal(t, http.StatusConflict, rec.Code)
	require.Equal(t, "application/json", rec.Header().Get("Content-Type"))
	require.Equal(t, "2", rec.Header().Get("Retry-After"), "rounded up to whole seconds")
	require.Equal(t, "r1", rec.Header().Get("X-Request-Id"))
	require.JSONEq(t, `{"code":"idempotency_request_in_progress","message":"wait","request_id":"r1"}`, rec.Body.String())
	var e *idemhttp.Error
	require.True(t, errors.As(error(&idemhttp.Error{Code: "x"}), &e))
	assert.NotEmpty(t, e.Error())
}
