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
// is strongly recommended: without it database/sql prepares, executes and
// closes every statement, three round trips instead of one, which roughly
// doubles the cost of a claim and a completion. All of idem's statements work
// either way (the test suite runs both), and idem sends no text that
// interpolation could mishandle: keys and scopes are bound as bytes. clientFoundRows may have either
// value.
//
// One statement is prepared whatever the DSN says: the replay read that
// [idem.Store.Do] (and so the idemhttp middleware) makes on the pool before
// claiming a key. In the text protocol the server parsed and resolved it on
// every replay, which cost MariaDB more than reading the row; prepared, it
// is parsed once per connection. database/sql prepares it on each pool
// connection the first time it runs there (one more round trip, once) and
// the server keeps one statement per open connection of the pool, which
// counts against max_prepared_stmt_count. Every Dialect over one *sql.DB
// shares that statement, however many are built, and the last of them to
// be garbage collected closes it. A server that refuses the prepare (error
// 1295, or 1461 at max_prepared_stmt_count) gets the read as text, on
// every Dialect over the pool, for a minute before the next attempt. A
// proxy between the service and the server must pass prepared statements
// through, as it must for any pool without interpolateParams.
//
//	root@tcp(127.0.0.1:3306)/app?parseTime=true&interpolateParams=true&readTimeout=30s&writeTimeout=30s
//
// Set readTimeout and writeTimeout too, well above Config.WaitTimeout and
// your slowest business statement. database/sql's Tx.Commit takes no
// context, and go-sql-driver waits for the server's answer to COMMIT
// without a deadline by default, so a connection that goes half-open at the
// COMMIT holds the request until the kernel gives up on it (minutes), far
// past the caller's own deadline. With readTimeout the COMMIT fails as
// [idem.ErrStoreUnavailable] after that time; its outcome is unknown, and
// the client's retry gets the replay if it committed (docs/reliability.md,
// "Faults on the wire").
//
// # Round trips: NewConnector
//
// database/sql sends START TRANSACTION when a transaction begins and COMMIT
// when it commits, each a round trip of its own that nothing can join. So
// on a pool of the driver's, [idem.Store.Do] costs the business statements'
// round trips plus four: BEGIN, the claim, the completion, COMMIT (5 for a
// one-INSERT callback, against 3 for the bare transaction). Open the pool
// with [NewConnector] instead and, on MariaDB, Do costs two fewer:
//
//	cfg, err := mysql.ParseDSN("root@tcp(127.0.0.1:3306)/app?parseTime=true&readTimeout=30s&writeTimeout=30s")
//	connector, err := idemmysql.NewConnector(cfg)
//	db := sql.OpenDB(connector)
//	store, err := idem.New(idemmysql.New(db), nil)
//
// Its connections are the driver's, behind a thin layer that begins Do's
// transaction lazily: START TRANSACTION travels in one compound statement
// (BEGIN NOT ATOMIC ... END) with the claim's INSERT, and COMMIT in one
// with the completion's UPDATE, which raises an error instead of committing
// when the completion matched no row (see [Dialect.CompleteCommit]). A
// replay costs 3 round trips instead of 4. No multiStatements is needed (a
// compound statement is one statement); interpolateParams is turned on,
// because the server cannot prepare a compound statement; a completion
// whose text would exceed maxAllowedPacket is sent apart from COMMIT, as a
// prepared statement. The claim and the completion that cannot travel with
// BEGIN or COMMIT (ClaimTx's and CompleteTx's in a caller's transaction,
// the pool's leased claims) run prepared, once per connection, so the
// server does not parse them on every call: with the replay read, a few
// server-side statements per connection, under the server's
// max_prepared_stmt_count. A server that refuses the prepare (error 1295,
// or that count reached) gets the text on that connection from then on;
// any other failure of the prepare is the statement's error, since it is
// where a transaction rolled back between two commands (on Galera, by a
// brute-force abort) is reported. Every other statement and transaction,
// the callback's included, reaches the driver unchanged; on MySQL (no
// compound statements outside stored programs) the pool behaves as the
// driver's but for those prepared statements. A pool of the driver's stays
// fully supported.
//
// # Schema
//
// Create the table with [Migrate] or by applying the files of
// [github.com/idemstore/idem/migrations] with your own tool; the table lives
// in the DSN's database. Migrate takes the server lock
// GET_LOCK('idem_migrate') and a lease row in idem_migrate_lock (which it
// creates) around goose's Up, so instances starting together may all call
// it, on one server or on several nodes of a Galera cluster. Keys and scopes are VARBINARY, so they match byte for
// byte whatever the server's collation: "Key" and "key" are two records.
// Times are DATETIME(6) holding UTC.
//
// # Claiming
//
// MySQL has no RETURNING (MariaDB 10.5+ has it for INSERT and DELETE), so on
// MySQL a claim is two statements, and on MariaDB one when it acquires (an
// INSERT ... RETURNING of the times it computed) and two when the key
// exists. Do's claim on MariaDB, which carries BEGIN, returns nothing: the
// returned times cost about a tenth of a small Do's throughput, and Do's
// holder keeps its row lock to the commit, so the times it reports are the
// client's clock's (the pinned one exactly) while the stored ones are the
// server's. First a plain INSERT of the processing record. When the key exists it fails with
// a duplicate key error (1062), which the claim recognises by number and
// absorbs (its message, which quotes the key, never leaves the package);
// InnoDB rolls back that statement only, and the transaction goes on. Then a
// SELECT ... LOCK IN SHARE MODE reads the record. It is a locking read
// because, under REPEATABLE READ (InnoDB's default, which works fine), a
// plain SELECT reads the transaction's snapshot, which can predate the
// commit of the claim the INSERT waited for. Neither INSERT IGNORE, which
// also turns errors other than duplicates into warnings, nor INSERT ... ON
// DUPLICATE KEY UPDATE, which would lock the existing record exclusively.
//
// A transaction that claimed a key holds a lock on its record until it
// ends, whether it acquired the key or not: an exclusive one on the record
// it inserted, a shared one on a record it found (taken by the duplicate
// check and the read). Shared locks let any number of transactions replay
// the same completed key side by side, but they hold up writes to the
// record: end a transaction promptly after a claim that did not acquire
// ([idem.Store.Do] does), or the holder's own completion, renewal or
// release of a leased key, and takeovers, wait for it.
//
// An INSERT that meets another transaction's uncommitted claim of the same
// key waits for it: if that transaction commits, the claim replays or
// reports the mismatch; if it rolls back, the claim inserts. The wait is
// bounded by innodb_lock_wait_timeout set to Config.WaitTimeout rounded up
// to whole seconds (the variable counts seconds, at least 1); so is the wait
// of a takeover or a lease renewal for a transaction that holds the record.
// On MariaDB each such statement carries SET STATEMENT
// innodb_lock_wait_timeout=N FOR, with no extra round trip. MySQL has no SET
// STATEMENT: there the session value is saved, set and restored, on the
// caller's transaction or on a connection taken from the pool for the
// purpose; a restore that fails within 5 seconds gets that pool connection
// discarded. The server is identified once per [Dialect] by VERSION().
//
// A context deadline is not used for the wait, because the driver closes the
// connection when a context ends, which would destroy the caller's
// transaction. Closing the connection does not stop the statement on the
// server, which goes on waiting and then runs to its end, then rolls back
// with the transaction when it sees the connection gone. On the pool, where
// each statement would commit on its own, the claim, the takeover and the
// lease renewal therefore run in a short transaction of their own (two more
// round trips), so that one whose context ends while it waits leaves
// nothing behind.
//
// When the wait runs out (error 1205), the call returns an
// *idem.InProgressError whose RetryAfter is Config.WaitTimeout and whose
// Cause is the driver's error. InnoDB rolls back only the timed-out
// statement, so the caller's transaction stays usable and TxAborted is
// false, unless the server runs with innodb_rollback_on_timeout=ON, which
// rolls back the whole transaction: the dialect reads that setting and then
// reports TxAborted.
//
// A takeover evaluates its condition (retention or lease run out) on the
// newest committed version of the record, after any wait, never on the
// caller's snapshot, as an UPDATE does in InnoDB: a holder that completed
// or renewed a moment earlier keeps its record.
//
// # Optimistic Do
//
// With [WithOptimisticDo], [idem.Store.Do] claims a free key with a plain
// read and nothing else, and its completion inserts the finished record
// and commits: one row version where the default claim writes two, and no
// lock while fn runs. Two overlapping calls of one key then both run fn;
// the database's primary key lets one commit, and the other is rolled back
// and replays it (see the option, and docs/design.md). Everything else
// (ClaimTx, Claim, leases, replays) is unchanged.
//
// # Deadlocks and other conflicts
//
// When several transactions wait for the same uncommitted claim and its
// holder rolls back, each of them holds a shared lock on the key and needs an
// exclusive one to insert: InnoDB lets one insert and rolls the others back
// as deadlock victims (error 1213), usually all of them (seen on MariaDB
// 10.11). Likewise when two transactions that found the same expired record
// both try to take it over. Those, any other deadlock, and lock wait
// timeouts outside the bounded waits above (1205) are returned as
// [idem.ErrRetryable]: roll the transaction back and run it again, as
// [idem.Store.Do] does by itself ([idem.Store.Claim] on the pool retries
// too). Do not keep using a transaction after 1213: the server has ended
// it, and further statements on its connection would run outside any
// transaction.
//
// MariaDB 11.6 and later default to innodb_snapshot_isolation=ON (10.6.18+
// and 10.11.8+ have it, OFF). With it, a claim, takeover or renewal inside a
// REPEATABLE READ transaction that has read before, and whose snapshot
// predates a change to the record (such as the commit of the claim it waited
// for), fails with error 1020 and the server rolls the transaction back:
// that too is [idem.ErrRetryable]. Claiming first in the transaction, as
// [idem.Store.Do] does, avoids it. Tested here by setting the variable in a
// session on MariaDB 10.11 only.
//
// Errors from the server keep their *mysql.MySQLError reachable with
// errors.As and are classified by number, never by message. Errors from the
// client side of the connection (invalid connection, network errors, a
// closed *sql.DB, an expired context deadline) are [idem.ErrStoreUnavailable];
// a cancelled context is returned as such.
//
// Errors of statements idem did not send are classified by [Classify]:
// [idem.Store.Do] applies it to its callback's errors (a deadlock met by the
// callback is retried like idem's own), and callers of [idem.Store.ClaimTx]
// apply it, through [idem.Store.Classify], to their own statements' and
// commit's errors.
//
// # Galera
//
// On a MariaDB Galera cluster, row locks are local to a node and conflicting
// writes from two nodes are settled at COMMIT by certification: the loser
// fails with 1213, at COMMIT or at the next statement of a transaction a
// replicated write aborted, including a callback's or a caller's own
// statement. That is [idem.ErrRetryable], handled as above. A node that
// cannot serve (outside the primary component, joining, rejecting queries)
// answers 1047, a commit that could not be replicated 1180: both are
// [idem.ErrStoreUnavailable]. Replays stay correct on a node that has not
// yet applied the writer's commit; wsrep_sync_wait=1 in the DSN spares the
// callback runs that certification then rolls back. docs/scaling.md
// ("Galera") has the details and the measurements.
//
// # Leases and the reaper
//
// A renewal also moves the record's retention deadline to the new lease
// expiry when that is later, so a record whose lease is kept alive is never
// taken over or reaped as expired.
//
// Without RETURNING, a lease renewal cannot read back the expiry it wrote.
// Unless Config.Now pins the clock, it reads the server's clock first,
// passes that time to its UPDATE and computes the expiry from it with the
// same microsecond arithmetic, so that the time it returns is the one stored:
// one extra round trip per renewal. Listing stale leases reads the clock the
// same way to return the time it compared with; the list itself is a
// non-locking read of the (status, lease_expires_at) index range.
//
// The reaper deletes each batch of expired records with one statement: a
// DELETE joined, by primary key, to a derived SELECT ... WHERE expires_at <=
// now ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED (MySQL 8.0+, MariaDB
// 10.6+). It locks the rows it deletes and skips, without waiting, those
// that other transactions hold, such as an expired key that an uncommitted
// claim is taking over; the row is left for a later pass. A plain DELETE ...
// ORDER BY expires_at LIMIT ? would wait for that claim's transaction, up to
// innodb_lock_wait_timeout, while holding locks that stop other claims. Two
// reapers share the expired rows instead of queueing behind each other.
// When fewer rows than a batch are expired, InnoDB also locks the first live
// row past them until the statement ends (skipping it too if it is held).
// What a pass costs the claims is CPU, not lock waits: on MariaDB 10.11 with
// two shared cores the statement took about 14 µs of its server thread per
// deleted row, purge more afterwards, and InnoDB counted no row lock wait
// while it ran beside 8 claim workers (16 000–28 000 rows/s, claim p99 2–9×
// its figure without the reaper, on a loaded machine). Where the claims
// already use every core, ReaperConfig.BatchPause trades the rate for their
// tail. The forms of the statement that were measured against it, and why
// they were not taken, are in the comment of deleteExpired in queries.go.
// Statements that use LIMIT or SKIP LOCKED are unsafe for statement-based
// replication: with binlog_format=STATEMENT the server logs a warning, while
// MIXED and ROW log the deleted rows. Like everything else here, the
// statement ran against MariaDB only.
//
// # Clock
//
// Times written and compared come from UTC_TIMESTAMP(6), never NOW(), which
// follows the session's time_zone. It is the time the statement started, so
// it does not lag inside a long caller transaction. A pinned Config.Now is
// sent as a UTC time truncated to microseconds, the columns' precision (MySQL
// would round extra digits, MariaDB truncates them).
package mysql
