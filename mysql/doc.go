// Package mysql is idem's dialect for MySQL 8.0+ and MariaDB 10.6+ (InnoDB),
// on database/sql and github.com/go-sql-driver/mysql. [New] wraps a *sql.DB;
// the store's transaction type is *sql.Tx:
//
//	import (
//		"github.com/go-sql-driver/mysql"
//		idemmysql "github.com/idemstore/idem/mysql"
//	)
//
//	store, err := idem.New(idemmysql.New(db), nil) // *idem.Store[*sql.Tx]
//
// The package name collides with the driver's, which applications import for
// mysql.Config; import this one under an alias such as idemmysql, as above.
//
// Tested here with MariaDB 10.11 and go-sql-driver/mysql v1.10, with
// interpolateParams on and off. No MySQL 8 server was available: the
// statements keep to SQL that both servers accept, and the one part written
// for MySQL alone (how the claim bounds its lock wait, below) was run against
// MariaDB, which accepts its statements too, but not against MySQL itself.
//
// # Connection settings
//
// The DSN must set parseTime=true, so that DATETIME columns scan into
// time.Time, and keep the driver's default loc=UTC: the columns hold UTC and
// the driver reads and writes times in loc. New cannot see the DSN; the
// first claim checks both and fails with a configuration error (not
// [idem.ErrStoreUnavailable]) before writing anything. interpolateParams=true
// is recommended: it saves the prepare round trip of every statement, and all
// of idem's statements work either way. Keep clientFoundRows at its default
// (false), on which the claim's insert-or-not answer relies.
//
//	root@tcp(127.0.0.1:3306)/app?parseTime=true&interpolateParams=true
//
// # Schema
//
// Create the table with [Migrate] or by applying the files of
// [github.com/idemstore/idem/migrations] with your own tool; the table lives
// in the DSN's database. Migrate takes the server lock
// GET_LOCK('idem_migrate') around goose's Up, so instances starting together
// may all call it. Keys and scopes are VARBINARY, so they match byte for
// byte whatever the server's collation: "Key" and "key" are two records.
// Times are DATETIME(6) holding UTC.
//
// # Claiming
//
// MySQL has no RETURNING (MariaDB 10.5+ has it for INSERT and DELETE), so,
// to keep one code path for both servers, a claim is two statements. First INSERT ... ON DUPLICATE KEY UPDATE with a no-op
// assignment: RowsAffected is 1 when it inserted and 0 when the key existed
// (with clientFoundRows=false, an update that changes nothing counts no
// rows). INSERT IGNORE is not used: it also turns errors other than
// duplicates into warnings. On an existing row the no-op update takes an
// exclusive lock until the transaction ends, which serialises claimers of
// that key. Then a SELECT ... FOR UPDATE reads the record. It is a locking
// read because, under REPEATABLE READ (InnoDB's default, which works fine),
// a plain SELECT reads the transaction's snapshot, which can predate the
// commit of the claim the INSERT waited for.
//
// An INSERT that meets another transaction's uncommitted claim of the same
// key waits for it: if that transaction commits, the claim replays or
// reports the mismatch; if it rolls back, the claim inserts. The wait is
// bounded by innodb_lock_wait_timeout set to Config.WaitTimeout rounded up
// to whole seconds (the variable counts seconds, at least 1). On MariaDB each
// claim statement carries SET STATEMENT innodb_lock_wait_timeout=N FOR, with
// no extra round trip. MySQL has no SET STATEMENT: there the session value is
// saved, set for the claim and restored, on the caller's transaction or on a
// connection taken from the pool for the claim. The server is identified once
// per [Dialect] by VERSION(). A context deadline is not used for the wait,
// because the driver closes the connection when a context ends, which would
// destroy the caller's transaction.
//
// When the wait runs out (error 1205), the claim returns an
// *idem.InProgressError whose RetryAfter is Config.WaitTimeout. InnoDB rolls
// back only the timed-out statement, so the caller's transaction stays
// usable and TxAborted is false, unless the server runs with
// innodb_rollback_on_timeout=ON, which rolls back the whole transaction:
// the dialect reads that setting and then reports TxAborted.
//
// # Deadlocks and other conflicts
//
// When several transactions wait for the same uncommitted claim and its
// holder rolls back, InnoDB may pick one of the waiters as a deadlock victim
// (error 1213) and roll back its whole transaction; so may any other
// deadlock. Those, and lock wait timeouts outside the claim's own wait
// (1205), are returned as [idem.ErrRetryable]: roll the transaction back and
// run it again, as [idem.Store.Do] does by itself. Do not keep using a
// transaction after 1213: the server has ended it, and further statements on
// its connection would run outside any transaction.
//
// Errors from the server keep their *mysql.MySQLError reachable with
// errors.As and are classified by number, never by message. Errors from the
// client side of the connection (invalid connection, network errors, a
// closed *sql.DB, an expired context deadline) are [idem.ErrStoreUnavailable];
// a cancelled context is returned as such.
//
// # Clock
//
// Times written and compared come from UTC_TIMESTAMP(6), never NOW(), which
// follows the session's time_zone. It is the time the statement started, so
// it does not lag inside a long caller transaction. A pinned Config.Now is
// sent as a UTC time truncated to microseconds, the columns' precision (MySQL
// would round extra digits, MariaDB truncates them).
package mysql
