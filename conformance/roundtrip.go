package conformance

import (
	"context"
	"errors"
	"math/rand/v2"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// RoundTripResponse checks the store boundary for one response: it claims a
// fresh key in scope and completes it with resp. If the store refuses resp
// (it must exactly when resp.Validate fails or resp breaks the store's
// limits), the error must match idem.ErrInvalidResponse and the record must
// stay processing; otherwise a replay must give back resp exactly (status,
// headers, body byte for byte) on both the pool's fast path and a claim in a
// transaction. It is the body of the SQLite fuzz target and of the random
// case every dialect runs.
func RoundTripResponse[TTx any](ctx context.Context, t testing.TB, store *idem.Store[TTx], scope string, resp *idem.Response) {
	t.Helper()
	key := newKey("roundtrip")
	c, err := store.Claim(ctx, scope, key, fp("roundtrip"))
	require.NoError(t, err)
	err = store.Complete(ctx, c, resp)
	if resp.Validate() != nil {
		require.ErrorIs(t, err, idem.ErrInvalidResponse)
	}
	if err != nil {
		require.ErrorIs(t, err, idem.ErrInvalidResponse)
		var invalid *idem.InvalidResponseError
		require.True(t, errors.As(err, &invalid))
		rec, gerr := store.Get(ctx, scope, key)
		require.NoError(t, gerr)
		require.Equal(t, idem.StatusProcessing, rec.Status)
		require.NoError(t, store.Release(ctx, c))
		return
	}
	again, err := store.Claim(ctx, scope, key, fp("roundtrip"))
	require.NoError(t, err, "a stored response must replay")
	require.False(t, again.Acquired())
	got := again.Replay.Response
	require.Equal(t, resp.StatusCode, got.StatusCode)
	require.Equal(t, len(resp.Body), len(got.Body))
	if len(resp.Body) > 0 {
		require.Equal(t, resp.Body, got.Body)
	}
	require.Equal(t, len(resp.Header), len(got.Header))
	for name, values := range resp.Header {
		require.Contains(t, got.Header, name)
		require.Equal(t, len(values), len(got.Header[name]), name)
		for i := range values {
			require.Equal(t, values[i], got.Header[name][i], name)
		}
	}
}

// RandomResponse returns a response drawn from r, about half of them
// invalid in one way: a status outside 200–599, a header name that is not a
// token, a value with a control character or invalid UTF-8, a body around
// maxBody.
func RandomResponse(r *rand.Rand, maxBody int) *idem.Response {
	resp := &idem.Response{StatusCode: 200 + r.IntN(400), Header: http.Header{}}
	if r.IntN(4) == 0 {
		resp.StatusCode = []int{0, -1, 1, 100, 199, 600, 999, 1000, 1 << 20}[r.IntN(9)]
	}
	const tchars = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
	const nasty = " \t\r\n\x00\x01\x7f\x80\xff:;\"(),/<=>?@[\\]{}é🔑\u2028"
	pick := func(alphabet string, n int, bad bool) string {
		b := make([]byte, 0, n)
		for range n {
			if bad && r.IntN(8) == 0 {
				b = append(b, nasty[r.IntN(len(nasty))])
				continue
			}
			b = append(b, alphabet[r.IntN(len(alphabet))])
		}
		return string(b)
	}
	for range r.IntN(5) {
		name := pick(tchars, 1+r.IntN(20), r.IntN(6) == 0)
		values := make([]string, r.IntN(3))
		for i := range values {
			values[i] = pick(tchars+" \t\"(),/:;<=>?@[\\]{}", r.IntN(40), r.IntN(5) == 0)
			if r.IntN(10) == 0 {
				values[i] += "café 🔑" // valid UTF-8 is stored as it is
			}
		}
		resp.Header[name] = values
	}
	switch r.IntN(10) {
	case 0:
		resp.Body = nil
	case 1:
		resp.Body = make([]byte, maxBody+1+r.IntN(8))
	default:
		resp.Body = make([]byte, r.IntN(min(maxBody, 4096)+1))
		for i := range resp.Body {
			resp.Body[i] = byte(r.IntN(256))
		}
	}
	return resp
}

// testRandomResponsesRoundTrip puts a bounded number of random responses,
// valid and not, through Complete and replay.
func testRandomResponsesRoundTrip[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b, _ := validateSetup(t, h, nil)
	r := rand.New(rand.NewPCG(12, uint64(len(t.Name())))) //nolint:gosec // test data
	for range 150 {
		RoundTripResponse(ctx, t, b.store, "t1/create", RandomResponse(r, validateMaxBody))
	}
}
