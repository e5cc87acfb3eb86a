package idemgrpc_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/contrib/idemgrpc"
	"github.com/idemstore/idem/internal/storetest"
)

// The test service, idem.test.Orders, is described by hand (no protoc):
// its methods take and return google.protobuf.Struct.
const (
	serviceName  = "idem.test.Orders"
	methodCreate = "/" + serviceName + "/Create"
	methodRefund = "/" + serviceName + "/Refund"
	methodGet    = "/" + serviceName + "/Get"
)

// dialects runs a test case on SQLite, PostgreSQL and MariaDB.
func dialects(t *testing.T, sqlCase func(*testing.T, harness[*sql.Tx]), pgCase func(*testing.T, harness[pgx.Tx])) {
	t.Helper()
	storetest.Dialects(t, storetest.InSequence, sqlCase, pgCase)
}

type options struct {
	cfg         *idemgrpc.Config // Tenant defaults to x-tenant metadata, Protect to Create and Refund
	idemCfg     *idem.Config
	unreachable bool
	// outer interceptors run before idem's (outside it).
	outer []grpc.UnaryServerInterceptor
	// serviceConfig is the client's default service config (JSON).
	serviceConfig string
}

// bundle is one test's gRPC server on loopback over a real store, and a
// client connected to it.
type bundle[TTx any] struct {
	ns    *namespace[TTx] // nil when the store is unreachable
	store *idem.Store[TTx]
	conn  *grpc.ClientConn
	addr  string
	// calls counts handler runs of protected methods.
	calls atomic.Int64
	// entered receives one value each time a "block" handler starts; it
	// then waits for release to be closed.
	entered chan struct{}
	release chan struct{}
	once    sync.Once
	logs    *syncBuffer
}

