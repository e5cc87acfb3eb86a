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
// linux/amd64. The claim uses INSERT ... RETURNING, which needs SQLite 3.35
// or later.
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
