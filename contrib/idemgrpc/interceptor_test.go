package idemgrpc_test

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemgrpc"
	"github.com/idemstore/idem/internal/storetest"
)

func TestReplay(t *testing.T) { dialects(t, testReplay[*sql.Tx], testReplay[pgx.Tx]) }

func testReplay[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options{})
	key := newKey()
	first := b.call(t, methodCreate, key, map[string]any{"amount": 42}, "x-tenant", "tenant-secret")
	require.NoError(t, first.err)
	require.False(t, first.replayed(), "a first answer is not marked as a replay")

	again := b.call(t, methodCreate, key, map[string]any{"amount": 42}, "x-tenant", "tenant-secret")
	require.NoError(t, again.err)
	require.True(t, again.replayed())
	require.True(t, proto.Equal(first.resp, again.resp), "the replay is the stored message: %v vs %v", first.resp, again.resp)
	require.EqualValues(t, 1, b.calls.Load())
	require.Equal(t, 1, b.orders(t))
	require.Equal(t, 1, b.records(t))

	logs := b.logs.String()
	require.Contains(t, logs, `"outcome":"replayed"`)
	require.NotContains(t, logs, key, "logs carry a digest of the key, never the key")
	require.NotContains(t, logs, "tenant-secret")
}

func TestConcurrentDuplicates(t *testing.T) {
	dialects(t, testConcurrentDuplicates[*sql.Tx], testConcurrentDuplicates[pgx.Tx])
}

func testConcurrentDuplicates[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options{})
	key := newKey()
	const n = 8
	answers := make([]answer, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			answers[i] = b.call(t, methodCreate, key, map[string]any{"amount": 7})
		})
	}
	close(start)
	wg.Wait()
	replays := 0
	for _, a := range answers {
		require.NoError(t, a.err)
		require.True(t, proto.Equal(answers[0].resp, a.resp), "every duplicate gets the one stored answer")
		if a.replayed() {
			replays++
		}
	}
	require.Equal(t, n-1, replays)
	require.EqualValues(t, 1, b.calls.Load(), "the handler ran once")
	require.Equal(t, 1, b.orders(t))
}

func TestMismatch(t *testing.T) { dialects(t, testMismatch[*sql.Tx], testMismatch[pgx.Tx]) }

func testMismatch[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options{})
	key := newKey()
	first := b.call(t, methodCreate, key, map[string]any{"amount": 1})
	require.NoError(t, first.err)

	other := b.call(t, methodCreate, key, map[string]any{"amount": 2})
	requireStatus(t, other.err, codes.FailedPrecondition, idemgrpc.ReasonKeyReused)
	require.NotContains(t, status.Convert(other.err).Message(), key)

	again := b.call(t, methodCreate, key, map[string]any{"amount": 1})
	require.NoError(t, again.err)
	require.True(t, again.replayed())
	require.True(t, proto.Equal(first.resp, again.resp), "the stored record is unchanged")
	require.EqualValues(t, 1, b.calls.Load())
	require.Equal(t, 1, b.orders(t))
}

func TestScopes(t *testing.T) { dialects(t, testScopes[*sql.Tx], testScopes[pgx.Tx]) }

func testScopes[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options{})
	key := newKey()
	req := map[string]any{"amount": 5}
	require.NoError(t, b.call(t, methodCreate, key, req).err)
	refund := b.call(t, methodRefund, key, req)
	require.NoError(t, refund.err)
	require.False(t, refund.replayed(), "the same key on another method is another record")
	other := b.call(t, methodCreate, key, req, "x-tenant", "globex")
	require.NoError(t, other.err)
	require.False(t, other.replayed(), "the same key in another tenant is another record")
	require.EqualValues(t, 3, b.calls.Load())
	require.Equal(t, 3, b.records(t))

	requireStatus(t, b.call(t, methodCreate, newKey(), req, "x-tenant", "?").err, codes.InvalidArgument, idemgrpc.ReasonTenantInvalid)
	denied := b.call(t, methodCreate, newKey(), req, "x-tenant", "!").err
	require.Equal(t, codes.PermissionDenied, status.Code(denied), "a tenant error's own status is answered")
	require.EqualValues(t, 3, b.calls.Load())
	require.Equal(t, 3, b.records(t))
}

