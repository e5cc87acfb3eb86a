package conformance

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/digest"
	"github.com/idemstore/idem/internal/logscan"
)

func validateCases[TTx any]() []testCase[TTx] {
	return []testCase[TTx]{
		{name: "InvalidResponseRefusedByComplete", run: testInvalidResponseRefusedByComplete[TTx]},
		{name: "InvalidResponseRefusedByLease", run: testInvalidResponseRefusedByLease[TTx]},
		{name: "InvalidResponseRefusedByDo", run: testInvalidResponseRefusedByDo[TTx]},
		{name: "InvalidVerdictIsUnknown", run: testInvalidVerdictIsUnknown[TTx]},
		{name: "CorruptRecordAnswered", run: testCorruptRecordAnswered[TTx]},
		{name: "StatusCheckErrorTextNotLogged", run: testStatusCheckErrorTextNotLogged[TTx]},
		{name: "RandomResponsesRoundTrip", run: testRandomResponsesRoundTrip[TTx]},
	}
}

// validateLimits are small limits, so that the size checks are cheap to hit.
const (
	validateMaxBody   = 1024 // orderResponse fits
	validateMaxHeader = 512
)

type badResponse struct {
	name  string
	resp  *idem.Response
	field string // the InvalidResponseError's Field
}

// badResponses are responses no store may keep: each would poison its key
// (a replay that panics or sends a broken header) or break the limits.
func badResponses() []badResponse {
	ok := func(mod func(r *idem.Response)) *idem.Response {
		r := &idem.Response{StatusCode: http.StatusCreated, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{}`)}
		mod(r)
		return r
	}
	var out []badResponse
	for _, code := range []int{0, -1, 42, 100, 103, 199, 600, 1000} {
		out = append(out, badResponse{"status " + http.StatusText(code), ok(func(r *idem.Response) { r.StatusCode = code }), "StatusCode"})
	}
	for _, name := range []string{"", "Bad Name", "X:Y", "X\r\nInjected", "Ünicode", "X\x00"} {
		out = append(out, badResponse{"header name", ok(func(r *idem.Response) { r.Header[name] = []string{"v"} }), "Header"})
	}
	for _, value := range []string{"a\r\nSet-Cookie: x=1", "a\nb", "a\rb", "a\x00b", "a\x01b", "a\x7fb", "caf\xe9"} {
		out = append(out, badResponse{"header value", ok(func(r *idem.Response) { r.Header["X-Bad"] = []string{"fine", value} }), "Header"})
	}
	out = append(out,
		badResponse{"body over the limit", ok(func(r *idem.Response) { r.Body = make([]byte, validateMaxBody+1) }), "Body"},
		badResponse{"headers over the limit", ok(func(r *idem.Response) {
			r.Header["X-Long"] = []string{strings.Repeat("v", validateMaxHeader)}
		}), "Header"},
		badResponse{"nil", nil, "Response"},
	)
	return out
}

func validateSetup[TTx any](t *testing.T, h Harness[TTx], check idem.StatusCheck) (context.Context, *bundle[TTx], *clock) {
	t.Helper()
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 30 * time.Second, Retention: 24 * time.Hour, Now: clk.Now,
		StatusCheck: check, MaxResponseBytes: validateMaxBody, MaxResponseHeaderBytes: validateMaxHeader})
	return ctx, b, clk
}

func requireInvalidResponse(t *testing.T, err error, want badResponse) {
	t.Helper()
	require.ErrorIs(t, err, idem.ErrInvalidResponse, want.name)
	var invalid *idem.InvalidResponseError
	require.ErrorAs(t, err, &invalid, want.name)
	require.Equal(t, want.field, invalid.Field, want.name)
	// The message names the field, never the offending bytes.
	for _, leak := range []string{"Injected", "Set-Cookie", "a\nb", "Bad Name", "vvvvvvvv"} {
		require.NotContains(t, err.Error(), leak, want.name)
	}
}

// requireStillProcessing checks that a refused completion left the record
// as it was: processing, with no response.
func requireStillProcessing[TTx any](ctx context.Context, t *testing.T, b *bundle[TTx], scope, key, name string) {
	t.Helper()
	rec, err := b.store.Get(ctx, scope, key)
	require.NoError(t, err, name)
	require.Equal(t, idem.StatusProcessing, rec.Status, name)
	require.Nil(t, rec.Response, name)
}

func testInvalidResponseRefusedByComplete[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b, _ := validateSetup(t, h, nil)
	for _, bad := range badResponses() {
		key := newKey("badcomplete")
		c, err := b.store.Claim(ctx, "t1/create", key, fp("x"))
		require.NoError(t, err)
		requireInvalidResponse(t, b.store.Complete(ctx, c, bad.resp), bad)
		requireInvalidResponse(t, b.store.Fail(ctx, c, bad.resp), bad)
		requireStillProcessing(ctx, t, b, "t1/create", key, bad.name)

		// Inside the caller's transaction the refusal comes before any
		// statement, so the transaction is still usable: a valid
		// completion after it commits.
		tx := b.begin(ctx, t)
		requireInvalidResponse(t, b.store.CompleteTx(ctx, tx, c, bad.resp), bad)
		requireInvalidResponse(t, b.store.FailTx(ctx, tx, c, bad.resp), bad)
		require.NoError(t, b.store.CompleteTx(ctx, tx, c, orderResponse(key)), bad.name)
		require.NoError(t, b.ns.Dialect.Commit(ctx, tx))
		rec, err := b.store.Get(ctx, "t1/create", key)
		require.NoError(t, err)
		requireSameResponse(t, orderResponse(key), rec.Response)
	}

	// The smallest and largest storable responses are accepted and replay.
	for _, good := range []*idem.Response{
		{StatusCode: idem.MinStatusCode},
		{StatusCode: idem.MaxStatusCode, Header: http.Header{"X-Tab": {"a\tb"}, "X-Obs": {"caf\xc3\xa9"}, "!#$%&'*+-.^_`|~0Az": {""}},
			Body: make([]byte, validateMaxBody)},
	} {
		key := newKey("goodcomplete")
		c, err := b.store.Claim(ctx, "t1/create", key, fp("x"))
		require.NoError(t, err)
		require.NoError(t, b.store.Complete(ctx, c, good))
		again, err := b.store.Claim(ctx, "t1/create", key, fp("x"))
		require.NoError(t, err)
		require.False(t, again.Acquired())
		require.Equal(t, good.StatusCode, again.Replay.Response.StatusCode)
		require.Equal(t, len(good.Body), len(again.Replay.Response.Body))
		require.Equal(t, len(good.Header), len(again.Replay.Response.Header))
	}
}