func setup[TTx any](t *testing.T, h harness[TTx], o options) *bundle[TTx] {
	t.Helper()
	b := &bundle[TTx]{entered: make(chan struct{}, 16), release: make(chan struct{}), logs: &syncBuffer{}}
	logger := slog.New(slog.NewJSONHandler(b.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	var d idem.Dialect[TTx]
	if o.unreachable {
		d = h.Unreachable(t)
	} else {
		b.ns = h.Open(t)
		d = b.ns.Dialect
	}
	icfg := idem.Config{}
	if o.idemCfg != nil {
		icfg = *o.idemCfg
	}
	icfg.Logger = logger
	store, err := idem.New(d, &icfg)
	require.NoError(t, err)
	b.store = store

	cfg := idemgrpc.Config{}
	if o.cfg != nil {
		cfg = *o.cfg
	}
	if cfg.Tenant == nil {
		cfg.Tenant = testTenant
	}
	if cfg.Protect == nil {
		cfg.Protect = idemgrpc.Methods(methodCreate, methodRefund)
	}
	cfg.Logger = logger
	ic, err := idemgrpc.UnaryServerInterceptor(store, &cfg)
	require.NoError(t, err)

	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(append(append([]grpc.UnaryServerInterceptor(nil), o.outer...), ic)...))
	srv.RegisterService(b.serviceDesc(), b)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()

	dopts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if o.serviceConfig != "" {
		dopts = append(dopts, grpc.WithDefaultServiceConfig(o.serviceConfig))
	}
	conn, err := grpc.NewClient(lis.Addr().String(), dopts...)
	require.NoError(t, err)
	b.conn = conn
	b.addr = lis.Addr().String()
	t.Cleanup(func() {
		b.unblock()
		_ = conn.Close()
		srv.Stop()
	})
	return b
}

func (b *bundle[TTx]) unblock() { b.once.Do(func() { close(b.release) }) }

// testTenant reads the tenant from x-tenant; "?" is an error without a
// status, "!" one with PermissionDenied.
func testTenant(ctx context.Context, _ string) (string, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	v := md.Get("x-tenant")
	if len(v) == 0 {
		return "acme", nil
	}
	switch v[0] {
	case "?":
		return "", errors.New("no tenant")
	case "!":
		return "", status.Error(codes.PermissionDenied, "not your tenant")
	}
	return v[0], nil
}

func (b *bundle[TTx]) serviceDesc() *grpc.ServiceDesc {
	method := func(name string, protected bool) grpc.MethodDesc {
		full := "/" + serviceName + "/" + name
		return grpc.MethodDesc{
			MethodName: name,
			Handler: func(_ any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
				in := new(structpb.Struct)
				if err := dec(in); err != nil {
					return nil, err
				}
				h := func(ctx context.Context, req any) (any, error) {
					if !protected {
						return b.get(ctx, req.(*structpb.Struct))
					}
					return b.create(ctx, req.(*structpb.Struct))
				}
				if ic == nil {
					return h(ctx, in)
				}
				return ic(ctx, in, &grpc.UnaryServerInfo{Server: b, FullMethod: full}, h)
			},
		}
	}
	return &grpc.ServiceDesc{
		ServiceName: serviceName,
		HandlerType: (*any)(nil),
		Methods:     []grpc.MethodDesc{method("Create", true), method("Refund", true), method("Get", false)},
	}
}

// create is the protected handler: it inserts an order on the
// interceptor's transaction and answers with its ID. Fields of the request
// steer it: "fail" returns InvalidArgument after the insert, "final" a
// FailedPrecondition marked final, "block" waits for release, "big" pads
// the response, "retry" asks for that many new transactions, "nil" returns
// no message.
func (b *bundle[TTx]) create(ctx context.Context, req *structpb.Struct) (*structpb.Struct, error) {
	n := b.calls.Add(1)
	tx, ok := idemgrpc.Tx[TTx](ctx)
	if !ok {
		return nil, status.Error(codes.Internal, "no transaction")
	}
	key, _ := idemgrpc.Key(ctx)
	scope, _ := idemgrpc.Scope(ctx)
	f := req.GetFields()
	if f["block"].GetBoolValue() {
		b.entered <- struct{}{}
		<-b.release
	}
	id, err := b.ns.InsertOrder(ctx, tx, scope, key, int64(f["amount"].GetNumberValue()))
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	switch {
	case f["retry"].GetNumberValue() >= float64(n):
		return nil, fmt.Errorf("conflict on attempt %d: %w", n, idem.ErrRetryable)
	case f["fail"].GetBoolValue():
		return nil, status.Error(codes.InvalidArgument, "amount refused")
	case f["final"].GetBoolValue():
		idemgrpc.MarkFinal(ctx)
		st, _ := status.New(codes.FailedPrecondition, "card declined").
			WithDetails(&errdetails.ErrorInfo{Reason: "DECLINED", Domain: "test"})
		return nil, st.Err()
	case f["nil"].GetBoolValue():
		return nil, nil
	}
	out := map[string]any{"order_id": float64(id), "amount": f["amount"].GetNumberValue(), "run": float64(n)}
	if big := int(f["big"].GetNumberValue()); big > 0 {
		out["pad"] = strings.Repeat("x", big)
	}
	return structpb.NewStruct(out)
}

// get is an unprotected method: it reports whether it saw a transaction.
func (b *bundle[TTx]) get(ctx context.Context, _ *structpb.Struct) (*structpb.Struct, error) {
	_, ok := idemgrpc.Tx[TTx](ctx)
	return structpb.NewStruct(map[string]any{"tx": ok})
}

// answer is what a client saw of one call.
type answer struct {
	resp    *structpb.Struct
	err     error
	header  metadata.MD
	trailer metadata.MD
}

func (a answer) replayed() bool {
	return len(a.header.Get(idemgrpc.ReplayedHeader)) == 1 && a.header.Get(idemgrpc.ReplayedHeader)[0] == "true"
}

// call invokes method with the key (none if ""), the request fields and
// extra metadata pairs.
func (b *bundle[TTx]) call(t *testing.T, method, key string, fields map[string]any, md ...string) answer {
	t.Helper()
	req, err := structpb.NewStruct(fields)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if key != "" {
		md = append(md, "idempotency-key", key)
	}
	if len(md) > 0 {
		ctx = metadata.AppendToOutgoingContext(ctx, md...)
	}
	var a answer
	resp := new(structpb.Struct)
	a.err = b.conn.Invoke(ctx, method, req, resp, grpc.Header(&a.header), grpc.Trailer(&a.trailer))
	if a.err == nil {
		a.resp = resp
	}
	return a
}

func (b *bundle[TTx]) orders(t *testing.T) int {
	t.Helper()
	n, err := b.ns.CountOrders(t.Context())
	require.NoError(t, err)
	return n
}

func (b *bundle[TTx]) records(t *testing.T) int {
	t.Helper()
	n, err := b.ns.CountRecords(t.Context())
	require.NoError(t, err)
	return n
}

func newKey() string {
	var k [12]byte
	_, _ = rand.Read(k[:])
	return "k_" + hex.EncodeToString(k[:])
}

// requireStatus checks an error's code and the interceptor's reason.
func requireStatus(t *testing.T, err error, code codes.Code, reason string) {
	t.Helper()
	require.Error(t, err)
	require.Equal(t, code, status.Code(err), "status: %v", err)
	require.Equal(t, reason, idemgrpc.Reason(err), "status: %v", err)
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type emptyStruct = structpb.Struct

func structFrom(fields map[string]any) (*structpb.Struct, error) { return structpb.NewStruct(fields) }

func withKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "idempotency-key", key)
}

// rawCall sends a gRPC call with an empty Struct and the given header lines
// over a plain HTTP/2 client, which, unlike grpc-go's, sends any bytes an
// HTTP/2 header may carry. It returns the grpc-status and grpc-message.
func (b *bundle[TTx]) rawCall(t *testing.T, method string, headers [][2]string) (codes.Code, string) {
	t.Helper()
	tr := &http2.Transport{
		AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		},
	}
	defer tr.CloseIdleConnections()
	body, err := proto.Marshal(&structpb.Struct{})
	require.NoError(t, err)
	frame := append([]byte{0, 0, 0, 0, byte(len(body))}, body...)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+b.addr+method, bytes.NewReader(frame))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("Te", "trailers")
	for _, h := range headers {
		req.Header[h[0]] = append(req.Header[h[0]], h[1])
	}
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	defer func() { _ = resp.Body.Close() }()
	_, _ = io.Copy(io.Discard, resp.Body)
	get := func(k string) string {
		if v := resp.Trailer.Get(k); v != "" {
			return v
		}
		return resp.Header.Get(k) // a trailers-only answer
	}
	code, err := strconv.Atoi(get("Grpc-Status"))
	require.NoError(t, err)
	return codes.Code(code), get("Grpc-Message")
}