func TestBadInput(t *testing.T) { dialects(t, testBadInput[*sql.Tx], testBadInput[pgx.Tx]) }

func testBadInput[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options{cfg: &idemgrpc.Config{MaxRequestBytes: 1024}})
	req := map[string]any{"amount": 1}

	requireStatus(t, b.call(t, methodCreate, "", req).err, codes.InvalidArgument, idemgrpc.ReasonKeyMissing)
	two := b.call(t, methodCreate, "", req, "idempotency-key", newKey(), "idempotency-key", newKey()).err
	requireStatus(t, two, codes.InvalidArgument, idemgrpc.ReasonKeyInvalid)
	for name, key := range map[string]string{
		"short":     "abc",
		"bad chars": "key with spaces!",
		"too long":  strings.Repeat("a", 65),
		"huge":      strings.Repeat("a", 64<<10),
	} {
		err := b.call(t, methodCreate, key, req).err
		requireStatus(t, err, codes.InvalidArgument, idemgrpc.ReasonKeyInvalid)
		msg := status.Convert(err).Message()
		require.Contains(t, msg, "^[A-Za-z0-9_-]{12,64}$", "%s: the message states the accepted format", name)
		require.NotContains(t, msg, key, "%s: the message never echoes the key", name)
	}
	// grpc-go's client refuses to send values outside printable ASCII; a
	// raw HTTP/2 client sends them, as any peer may.
	for name, key := range map[string]string{
		"non-ascii": "ключ-ключ-ключ",
		"not utf-8": "abcdefghijkl\xff\xfe",
		"with tab":  "abcdef\tghijklm",
	} {
		code, msg := b.rawCall(t, methodCreate, [][2]string{{"idempotency-key", key}})
		require.Equal(t, codes.InvalidArgument, code, name)
		require.Contains(t, msg, "must be one value matching", "%s: refused by the interceptor, not the transport", name)
	}
	code, _ := b.rawCall(t, methodCreate, [][2]string{{"idempotency-key", newKey()}, {"idempotency-key", newKey()}})
	require.Equal(t, codes.InvalidArgument, code, "two header lines")

	big := b.call(t, methodCreate, newKey(), map[string]any{"amount": 1, "pad": strings.Repeat("x", 2048)})
	requireStatus(t, big.err, codes.ResourceExhausted, idemgrpc.ReasonRequestTooLarge)

	require.EqualValues(t, 0, b.calls.Load(), "the handler never ran")
	require.Equal(t, 0, b.records(t), "nothing was stored")

	get := b.call(t, methodGet, "", nil)
	require.NoError(t, get.err, "an unprotected method needs no key")
	require.False(t, get.resp.GetFields()["tx"].GetBoolValue())
}

func TestKeyOptional(t *testing.T) {
	b := setup(t, storetest.SQLite{}, options{cfg: &idemgrpc.Config{
		Protect:     func(string) bool { return true },
		KeyOptional: func(_ context.Context, m string) bool { return m == methodGet },
	}})
	get := b.call(t, methodGet, "", nil)
	require.NoError(t, get.err)
	require.False(t, get.resp.GetFields()["tx"].GetBoolValue(), "a call let through without a key has no transaction")
	requireStatus(t, b.call(t, methodCreate, "", nil).err, codes.InvalidArgument, idemgrpc.ReasonKeyMissing)
	get = b.call(t, methodGet, newKey(), nil)
	require.NoError(t, get.err)
	require.True(t, get.resp.GetFields()["tx"].GetBoolValue(), "with a key the call is protected")
}

func TestHandlerErrors(t *testing.T) {
	dialects(t, testHandlerErrors[*sql.Tx], testHandlerErrors[pgx.Tx])
}

