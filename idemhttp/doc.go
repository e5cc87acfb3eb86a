// Package idemhttp is net/http middleware that speaks the Idempotency-Key
// protocol on top of an [idem.Store]: a retried request gets the original
// response, a key reused for another request gets a clear conflict, a
// duplicate of a request still in flight never runs twice, and the stored
// response commits in the same transaction as the handler's business writes.
// docs/http.md describes the protocol for API clients.
//
//	store, err := idem.New(idempg.New(pool), nil) // *idem.Store[pgx.Tx]
//	mw, err := idemhttp.New(store, &idemhttp.Config{ // *idemhttp.Middleware[pgx.Tx]
//		Tenant: func(r *http.Request) (string, error) { return principal(r).OrgID, nil },
//	})
//	mux.Handle("POST /orders", mw.Wrap(http.HandlerFunc(s.createOrder)))
//
//	func (s *server) createOrder(w http.ResponseWriter, r *http.Request) {
//		tx, _ := s.mw.Tx(r.Context()) // a pgx.Tx, in which the key is claimed
//		// ... INSERT the order on tx, then write 201 ...
//	}
//
// [Middleware.Tx] is typed by the store, so a wrong transaction type does
// not compile; the package-level [Tx] and [Lease] are the same accessors
// for code that has only the context, checked at run time.
//
// It depends on the standard library and idem only.
//
// # Requests
//
// Requests with a method in Config.Methods (POST and PATCH by default) are
// protected; others pass through untouched. A protected request needs one
// Idempotency-Key header line matching Config.KeyFormat, sent raw (abc...) or
// as a structured-field string ("abc..."), which name the same key; otherwise
// it gets 400 with CodeKeyMissing or CodeKeyInvalid and nothing is stored.
//
// The key is claimed in a scope: the tenant (Config.Tenant) and the operation
// (Config.Operation; by default the method and r.Pattern, or the path when
// no pattern matched or the pattern matches more than one route: see
// [RouteOperation]). The same key in another tenant or operation is another
// record. contrib/idemchi, contrib/idemgin and contrib/idemecho name
// operations after those routers' routes.
//
// The request's fingerprint is a SHA-256 over the method, the route, the
// escaped path, the query (parameters sorted by name), the tenant, the
// body's media type and the body. The body is read whole, bounded by Config.MaxBodyBytes (413 with
// CodeBodyTooLarge), decoded first if its Content-Encoding is gzip (bounded
// again after decoding), and canonicalised if its media type is JSON
// (application/json or +json): object members sorted, insignificant
// whitespace removed, strings re-escaped one way, numbers kept exactly as
// written (1 and 1.0 differ; no float rounding ever merges two numbers).
// Other media types are hashed as bytes. Config.Fingerprint may select what
// of the body counts, or add headers. The handler gets the body as sent, or
// decoded from gzip (without the Content-Encoding header then).
//
// # Outcomes
//
// In the transactional mode (the default; see "Leased mode" below for the
// other), [idem.Store.Do] begins a transaction, claims the key in it, calls
// the handler with the transaction ([Tx]) and the key ([Key]) in the
// request context, and captures its response. Then:
//
//   - 2xx and 3xx: the response is stored, the transaction commits, and only
//     then is the response sent. If the commit fails, the client gets 503
//     with CodeStoreUnavailable and nothing was stored.
//   - 4xx and 5xx: the transaction rolls back, with the handler's writes, and
//     the response passes through; the key is free for a corrected retry.
//     A handler whose failure had effects that must stand calls [MarkFinal]:
//     the response is then stored, committed and replayed like a success.
//   - a panic: the transaction rolls back, nothing is stored or sent, and the
//     panic propagates unchanged to the server (which closes the
//     connection) or to a recovery middleware placed outside this one. The
//     key stays free.
//   - a response larger than Config.MaxResponseBytes that would be stored:
//     the transaction rolls back and the client gets 500 with
//     CodeResponseTooLarge, because committing the effect without a stored
//     response would let a retry run it twice. The key stays free.
//   - a response the store refuses (idem.ErrInvalidResponse: a final status
//     outside 200–599, a replayed header value with a control character):
//     the transaction rolls back and the client gets 500 with
//     CodeResponseInvalid. The key stays free.
//   - a retryable transaction failure (deadlock, serialization failure, or
//     [RetryTransaction]): the whole transaction runs again, the handler with
//     a fresh body and a fresh response, up to the store's MaxTxRetries.
//   - a handler that returned without writing a status or a body: nothing
//     says it ran (a router adapter that did not call it, as gin's chain
//     cannot run twice), so nothing is stored: the transaction rolls back
//     and the client gets 500 with CodeNoResponse. Write the status, even
//     an empty 200, explicitly.
//
// The handler's ResponseWriter buffers the response until the transaction
// ends, so it supports neither Flush nor Hijack: nothing reaches the client
// before the commit. The one exception bounds memory: a 4xx or 5xx that is
// not marked final and outgrows Config.MaxResponseBytes is streamed to the
// client from then on (it will not be stored, and its transaction rolls
// back when the handler returns); it can no longer be marked final or
// retried.
//
// Retries are answered from the store, without calling the handler:
//
//   - same key, same fingerprint, completed: the stored status, the
//     allowlisted headers (Content-Type, Content-Encoding, Location, ETag,
//     Cache-Control and Config.ReplayHeaders; never Set-Cookie,
//     Authorization or hop-by-hop headers) and the body byte for byte, with
//     Idempotency-Replayed: true (the name is Config.ReplayedHeader);
//   - same key, another fingerprint: Config.MismatchStatus (409) with
//     CodeKeyReused; the stored record is unchanged;
//   - same key, still in progress: 409 with CodeInProgress and Retry-After;
//   - store unreachable or failing: 503 with CodeStoreUnavailable and
//     Retry-After. The handler never runs unprotected;
//   - a stored record that cannot be replayed (idem.ErrCorruptRecord:
//     damaged, hand-written, from an older version): 500 with
//     CodeRecordInvalid, never a panic; the record is left for an operator.
//
// A request whose method is a case variant of a protected method ("post")
// is refused with 400 and CodeMethodInvalid: it is not the protected method,
// yet a router that folds case would run its handler unprotected.
//
// The tenant (Config.Tenant) must be the authenticated caller's, never a
// value the client chooses: whoever presents a tenant and a key is answered
// with its stored response (docs/security.md).
//
// A duplicate that arrives while the original's transaction is open waits
// for it (up to the store's WaitTimeout) and is then replayed, or gets the
// in-progress 409. On SQLite, which has one writer at a time, it waits at
// the start of its transaction for the database lock instead (up to the busy
// timeout, then 503), and is replayed.
//
// # Disconnects and timeouts
//
// Once the request is accepted, its transaction does not depend on the
// client: the handler's context is detached from the request's cancellation
// ([context.WithoutCancel]) and bounded by Config.Timeout instead. A client
// that times out and retries finds the committed result instead of starting
// over.
//
// # Errors and logs
//
// The middleware's own errors are JSON, {"code", "message", "request_id"},
// with Content-Type application/json; the request ID comes from
// Config.RequestID (by default X-Request-Id) or is generated, and is sent back in that header on every protected
// request. Config.RenderError can render them otherwise. Each protected
// request logs one record to Config.Logger with its outcome, status, request
// ID, key digest, scope digest, fingerprint prefix and latency (and, in the
// leased mode, the lease's attempt); never the key, tenant or body.
//
// # Leased mode
//
// Handlers whose effects leave the database (a payment provider, a message
// broker, another service) cannot roll those effects back, so their claim
// must not depend on their transaction. With Config.Mode set to [Leased]:
//
//  1. [idem.Store.Acquire] commits the claim with a lease of the store's
//     LeaseDuration before the handler runs. Replays, mismatches, the
//     in-progress 409 (Retry-After is the lease's time left, capped at
//     Config.InProgressRetryAfter) and the 503 are answered as in the
//     transactional mode; a record whose lease ran out (a crashed holder)
//     is resolved first by the store's StatusCheck, whose recovered
//     response is replayed, or which hands the key over and runs the
//     handler as attempt 2.
//  2. The handler runs with the lease in its context ([Lease]: its fencing
//     token and attempt, to pass on to the outside system) while
//     [idem.Lease.KeepAlive] renews it. The handler's context is detached
//     from the client and bounded by Config.Timeout, as in the
//     transactional mode, and is cancelled if a renewal fails, with the
//     renewal's error as its [context.Cause] ([idem.ErrFenced] when the lease
//     was lost): stop the work then.
//  3. The first call of [Tx] begins the business transaction, and stops the
//     renewals. Make the outside call first, then take the transaction to
//     record its result, and keep that part short: on SQLite the
//     transaction holds the database's write lock, so a renewal could not
//     run, and a duplicate's claim waits for the lock (up to the store's
//     WaitTimeout, then 503) instead of getting the in-progress 409 it gets
//     during the outside call. [idem.Lease.Extend] makes room for a longer
//     transaction.
//  4. 2xx, 3xx, or a failure marked final ([MarkFinal]): the response is
//     stored with [idem.Lease.CompleteTx] (or FailTx) in that transaction,
//     fenced by the lease's token, the transaction commits, and only then
//     is the response sent. A handler that never took the transaction has
//     its response stored in a statement of its own.
//  5. Any other 4xx or 5xx: the transaction rolls back and the lease is
//     released ([idem.Lease.Release]); the key is free for a corrected
//     retry. So is it after a panic (which propagates, as in the
//     transactional mode) and after a response too large to store (500
//     with CodeResponseTooLarge).
//
// A lease lost to another holder (after it ran out, through the store's
// StatusCheck or BlindTakeover), found by a renewal or by the fenced
// completion, rolls the transaction back, stores nothing, and answers 503
// with CodeLeaseLost: a server-side failure the client did nothing to cause,
// safe to retry with the same key, which then gets the other holder's
// result. When the store fails after the handler answered 2xx (the
// completion or the commit fails), the client gets 503 with
// CodeStoreUnavailable and the record stays processing, because the outside
// effect may have happened: once the lease ran out, the StatusCheck decides.
// Configure the store's StatusCheck for leased routes; without one (and
// without BlindTakeover) such a key stays in progress until its retention
// deadline. [RetryTransaction] is refused in the leased mode: running the
// handler again would repeat its outside call.
package idemhttp
