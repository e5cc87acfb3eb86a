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
// A claim is one round trip (plus one per connection to prepare its
// statements under the default statement cache): a pgx batch that sets
// lock_timeout for the duration of the claim, runs INSERT ... ON CONFLICT DO
// NOTHING, restores the caller's lock_timeout and reads the record. An INSERT that meets an
// uncommitted claim of the same key waits for that transaction; lock_timeout
// bounds the wait to Config.WaitTimeout (rounded up to a whole millisecond).
// When it runs out, PostgreSQL aborts the current transaction: a claim made
// with a Tx method returns an *idem.InProgressError with TxAborted set, and the
// caller must roll the transaction back. To keep the transaction usable,
// claim in a savepoint (Begin on the pgx.Tx) and roll back to it. A claim
// made on the pool leaves nothing behind.
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
// the batch runs as one transaction when sent outside one. Run [Migrate]
// on a direct connection, or through session pooling: it serialises
// concurrent runs with a session-level advisory lock, which transaction
// pooling does not keep on one server connection.
//
// # Clock
//
// Times come from clock_timestamp(), the server's current time, not now(),
// which is the start of the transaction and would lag inside a long caller
// transaction. Stored times have microsecond precision; a pinned
// Config.Now is truncated to microseconds.
package postgres