func testHandlerErrors[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options{cfg: &idemgrpc.Config{MaxResponseBytes: 4096}})

	t.Run("not final: rolled back, key free", func(t *testing.T) {
		key := newKey()
		failed := b.call(t, methodCreate, key, map[string]any{"amount": 1, "fail": true})
		require.Equal(t, codes.InvalidArgument, status.Code(failed.err))
		require.Equal(t, "amount refused", status.Convert(failed.err).Message(), "the handler's error passes through")
		require.Equal(t, 0, b.orders(t), "its insert was rolled back")
		require.Equal(t, 0, b.records(t))
		// The same key with a corrected request runs the handler.
		ok := b.call(t, methodCreate, key, map[string]any{"amount": 1})
		require.NoError(t, ok.err)
		require.False(t, ok.replayed())
		require.Equal(t, 1, b.orders(t))
	})

	t.Run("final: stored and replayed", func(t *testing.T) {
		key := newKey()
		before := b.calls.Load()
		req := map[string]any{"amount": 2, "final": true}
		first := b.call(t, methodCreate, key, req)
		again := b.call(t, methodCreate, key, req)
		for _, a := range []answer{first, again} {
			st := status.Convert(a.err)
			require.Equal(t, codes.FailedPrecondition, st.Code())
			require.Equal(t, "card declined", st.Message())
			require.Len(t, st.Details(), 1)
			require.Equal(t, "DECLINED", st.Details()[0].(*errdetails.ErrorInfo).GetReason())
		}
		require.False(t, first.replayed())
		require.True(t, again.replayed())
		require.Equal(t, before+1, b.calls.Load(), "a stored failure is not run again")
		require.Equal(t, 2, b.orders(t), "the final failure's writes committed")
	})

	t.Run("too large to store", func(t *testing.T) {
		before := b.orders(t)
		big := b.call(t, methodCreate, newKey(), map[string]any{"amount": 3, "big": 8192})
		requireStatus(t, big.err, codes.Internal, idemgrpc.ReasonResponseTooLarge)
		require.Equal(t, before, b.orders(t), "rolled back")
	})

	t.Run("no message", func(t *testing.T) {
		before := b.orders(t)
		requireStatus(t, b.call(t, methodCreate, newKey(), map[string]any{"nil": true}).err, codes.Internal, idemgrpc.ReasonResponseInvalid)
		require.Equal(t, before, b.orders(t), "rolled back")
	})

	t.Run("retryable: a new transaction", func(t *testing.T) {
		before, runs := b.orders(t), b.calls.Load()
		// "retry" counts handler runs of the bundle: ask for two retries.
		ok := b.call(t, methodCreate, newKey(), map[string]any{"amount": 4, "retry": float64(runs + 2)})
		require.NoError(t, ok.err)
		require.Equal(t, runs+3, b.calls.Load())
		require.Equal(t, before+1, b.orders(t), "only the last transaction's insert committed")
	})
}

func TestInProgress(t *testing.T) { dialects(t, testInProgress[*sql.Tx], testInProgress[pgx.Tx]) }

func testInProgress[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options{idemCfg: &idem.Config{WaitTimeout: max(50*time.Millisecond, h.MinWait())}})
	key := newKey()
	req := map[string]any{"amount": 9, "block": true}
	holder := make(chan answer, 1)
	go func() { holder <- b.call(t, methodCreate, key, req) }()
	<-b.entered

	if h.WaitsAtBegin() {
		// SQLite: one writer at a time, so the duplicate waits for the
		// holder's transaction at BEGIN and then replays its answer.
		waiting := make(chan answer, 1)
		go func() { waiting <- b.call(t, methodCreate, key, req) }()
		select {
		case a := <-waiting:
			t.Fatalf("the duplicate answered while the holder ran: %v", a.err)
		case <-time.After(150 * time.Millisecond):
		}
		b.unblock()
		first, dup := <-holder, <-waiting
		require.NoError(t, first.err)
		require.NoError(t, dup.err)
		require.True(t, dup.replayed())
		require.True(t, proto.Equal(first.resp, dup.resp))
		require.EqualValues(t, 1, b.calls.Load())
		require.Equal(t, 1, b.orders(t))
		return
	}

	dup := b.call(t, methodCreate, key, req)
	requireStatus(t, dup.err, codes.Aborted, idemgrpc.ReasonInProgress)
	delay, ok := idemgrpc.RetryDelay(dup.err)
	require.True(t, ok)
	require.GreaterOrEqual(t, delay, 50*time.Millisecond)
	require.Equal(t, []string{strconv.FormatInt(delay.Milliseconds(), 10)}, dup.trailer.Get(idemgrpc.PushbackTrailer))
	require.Empty(t, dup.header.Get(idemgrpc.ReplayedHeader))

	b.unblock()
	first := <-holder
	require.NoError(t, first.err)
	again := b.call(t, methodCreate, key, req)
	require.NoError(t, again.err)
	require.True(t, again.replayed())
	require.True(t, proto.Equal(first.resp, again.resp))
	require.EqualValues(t, 1, b.calls.Load())
	require.Equal(t, 1, b.orders(t))
}