func testInvalidResponseRefusedByLease[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b, _ := validateSetup(t, h, nil)
	for _, bad := range badResponses() {
		key := newKey("badlease")
		l, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		require.NoError(t, err)
		require.True(t, l.Acquired())
		requireInvalidResponse(t, l.Complete(ctx, bad.resp), bad)
		requireInvalidResponse(t, l.Fail(ctx, bad.resp), bad)
		tx := b.begin(ctx, t)
		requireInvalidResponse(t, l.CompleteTx(ctx, tx, bad.resp), bad)
		requireInvalidResponse(t, l.FailTx(ctx, tx, bad.resp), bad)
		require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))
		requireStillProcessing(ctx, t, b, "t1/pay", key, bad.name)
		require.NoError(t, l.Release(ctx), "the lease is still held after a refusal")
	}
}

func testInvalidResponseRefusedByDo[TTx any](t *testing.T, h Harness[TTx]) {
	ctx, b, _ := validateSetup(t, h, nil)
	for _, bad := range badResponses() {
		if bad.resp == nil {
			continue // a nil response from Do's callback is its own error, covered elsewhere
		}
		for _, final := range []bool{false, true} {
			key := newKey("baddo")
			var calls counter
			_, err := b.store.Do(ctx, "t1/create", key, fp("x"), func(ctx context.Context, tx TTx) (*idem.Response, error) {
				calls.inc()
				if err := b.ns.InsertOrder(ctx, tx, key); err != nil {
					return nil, err
				}
				if final {
					return nil, idem.FinalFailure(bad.resp)
				}
				return bad.resp, nil
			})
			requireInvalidResponse(t, err, bad)
			require.Equal(t, 1, calls.get(), "an invalid response is not retried")
			require.Zero(t, b.orders(ctx, t, key), "the business writes roll back with the refusal")
			_, err = b.store.Get(ctx, "t1/create", key)
			require.ErrorIs(t, err, idem.ErrNotFound, "nothing is stored; the key is free")
			res, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
			require.NoError(t, err)
			require.False(t, res.Replayed)
			require.Equal(t, 1, b.orders(ctx, t, key))
		}
	}
}

