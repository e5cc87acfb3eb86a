// Package idemgrpc is a gRPC unary server interceptor that makes the methods
// it protects safe to retry with an idempotency key, on top of an
// [idem.Store]: a retried call gets the original response message (or the
// original final failure), a key reused for another request gets a clear
// FailedPrecondition, a duplicate of a call still in flight never runs
// twice, and the stored response commits in the same transaction as the
// handler's business writes. It mirrors the idemhttp middleware in its
// transactional mode.
//
//	store, err := idem.New(idempg.New(pool), nil) // *idem.Store[pgx.Tx]
//	ic, err := idemgrpc.UnaryServerInterceptor(store, &idemgrpc.Config{
//		Protect: idemgrpc.Methods("/shop.v1.Orders/CreateOrder"),
//		Tenant:  func(ctx context.Context, _ string) (string, error) { return principal(ctx).OrgID, nil },
//	})
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(auth, ic))
//
//	func (s *orders) CreateOrder(ctx context.Context, req *shopv1.CreateOrderRequest) (*shopv1.Order, error) {
//		tx, _ := idemgrpc.Tx[pgx.Tx](ctx) // the key is claimed in tx
//		// ... INSERT the order on tx, return it ...
//	}
//
// It lives in its own module so that idem's root module does not depend on
// gRPC; docs/integrations.md shows it next to the other integrations.
//
// # Calls
//
// Every unary method the interceptor sees is protected unless Config.Protect
// says otherwise (use [Methods] to list the methods that write). A protected
// call needs exactly one idempotency-key metadata value matching
// Config.KeyFormat (by default ^[A-Za-z0-9_-]{12,64}$, as idemhttp). The key
// is claimed in a scope: the tenant (Config.Tenant) and the full method; the
// same key in another tenant or method is another record.
//
// The fingerprint is a SHA-256 over the full method, the tenant, the request
// message's type name and its deterministic protocol buffer encoding
// (proto.MarshalOptions{Deterministic: true}: map entries sorted, fields in
// number order, unknown fields kept as received). That encoding is stable
// within one binary, but protobuf promises nothing across versions of the
// schema or of the protobuf library: a server built with a schema that
// learnt a new field, or with another protobuf release, may encode the same
// request differently. During a rolling deploy a retry that reaches a server
// of the other version can therefore get FailedPrecondition (key reused)
// instead of the replay: it fails closed, never running the handler twice,
// but the client sees an error for a call that succeeded. Where that
// matters, set Config.Fingerprint to hash the fields that identify the
// request (an order's customer, items and amount), which does not change
// with the encoding. A field whose value differs is a different request.
//
// # Outcomes
//
// [idem.Store.Do] begins a transaction, claims the key in it, and calls the
// handler with the transaction ([Tx]) and the key ([Key]) in its context.
// The context carries the call's metadata and values but not its deadline
// or cancellation: once claimed, the call runs to completion within
// Config.Timeout and commits, so that a client that gave up finds the answer
// on its retry. Then:
//
//   - a response message: it is stored (deterministically encoded, with its
//     type name), the transaction commits, and only then is it sent.
//   - an error: the transaction rolls back with the handler's writes and
//     the error passes through unchanged; the key is free for a corrected
//     retry. This holds for every code, since a code does not tell whether
//     the failure's effects must stand. A handler whose failure had effects that must
//     stand calls [MarkFinal]: its status (code, message, details) is then
//     stored, committed and replayed like a success.
//   - an error matching idem.ErrRetryable (wrap the driver's deadlock or
//     serialization failure with it): the transaction rolls back and the
//     handler runs again in a new one, up to the store's
//     Config.MaxTxRetries; past it, Unavailable.
//   - a panic: the transaction rolls back and the panic propagates.
//
// A replay answers the stored message, or the stored status, with the
// header metadata idempotency-replayed: true; the handler does not run.
// Metadata the handler set itself is not stored or replayed.
//
// # Statuses
//
// The interceptor's own answers carry a google.rpc.ErrorInfo detail with
// Domain [ErrorDomain] and one of the Reason constants ([Reason] reads it):
//
//	InvalidArgument     key missing, invalid, or sent as two values;
//	                    Tenant/Fingerprint hook errors without a status
//	ResourceExhausted   request message larger than Config.MaxRequestBytes
//	FailedPrecondition  key reused with a different request (not retryable)
//	Aborted             another call with this key is in progress: retry
//	Unavailable         store unreachable or commit failed: retry
//	Internal            response too large to store or not a message
//	                    (rolled back), stored response not replayable
//
// Nothing is stored and the handler does not run for any of them, except
// Internal for a response, where it ran and was rolled back.
//
// Aborted and Unavailable say when to retry, with the same key, twice: in a
// google.rpc.RetryInfo detail ([RetryDelay] reads it) and in the
// grpc-retry-pushback-ms trailer of gRPC's retry design (gRFC A6), which a
// client with a service-config retry policy listing ABORTED and UNAVAILABLE
// in retryableStatusCodes honours by itself. Both answers are trailers-only,
// as such retries require. For Aborted the delay is the time the store
// expects the holder to need (Config.WaitTimeout of the store for an open
// transaction), at least 50ms and at most Config.MaxRetryDelay; for
// Unavailable it is Config.UnavailableRetryDelay. Aborted is used, not
// Unavailable, so that clients and dashboards tell "your duplicate is being
// processed" from "the store is down"; FailedPrecondition, not
// AlreadyExists, because AlreadyExists reads as "the thing you create
// exists", which a client could take for success.
//
// # Stored results
//
// A gRPC result is stored as an [idem.Response] by the convention for
// results that are not HTTP responses: StatusCode 200 for a message, and
// for a stored failure the HTTP status grpc-gateway maps its code to
// (NotFound 404, FailedPrecondition 400, ...); header Grpc-Status with the
// gRPC code in decimal; header Grpc-Message-Type with the stored message's
// full type name (google.rpc.Status for a failure); Body the encoded
// message. A replay looks the type up in the protobuf global registry, so
// the response type must stay linked into the server for as long as records
// are retained; if it is not, or the record does not decode, the call fails
// with Internal (ReasonReplayFailed), the handler is not run again, and the
// record stays as it is.
//
// # Limits
//
// Keys are bounded by Config.KeyFormat and idem.MaxKeyLength; the whole
// metadata a client sends is bounded by the server's grpc.MaxHeaderListSize
// (set it: grpc-go's default is 16 MiB). Request messages are bounded by
// grpc.MaxRecvMsgSize and Config.MaxRequestBytes, stored responses by
// Config.MaxResponseBytes.
//
// Streaming methods are not protected. Handlers with effects outside the
// database (a payment provider) need the claim committed before the effect,
// which this interceptor does not do: use [idem.Store.Acquire] in the
// handler, as idemhttp's leased mode does.
package idemgrpc