func TestStoreUnavailable(t *testing.T) {
	dialects(t, testStoreUnavailable[*sql.Tx], testStoreUnavailable[pgx.Tx])
}

func testStoreUnavailable[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options{unreachable: true})
	a := b.call(t, methodCreate, newKey(), map[string]any{"amount": 1})
	requireStatus(t, a.err, codes.Unavailable, idemgrpc.ReasonStoreUnavailable)
	delay, ok := idemgrpc.RetryDelay(a.err)
	require.True(t, ok)
	require.Equal(t, 2*time.Second, delay)
	require.Equal(t, []string{"2000"}, a.trailer.Get(idemgrpc.PushbackTrailer))
	require.EqualValues(t, 0, b.calls.Load(), "never run unprotected")
}

func TestClientDeadline(t *testing.T) {
	dialects(t, testClientDeadline[*sql.Tx], testClientDeadline[pgx.Tx])
}

// A client that gives up does not cancel a claimed call: it commits, and
// the client's retry gets its answer.
func testClientDeadline[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options{})
	key := newKey()
	req := map[string]any{"amount": 3, "block": true}
	go func() {
		<-b.entered
		time.Sleep(300 * time.Millisecond)
		b.unblock()
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	in, err := structFrom(req)
	require.NoError(t, err)
	err = b.conn.Invoke(withKey(ctx, key), methodCreate, in, new(emptyStruct))
	require.Equal(t, codes.DeadlineExceeded, status.Code(err))

	require.Eventually(t, func() bool { return b.orders(t) == 1 }, 10*time.Second, 20*time.Millisecond)
	again := b.call(t, methodCreate, key, req)
	require.NoError(t, again.err)
	require.True(t, again.replayed())
	require.EqualValues(t, 1, b.calls.Load())
}

// retryPolicy retries Unavailable and Aborted, the statuses the interceptor
// asks to retry, honouring its pushback.
const retryPolicy = `{"methodConfig": [{
	"name": [{"service": "idem.test.Orders"}],
	"retryPolicy": {
		"maxAttempts": 5,
		"initialBackoff": "0.05s",
		"maxBackoff": "1s",
		"backoffMultiplier": 2,
		"retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]
	}
}]}`

func TestRetryPolicyLostAnswer(t *testing.T) {
	dialects(t, testRetryPolicyLostAnswer[*sql.Tx], testRetryPolicyLostAnswer[pgx.Tx])
}

// The first answer is lost after the commit (as a proxy or a dropped
// connection would lose it): the client's retry policy sends the call again
// with the same key and gets the original answer; one order.
func testRetryPolicyLostAnswer[TTx any](t *testing.T, h harness[TTx]) {
	var attempts atomic.Int64
	var committed atomic.Pointer[any]
	lose := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		if attempts.Add(1) == 1 && err == nil {
			committed.Store(&resp)
			return nil, status.Error(codes.Unavailable, "connection lost")
		}
		return resp, err
	}
	b := setup(t, h, options{outer: []grpc.UnaryServerInterceptor{lose}, serviceConfig: retryPolicy})
	a := b.call(t, methodCreate, newKey(), map[string]any{"amount": 11})
	require.NoError(t, a.err)
	require.EqualValues(t, 2, attempts.Load(), "the policy retried once")
	require.True(t, a.replayed())
	require.NotNil(t, committed.Load())
	require.True(t, proto.Equal((*committed.Load()).(proto.Message), a.resp), "the client got the lost answer")
	require.EqualValues(t, 1, b.calls.Load())
	require.Equal(t, 1, b.orders(t), "one effect")
}

