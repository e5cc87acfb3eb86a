// Package idem makes HTTP and RPC write endpoints safe to retry, using
// nothing but the SQL database the service already has.
//
// A client that times out retries the same request. An idempotency key names
// one business intent; idem stores each key in an idempotency_keys table
// (unique on scope and key) so the server recognises the retry and answers it
// with the original result, a clear conflict, or a clear "still in progress",
// and never runs the business effect twice.
//
// # Claiming a key
//
// A [Store] claims a key for a request [Fingerprint] (a SHA-256 of the
// request that used the key first). [Store.Claim] and [Store.ClaimTx] run one
// atomic INSERT ... ON CONFLICT (or the dialect's equivalent) and decide:
//
//   - no record, or one past its retention deadline: the caller acquires the
//     key ([Claim.Acquired]) and must run the business effect;
//   - a completed record with the same fingerprint: the stored [Response] is
//     returned in [Claim.Replay], byte for byte;
//   - a record with another fingerprint: [ErrFingerprint], the record untouched;
//   - a record held by an uncommitted transaction: the claimer waits up to
//     Config.WaitTimeout for it to commit (then replay or mismatch) or roll
//     back (then acquire); otherwise [ErrInProgress];
//   - a committed processing record with a live lease: [ErrInProgress] as an
//     *[InProgressError] whose RetryAfter is the time left.
//
// On the pool, [Store.Claim] first reads the record by primary key, with no
// transaction, lock or write: a completed record is immutable until its
// retention deadline, so a replay or a mismatch is answered by that one
// read, and only an absent, processing or expired record goes on to the
// INSERT.
//
// Most callers use [Store.Do], which wraps all of this around a callback.
//
// # Caller transactions
//
// Every operation that can join a transaction comes in two forms: Op runs on
// the pool and OpTx inside the caller's transaction, typed natively (pgx.Tx
// for PostgreSQL, *sql.Tx for MySQL and SQLite). idem never commits or rolls
// back a caller's transaction. Claim, write the business rows and complete in
// one transaction, and the stored response commits with the order, or neither
// does:
//
//	tx, err := pool.Begin(ctx)
//	defer tx.Rollback(ctx)
//	claim, err := store.ClaimTx(ctx, tx, "tenant-42/create-order", key, fp)
//	if !claim.Acquired() {
//		return claim.Replay.Response // the original answer
//	}
//	// ... business writes on tx ...
//	err = store.CompleteTx(ctx, tx, claim, &idem.Response{StatusCode: 201, Body: body})
//	err = tx.Commit(ctx)
//
// Commit only after CompleteTx succeeded, and roll back after any error: on
// PostgreSQL and SQLite the claim is a lock on the key until the completion
// writes the finished record, so a commit without it leaves the key free
// (see [Store.ClaimTx]).
//
// # Leases and fencing
//
// Work with outside side effects (a payment provider call) cannot roll back
// with a transaction, so its claim must commit first. [Store.Acquire] commits
// a processing record with a lease and returns a [Lease]; the work runs,
// [Lease.KeepAlive] renews the lease meanwhile, and [Lease.CompleteTx] stores
// the response inside the business transaction. Every record carries a
// fencing token, replaced whenever the key gets a new holder: completion,
// renewal and release act only while the record still carries the caller's
// token, so a holder that lost the key gets [ErrFenced] and changes nothing.
//
// A holder that dies leaves its processing record behind. Once its lease
// runs out, the next claim of the key (or the reaper) asks the application
// through Config.StatusCheck whether the effect committed, and finalises the
// record with the recovered response, hands the key over to the retry, or
// leaves it in progress when the answer is unknown. See [StatusCheck].
//
// # The reaper
//
// A [Reaper] deletes records past their retention deadline in small batches
// and resolves stale leases: run [Reaper.Run] in a goroutine of the service,
// or [Reaper.RunOnce] from a cron job. Several instances may run reapers
// against one database.
//
// # Time
//
// Lease and retention decisions use the database's clock, the one clock all
// instances share (on SQLite, which runs in-process, the process clock).
// Config.Now pins it for tests.
//
// # Errors
//
// Callers branch with [errors.Is] on [ErrNotFound], [ErrInProgress],
// [ErrFingerprint], [ErrFenced], [ErrInvalidKey], [ErrInvalidScope],
// [ErrStoreUnavailable] and [ErrRetryable]. The store fails closed: when the
// database cannot be reached, every operation returns [ErrStoreUnavailable]
// and nothing runs unprotected. No error message or log line carries a raw
// key, scope or body, only a short digest.
//
// # Dialects
//
// A [Dialect] adapts the store to a database and client library:
// [github.com/idemstore/idem/postgres] (pgx/v5),
// [github.com/idemstore/idem/mysql] (MySQL 8.0+, MariaDB 10.6+) and
// [github.com/idemstore/idem/sqlite] (modernc.org/sqlite, no cgo). Each passes
// the same suite, [github.com/idemstore/idem/conformance], on a real server.
//
// # Migrations
//
// idem never creates tables at run time. The schema ships as goose SQL files
// in [github.com/idemstore/idem/migrations]; call the dialect's Migrate at
// start-up, or copy the files into your own migration tool.
package idem
