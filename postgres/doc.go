// Package postgres is idem's PostgreSQL dialect, on github.com/jackc/pgx/v5.
// [New] wraps a *pgxpool.Pool; the store's transaction type is pgx.Tx:
//
//	import idempg "github.com/idemstore/idem/postgres"
//
//	store, err := idem.New(idempg.New(pool), nil) // *idem.Store[pgx.Tx]
//
// The package name collides with the postgres packages applications often
// import alongside it (their own database package, gorm.io/driver/postgres,
// migration drivers); import it under an alias such as idempg, as above.
//
// Tested with PostgreSQL 15 and pgx v5.12, under both
// QueryExecModeCacheStatement and QueryExecModeSimpleProtocol. It needs
// PostgreSQL 12 or later (WITH ... AS MATERIALIZED).
//
// # Schema
//
// Create the table with [Migrate] or by applying the files of
// [github.com/idemstore/idem/migrations] with your own tool. The table is
// looked up through the pool's search_path, so to keep idem's table in its own
// schema, set search_path in the pool's connection settings
// (ConnConfig.RuntimeParams["search_path"] or the search_path URL parameter).
//
// # Claiming
//
// A claim is a pgx batch of two statements: INSERT ... ON CONFLICT DO
// NOTHING, whose first CTE saves the caller's lock_timeout and sets idem's,
// and a read of the record that restores the caller's lock_timeout (after an
// insert, the record is built from the insert's RETURNING instead of that
// read's row): one round trip
// with a Tx method, two on
// the pool (plus one per connection to prepare its statements under the
// default statement cache). On the pool, the batch begins a transaction and
// the COMMIT follows once its results are in: a claim whose context ends
// while it waits is then never committed, whereas a batch committed by the
// server on its own would be, once the claim it waited for rolled back.
//
// [idem.Store.Do], which owns its transaction, sends BEGIN in the claim's
// batch and the completion in one batch with COMMIT ([Dialect.BeginClaim],
// [Dialect.CompleteCommit]): three round trips with the callback's one
// statement, against five. Its callback's pgx.Tx is then one of this
// package, bound to a connection of the pool until the transaction ends.
// Do's claim is deferred: it writes nothing, holding instead a
// transaction-level advisory lock on a 64-bit hash of the table, scope and
// key (pg_try_advisory_xact_lock with BEGIN; pg_advisory_xact_lock under
// lock_timeout when another transaction holds it), and its completion
// inserts the finished record. The claim statement above takes the same
// lock before it inserts, whenever no committed record is visible, so
// every creator of a key waits for every other; replays take no lock. The
// application's own advisory locks share PostgreSQL's key space: a
// collision (about 2^-64) only makes one transaction wait for the other.
//
// An INSERT that meets an uncommitted claim of the same key waits for that
// transaction (on its advisory lock); lock_timeout bounds the wait to Config.WaitTimeout (rounded
// up to a whole millisecond). When it runs out, PostgreSQL aborts the
// current transaction: a claim made with a Tx method returns an
// *idem.InProgressError with TxAborted set, and the caller must roll the
// transaction back. To keep the transaction usable, claim in a savepoint
// (Begin on the pgx.Tx) and roll back to it. A claim made on the pool leaves
// nothing behind. The driver's lock timeout error (SQLSTATE 55P03) is the
// InProgressError's Cause.
//
// Taking over a record (past its retention, or past its lease with
// Config.BlindTakeover or after a status check) and renewing a lease are
// bounded the same way, in the same kind of batch: an UPDATE that meets a
// transaction holding the record (a claim taking it over, a completion or
// renewal not yet committed) waits for it up to Config.WaitTimeout, then
// returns an *idem.InProgressError, with TxAborted set inside a caller's
// transaction. Each of these UPDATEs, and the reaper's release of a stale
// lease, states in its WHERE clause the condition that allowed it (retention
// or lease run out) next to the fencing token. Under READ COMMITTED,
// PostgreSQL re-evaluates that clause on the newest committed version of a
// row it waited for, so a holder that completed or renewed its lease while
// the takeover waited keeps its record.
//
// # Isolation levels
//
// READ COMMITTED, PostgreSQL's default, is recommended: after waiting for
// another transaction's claim of the same key, the claim sees that
// transaction's outcome and replays or claims as usual. Under REPEATABLE READ
// and SERIALIZABLE, the claim of a key that another transaction inserted
// after this transaction's snapshot fails with a serialization failure,
// returned as [idem.ErrRetryable]: roll back and run the transaction again
// ([idem.Store.Do] does so by itself). Deadlocks (40P01) and lock timeouts
// outside the claim's own wait (55P03) are also returned as
// [idem.ErrRetryable].
//
// # Exec modes and PgBouncer
//
// Every statement works under all of pgx's query exec modes; parameters carry
// explicit casts so the simple protocol gives them the same types as the
// extended one. Behind PgBouncer in transaction pooling mode, use
// QueryExecModeSimpleProtocol (or QueryExecModeExec, or PgBouncer 1.21+ with
// max_prepared_statements for the default statement cache). Transaction
// pooling is safe for the claim: its lock_timeout is set with
// set_config(..., is_local => true), which is local to the transaction, and
// on the pool the claim runs in a transaction of its own. Run [Migrate]
// on a direct connection, or through session pooling: it serialises
// concurrent runs with a session-level advisory lock, which transaction
// pooling does not keep on one server connection.
//
// # Leases and the reaper
//
// Renewing a lease is one fenced UPDATE that returns the stored expiry. It
// also moves the record's retention deadline out to the new lease expiry
// when that comes later, so a lease kept alive past the retention period
// keeps its record.
// Listing stale leases is a plain read over the partial index of processing
// records and takes no locks; when two reapers list the same record, the
// fencing token decides which of their writes applies.
//
// Deleting expired records takes one statement per batch: it selects at most
// the batch size of records in expires_at order with FOR UPDATE SKIP LOCKED,
// in a materialized CTE, and deletes them by primary key. A record that an
// open transaction holds locked (a claim taking it over, another reaper's
// batch) is skipped, never waited for, and no record is locked that is not
// deleted. On a small table the planner may find the batch by reading the
// whole table instead of by primary key; it still locks only the batch.
//
// # Errors and cancellation
//
// A canceled context is reported as [context.Canceled], never as
// [idem.ErrStoreUnavailable], also with a pgconn context watcher that cancels
// through the server (pgconn.CancelRequestContextWatcherHandler), where pgx
// reports a cancellation as the server's query_canceled error (57014).
// query_canceled while the context is still live comes from the caller's
// statement_timeout (or an administrator's pg_cancel_backend): the server did
// not answer in time, and it matches [idem.ErrStoreUnavailable]. Inside a
// transaction it aborts the transaction, like every server error.
//
// Tx(nil) returns an Executor whose every call fails; Commit and Rollback
// of a nil transaction fail too.
//
// # Clock
//
// Times come from clock_timestamp(), the server's current time, not now(),
// which is the start of the transaction and would lag inside a long caller
// transaction. Stored times have microsecond precision; a pinned
// Config.Now is truncated to microseconds.
package postgres