func TestRetryPolicyInProgress(t *testing.T) {
	dialects(t, testRetryPolicyInProgress[*sql.Tx], testRetryPolicyInProgress[pgx.Tx])
}

// A duplicate sent while the first call runs gets Aborted with a pushback;
// the retry policy waits and retries until the first call committed, then
// gets its answer: one order.
func testRetryPolicyInProgress[TTx any](t *testing.T, h harness[TTx]) {
	var aborted atomic.Int64
	count := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		if status.Code(err) == codes.Aborted {
			aborted.Add(1)
		}
		return resp, err
	}
	b := setup(t, h, options{
		idemCfg:       &idem.Config{WaitTimeout: max(50*time.Millisecond, h.MinWait())},
		outer:         []grpc.UnaryServerInterceptor{count},
		serviceConfig: retryPolicy,
	})
	key := newKey()
	req := map[string]any{"amount": 13, "block": true}
	holder := make(chan answer, 1)
	go func() { holder <- b.call(t, methodCreate, key, req) }()
	<-b.entered
	dup := make(chan answer, 1)
	go func() { dup <- b.call(t, methodCreate, key, req) }()
	if h.WaitsAtBegin() {
		time.Sleep(200 * time.Millisecond) // the duplicate queues at BEGIN
	} else {
		require.Eventually(t, func() bool { return aborted.Load() >= 1 }, 10*time.Second, 5*time.Millisecond)
	}
	b.unblock()
	first, second := <-holder, <-dup
	require.NoError(t, first.err)
	require.NoError(t, second.err, "the retry policy outlasted the first call")
	require.True(t, second.replayed())
	require.True(t, proto.Equal(first.resp, second.resp))
	require.EqualValues(t, 1, b.calls.Load())
	require.Equal(t, 1, b.orders(t), "one effect")
}

func TestConfigErrors(t *testing.T) {
	store, err := idem.New(storetest.SQLite{}.Open(t).Dialect, nil)
	require.NoError(t, err)
	_, err = idemgrpc.UnaryServerInterceptor[*sql.Tx](nil, nil)
	require.Error(t, err)
	for _, cfg := range []idemgrpc.Config{
		{Metadata: "Idempotency-Key"},
		{Metadata: "grpc-key"},
		{Metadata: "key-bin"},
		{MaxRequestBytes: -1},
		{MaxResponseBytes: -1},
		{Timeout: -1},
		{MaxRetryDelay: -1},
		{UnavailableRetryDelay: -1},
	} {
		_, err := idemgrpc.UnaryServerInterceptor(store, &cfg)
		require.Error(t, err, "%+v", cfg)
	}
	_, err = idemgrpc.UnaryServerInterceptor(store, nil)
	require.NoError(t, err)
	require.False(t, errors.Is(err, idem.ErrStoreUnavailable))
}

func TestAccessorsOutsideInterceptor(t *testing.T) {
	ctx := t.Context()
	_, ok := idemgrpc.Tx[*sql.Tx](ctx)
	require.False(t, ok)
	_, ok = idemgrpc.Key(ctx)
	require.False(t, ok)
	_, ok = idemgrpc.Scope(ctx)
	require.False(t, ok)
	require.False(t, idemgrpc.MarkFinal(ctx))
	_, ok = idemgrpc.RetryDelay(errors.New("plain"))
	require.False(t, ok)
	require.Empty(t, idemgrpc.Reason(status.Error(codes.Internal, "not ours")))
}