// testInvalidVerdictIsUnknown: a status check that rebuilds a crashed
// holder's answer but forgets the status (the poisoned-key report) is
// treated as unknown: nothing is stored, the record stays processing and
// the failure is logged with the key's digest; a later, valid verdict
// finalises the record.
func testInvalidVerdictIsUnknown[TTx any](t *testing.T, h Harness[TTx]) {
	var verdict struct {
		resp *idem.Response
	}
	check := func(context.Context, idem.Record) (idem.Verdict, error) { return idem.Committed(verdict.resp), nil }
	rec := logscan.New()
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 30 * time.Second, Retention: 24 * time.Hour, Now: clk.Now,
		StatusCheck: check, MaxResponseBytes: validateMaxBody, MaxResponseHeaderBytes: validateMaxHeader, Logger: rec.Logger()})
	for _, s := range suiteSecrets {
		rec.Pattern(s.what, s.re)
	}
	for _, bad := range badResponses() {
		if bad.resp == nil {
			continue // committed without a response: an unknown verdict of its own
		}
		key := newKey("badverdict")
		l, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		require.NoError(t, err)
		require.True(t, l.Acquired())
		clk.advance(31 * time.Second) // the holder "crashed": its lease runs out

		verdict.resp = bad.resp
		_, err = b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		require.ErrorIs(t, err, idem.ErrInProgress, bad.name)
		requireStillProcessing(ctx, t, b, "t1/pay", key, bad.name)

		// The reaper applies the same rule.
		clk.advance(time.Hour)
		reaper, err := idem.NewReaper(b.store, nil)
		require.NoError(t, err)
		_, err = reaper.RunOnce(ctx)
		require.NoError(t, err)
		requireStillProcessing(ctx, t, b, "t1/pay", key, bad.name)

		clk.advance(time.Hour)
		verdict.resp = orderResponse(key)
		again, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		require.NoError(t, err, bad.name)
		require.False(t, again.Acquired())
		requireSameResponse(t, orderResponse(key), again.Replay.Response)
		requireLogged(t, rec, "idem: status check failed", l.KeyDigest())
	}
	rec.Check(t)
}

// requireLogged checks that some line has msg and the key digest kd.
func requireLogged(t *testing.T, rec *logscan.Recorder, msg, kd string) {
	t.Helper()
	for _, line := range rec.Lines() {
		if strings.Contains(line, msg) && strings.Contains(line, `"key":"`+kd+`"`) {
			return
		}
	}
	require.Failf(t, "not logged", "no line with %q and key %s", msg, kd)
}

type corruption struct {
	name    string
	status  *int
	headers []byte
}

func intp(i int) *int { return &i }

// corruptions are stored rows no response can be built from: a status
// idem never writes, headers that do not decode or hold what no response
// may carry.
func corruptions() []corruption {
	ok := []byte(`{"Content-Type":["application/json"]}`)
	return []corruption{
		{"status NULL", nil, ok},
		{"status 0", intp(0), ok},
		{"status 42", intp(42), ok},
		{"status 101", intp(101), ok},
		{"status 1000", intp(1000), ok},
		{"headers not JSON", intp(201), []byte(`{"Content-Type":`)},
		{"headers not an object of lists", intp(201), []byte(`[1,2,3]`)},
		{"header name with a space", intp(201), []byte(`{"Bad Name":["x"]}`)},
		{"header value with CRLF", intp(201), []byte(`{"X-Bad":["a\r\nSet-Cookie: x=1"]}`)},
		{"header value with NUL", intp(201), []byte(`{"X-Bad":["a\u0000b"]}`)},
	}
}

