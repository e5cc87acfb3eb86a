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
// QueryExecModeCacheStatement and QueryExecModeSimpleProtocol, and through
// PgBouncer 1.18 in transaction pooling mode under QueryExecModeSimpleProtocol
// and QueryExecModeExec (make pgbouncer). It needs PostgreSQL 12 or later
// (WITH ... AS MATERIALIZED).
//
// # Schema
//
// Create the table with [Migrate] or by applying the files of
// [github.com/idemstore/idem/migrations] with your own tool. Name its schema
// with [WithSchema], given to New and Migrate alike:
//
//	store, err := idem.New(idempg.New(pool, idempg.WithSchema("idem")), nil)
//
// Every statement then names "idem"."idempotency_keys", and Migrate puts the
// table and its goose version table (idem.idem_goose_db_version) there.
// Without it, the table is looked up through the connection's search_path
// statement by statement, as in earlier versions: instances whose
// search_path differs (one behind a pooler that drops the setting, one
// connected directly) then use two tables, and nothing protects a key from
// being claimed once in each.
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
// extended one.
//
// Behind PgBouncer in transaction pooling mode a client keeps a server
// connection only until its transaction ends, and session state does not
// follow it. Then:
//
//   - Use QueryExecModeExec or QueryExecModeSimpleProtocol
//     (default_query_exec_mode=exec in the connection string), for the pool
//     given to Migrate too. pgx's default, QueryExecModeCacheStatement,
//     prepares named statements on one server connection and runs them on
//     whichever the pooler hands out next, where the server answers 26000
//     (prepared statement "stmtcache_..." does not exist) or 42P05 (already
//     exists). idem reports both as [idem.ErrMisconfigured], with the fix in
//     the message; [idem.Store.Do] does not retry it, and nothing is
//     committed.
//   - Not QueryExecModeDescribeExec either: it describes the unnamed
//     statement in one round trip and runs it in the next, and outside a
//     transaction the pooler may switch server connections in between.
//     Through PgBouncer 1.18 under the test suite's load the execution then
//     met another client's unnamed statement ("bind message supplies 9
//     parameters, but prepared statement "" requires 0", 08P01, reported as
//     [idem.ErrStoreUnavailable]); one with the same parameters would have
//     run in its place. QueryExecModeCacheDescribe was not tested.
//   - Name the schema with [WithSchema]. PgBouncer refuses a connection that
//     sets search_path (or options, or default_transaction_isolation) as a
//     startup parameter; idem reports that refusal ("unsupported startup
//     parameter", 08P01) as [idem.ErrMisconfigured], not as an outage. With
//     ignore_startup_parameters = search_path PgBouncer drops the setting
//     silently instead, and without WithSchema the table would be public's.
//   - Do not use pgconn.CancelRequestContextWatcherHandler: PgBouncer 1.18
//     exits on its cancel request (FATAL "bad client state: 0" in
//     disconnect_client, seen here), dropping every client. pgx's default
//     context watcher, which closes the connection, works through it.
//   - PgBouncer 1.21 and later can keep protocol-level prepared statements
//     across server connections (max_prepared_statements > 0), which would
//     let the statement cache work through transaction pooling; that is
//     untested. Debian 12 ships 1.18 (apt-cache policy pgbouncer:
//     1.18.0-1+deb12u1, nothing newer in bookworm, bookworm-updates or
//     bookworm-security); 1.21+ comes from apt.postgresql.org or later
//     Debian releases. With 1.18, the advice above is the only one.
//
// Transaction pooling is safe for the claim: its lock_timeout is set with
// set_config(..., is_local => true), which is local to the transaction, on
// the pool the claim runs in a transaction of its own, and the key's lock is
// a transaction-level advisory lock. [Migrate] works through it too: its
// lock is a transaction-level advisory lock held by a connection of its own
// (the pooler must have a second server connection for the migrations), and
// with WithSchema each migration sets its search_path with SET LOCAL, in
// its own transaction.
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
