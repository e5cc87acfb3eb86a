// Package sqlite is idem's dialect for SQLite, through database/sql and
// modernc.org/sqlite (pure Go, no cgo; driver name "sqlite"). Its
// transaction type is *sql.Tx. It needs no server, which makes it the
// reference dialect that every test run exercises.
//
// The package name is the same as the driver's. Import it under an alias
// when both are needed:
//
//	import (
//		"modernc.org/sqlite"
//
//		idemsqlite "github.com/idemstore/idem/sqlite"
//	)
//
//	db, err := idemsqlite.Open("/var/lib/app/app.db")
//	...
//	err = idemsqlite.Migrate(ctx, db)
//	store, err := idem.New(idemsqlite.New(db), nil) // *idem.Store[*sql.Tx]
//
// Tested with SQLite 3.54.1 as shipped by modernc.org/sqlite v1.62.0 on
// linux/amd64. The claim is INSERT ... ON CONFLICT DO NOTHING, whose
// changed-row count tells whether it inserted; it needs SQLite 3.24 or later
// (only the version above is tested).
//
// # Opening the database
//
// Use [Open] to get a correctly configured *sql.DB. It opens a file (never
// ":memory:": each pooled connection would get a database of its own) with
//
//	file:<path>?_pragma=journal_mode(WAL)&_pragma=busy_timeout(5000)&_pragma=synchronous(FULL)&_pragma=foreign_keys(1)&_txlock=immediate
//
// If you open the database yourself, keep these settings, _txlock=immediate
// above all: idem's transactions, and yours, must take the write lock at
// BEGIN. The same file may be shared by several *sql.DB and processes on one
// machine (not over a network file system, where WAL does not work).
//
// # One writer at a time
//
// SQLite locks the whole database for writing: in WAL mode readers never
// block and never wait, but at most one transaction writes at a time. This
// changes how idem behaves, compared with the server dialects:
//
//   - A transaction begun on a DB from Open (by [idem.Store.Do], or by your
//     db.BeginTx before [idem.Store.ClaimTx]) is BEGIN IMMEDIATE: it waits at
//     BEGIN for the write lock, up to the busy timeout (5s with Open), and
//     fails with SQLITE_BUSY past it ([idem.ErrStoreUnavailable] when begun
//     by Do). Once it has begun, its claim never waits, and no other
//     transaction's uncommitted claim can exist: a claimer sees either the
//     holder's committed record or none. Config.WaitTimeout does not apply
//     to these transactions.
//   - [idem.Store.Claim] (on the pool) runs in a BEGIN IMMEDIATE transaction
//     of its own and waits for the write lock up to Config.WaitTimeout
//     (rounded up to a millisecond). Past it, it returns
//     [idem.ErrStoreUnavailable], not [idem.ErrInProgress]: the database was
//     locked by another writer, and SQLite cannot tell which key that writer
//     holds, or whether it holds one at all.
//   - Keep transactions short: a transaction that runs slow work while it
//     holds the lock stalls every writer, claims of unrelated keys included.
//   - A DEFERRED transaction (a DSN without _txlock=immediate) that reads
//     before it writes cannot wait for the lock: its first write fails at
//     once with SQLITE_BUSY ([idem.ErrStoreUnavailable]) while another
//     writer holds the lock, or with SQLITE_BUSY_SNAPSHOT
//     ([idem.ErrRetryable]) if another writer committed since its first
//     read. Open avoids both.
//
// Writers waiting for the lock poll for it (SQLite's busy handler sleeps in
// steps of up to 100ms), so a waiter may resume some milliseconds after the
// holder commits. database/sql opens connections without limit; each one
// costs a page cache. A pool limited to one connection makes writers queue
// in Go instead, but then a goroutine holding a transaction must not call
// pool methods such as [idem.Store.Claim] or it waits for itself.
//
// # Leases and the reaper
//
// On the pool ([Dialect.DB]), renewing a lease, taking a record over,
// listing stale leases and deleting expired records are single statements
// in autocommit mode, each its own transaction. A renewal or a takeover
// waits for the write lock up to Config.WaitTimeout, like a pool-level
// claim; a delete waits up to the connection's busy timeout (5s with Open);
// past either they fail with [idem.ErrStoreUnavailable]. Listing is a read
// and, in WAL mode, never waits.
//
// Deleting expired records is a write like any other: while a batch runs it
// holds the lock of the whole database, and claims of every key queue behind
// it. The delete therefore takes at most the reaper's batch size of records
// per statement (DELETE ... WHERE rowid IN (SELECT ... ORDER BY expires_at
// LIMIT ?), walking the expires_at index), so that each write transaction
// stays short and claims queue only briefly: a large backlog is cleared by
// many short transactions, never by one long one. Keep the batch size
// modest (hundreds to a few thousand records: a batch of a thousand takes
// milliseconds on a local disk) rather than raising it to catch up faster:
// a pool-level [idem.Store.Claim] waits for the lock only up to
// Config.WaitTimeout, so a batch must take well under it.
//
// Short batches are not enough on their own, because SQLite's lock has no
// queue: a waiting writer polls for it, sleeping up to 100ms between tries.
// A reaper that started its next batch the moment one committed would take
// the lock again before the waiting claims woke, and they would time out
// however short each batch was; a reaper that waited like a claim would
// rarely find the lock free under a steady stream of claims. So the pool's
// delete polls for the lock every millisecond (within the connection's busy
// timeout, which it sets to zero meanwhile and then restores), and after a
// full batch it leaves the lock free for as long as the batch held it, up to
// 100ms, before it returns: the reaper holds the lock at most about half the
// time, and claims waiting for it get it between batches.
//
// SQLite has no row locks and no SKIP LOCKED. Reapers of several instances
// on one database run their deletes one after another; each deletes what is
// still there, so a reaper behind another deletes the next batch or nothing.
// Listing stale leases locks nothing, so two reapers may list the same
// record; the fencing token decides between them: of two writes that expect
// the same token (a renewal with a new token, a takeover, a completion),
// only the first matches, and the other gets [idem.ErrFenced].
//
// # Time
//
// Times are stored as INTEGER microseconds since the Unix epoch, UTC. SQLite
// runs in this process, so "the database's clock" is this process's clock:
// with Config.Now nil the dialect calls time.Now. Instances sharing the file
// share the machine's clock. Every time returned is in UTC.
//
// # Errors
//
// SQLITE_BUSY and SQLITE_LOCKED past the busy timeout, SQLITE_CANTOPEN,
// SQLITE_IOERR, a closed *sql.DB and context.DeadlineExceeded match
// [idem.ErrStoreUnavailable]; SQLITE_BUSY_SNAPSHOT matches
// [idem.ErrRetryable]. The driver's error stays reachable with errors.As and
// a *sqlite.Error of modernc.org/sqlite, whose Code is the extended result
// code.
package sqlite