// testCorruptRecordAnswered: a completed record damaged by hand is answered
// with ErrCorruptRecord on every read path, never replayed, never
// overwritten and never deleted; each read is logged with the digest.
func testCorruptRecordAnswered[TTx any](t *testing.T, h Harness[TTx]) {
	rec := logscan.New()
	for _, s := range suiteSecrets {
		rec.Pattern(s.what, s.re)
	}
	clk := newClock()
	ctx, b := setup(t, h, &idem.Config{LeaseDuration: 30 * time.Second, Retention: 24 * time.Hour, Now: clk.Now, Logger: rec.Logger()})
	for _, c := range corruptions() {
		key := newKey("corrupt")
		var calls counter
		_, err := b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
		require.NoError(t, err)
		require.NoError(t, b.ns.CorruptResponse(ctx, "t1/create", key, c.status, c.headers), c.name)
		kd := digest.Key("t1/create", key)

		requireCorrupt := func(err error, path string) {
			t.Helper()
			require.ErrorIs(t, err, idem.ErrCorruptRecord, c.name+": "+path)
			var corrupt *idem.CorruptRecordError
			require.ErrorAs(t, err, &corrupt, c.name+": "+path)
			require.Equal(t, kd, corrupt.KeyDigest, c.name+": "+path)
			require.NotContains(t, err.Error(), "Set-Cookie", c.name+": "+path)
			require.NotContains(t, err.Error(), key, c.name+": "+path)
		}
		_, err = b.store.Claim(ctx, "t1/create", key, fp("x"))
		requireCorrupt(err, "Claim")
		_, err = b.store.Get(ctx, "t1/create", key)
		requireCorrupt(err, "Get")
		_, err = b.store.Acquire(ctx, "t1/create", key, fp("x"))
		requireCorrupt(err, "Acquire")
		_, err = b.store.Do(ctx, "t1/create", key, fp("x"), orderFn(b.ns, key, &calls))
		requireCorrupt(err, "Do")
		tx := b.begin(ctx, t)
		_, err = b.store.ClaimTx(ctx, tx, "t1/create", key, fp("x"))
		requireCorrupt(err, "ClaimTx")
		require.NoError(t, b.ns.Dialect.Rollback(ctx, tx))

		// Another request under the key is refused too: a mismatch when
		// the row still decodes, else the corruption. Never acquired.
		_, err = b.store.Claim(ctx, "t1/create", key, fp("other"))
		require.True(t, errors.Is(err, idem.ErrFingerprint) || errors.Is(err, idem.ErrCorruptRecord), "%s: %v", c.name, err)

		require.Equal(t, 1, calls.get(), "%s: nothing runs again", c.name)
		require.Equal(t, 1, b.orders(ctx, t, key), c.name)
		requireLogged(t, rec, "idem: stored record is invalid", kd)
	}
	require.Equal(t, len(corruptions()), b.records(ctx, t), "every damaged row is left for an operator")
	rec.Check(t)
}

// testStatusCheckErrorTextNotLogged: an application's status check whose
// error quotes the key (fmt.Errorf("lookup %s", key)) is logged by class
// and digest only; with Config.LogCallbackErrors the text is logged too,
// which also shows that the scan would catch the key.
func testStatusCheckErrorTextNotLogged[TTx any](t *testing.T, h Harness[TTx]) {
	for _, optIn := range []bool{false, true} {
		rec := logscan.New()
		for _, s := range suiteSecrets {
			rec.Pattern(s.what, s.re)
		}
		clk := newClock()
		check := func(_ context.Context, r idem.Record) (idem.Verdict, error) {
			return idem.Unknown(), fmt.Errorf("lookup %s in %s: not reachable", r.Key, r.Scope)
		}
		ctx, b := setup(t, h, &idem.Config{LeaseDuration: 30 * time.Second, Now: clk.Now, StatusCheck: check,
			Logger: rec.Logger(), LogCallbackErrors: optIn})
		key := newKey("checkerr")
		_, err := b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		require.NoError(t, err)
		clk.advance(31 * time.Second)
		_, err = b.store.Acquire(ctx, "t1/pay", key, fp("x"))
		require.ErrorIs(t, err, idem.ErrInProgress)
		require.NotContains(t, err.Error(), key, "errors never carry the raw key")
		requireLogged(t, rec, "idem: status check failed", digest.Key("t1/pay", key))
		if !optIn {
			rec.Check(t)
			continue
		}
		found := rec.Scan()
		require.NotEmpty(t, found, "with LogCallbackErrors the check's text, and the key in it, is logged")
		require.Equal(t, "key", found[0].What)
	}
}
