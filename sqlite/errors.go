package sqlite

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strconv"

	msqlite "modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/idemstore/idem"
)

// interpretError classifies an error of database/sql or modernc.org/sqlite
// for the Store. The original error stays reachable through %w, so callers
// can still errors.As it to *sqlite.Error (modernc.org/sqlite) and read its
// Code.
//
//   - sql.ErrNoRows becomes idem.ErrNotFound.
//   - SQLITE_BUSY_SNAPSHOT matches idem.ErrRetryable: a transaction that read
//     before writing (a DEFERRED one) found its snapshot outdated by another
//     writer's commit; running it again succeeds.
//   - Any other SQLITE_BUSY or SQLITE_LOCKED matches idem.ErrStoreUnavailable:
//     another writer held the database lock past the busy timeout. SQLite
//     locks the whole database, so it cannot tell which key the other writer
//     holds, or whether it holds one at all.
//   - SQLITE_CANTOPEN, SQLITE_IOERR and SQLITE_PROTOCOL, the in-process
//     equivalents of an unreachable server, match idem.ErrStoreUnavailable.
//   - Other SQLite errors (a constraint, a missing table, a full disk) are
//     wrapped as they are.
//   - context.Canceled is wrapped as it is: the caller gave up.
//   - Everything else that did not come from SQLite (a closed *sql.DB,
//     sql.ErrConnDone, driver.ErrBadConn, context.DeadlineExceeded, a DSN the
//     driver rejected) matches idem.ErrStoreUnavailable.
//
// The messages of SQLite errors never contain bound values, and every value
// in this package's statements is bound.
func interpretError(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, sql.ErrNoRows) {
		return idem.ErrNotFound
	}
	if errors.Is(err, context.Canceled) {
		return fmt.Errorf("idem: sqlite: %w", err)
	}
	var serr *msqlite.Error
	if errors.As(err, &serr) {
		if class := sqliteErrorClass(serr); class != nil {
			return fmt.Errorf("%w: %w", class, err)
		}
		return fmt.Errorf("idem: sqlite: %w", err)
	}
	if errors.Is(err, sql.ErrTxDone) {
		// Committing or rolling back a finished transaction is a caller's
		// mistake, not an outage.
		return fmt.Errorf("idem: sqlite: %w", err)
	}
	return fmt.Errorf("%w: %w", idem.ErrStoreUnavailable, err)
}

// sqliteErrorClass is the class of an error of SQLite itself whatever
// statement met it: ErrRetryable for SQLITE_BUSY_SNAPSHOT, ErrStoreUnavailable
// for the lock held past the busy timeout or a database that cannot be
// opened or read, nil otherwise.
func sqliteErrorClass(serr *msqlite.Error) error {
	// Code is the extended result code (the driver enables them); the low
	// byte is the primary code.
	if serr.Code() == sqlite3.SQLITE_BUSY_SNAPSHOT {
		return idem.ErrRetryable
	}
	switch serr.Code() & 0xff {
	case sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED,
		sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_PROTOCOL:
		return idem.ErrStoreUnavailable
	}
	return nil
}

// Classify implements [idem.ErrorClassifier] with [Classify].
func (d *Dialect) Classify(err error) error { return Classify(err) }

// Classify classifies an error of the caller's own statements on a *sql.DB
// or *sql.Tx of this driver, such as a [idem.Store.Do] callback's statement
// or tx.Commit() after [idem.Store.ClaimTx] (which [idem.Store.Classify]
// calls for you): SQLITE_BUSY_SNAPSHOT (a deferred transaction's snapshot
// outdated by another writer's commit) is wrapped to match
// [idem.ErrRetryable]; any other SQLITE_BUSY or SQLITE_LOCKED (the lock held
// past the busy timeout), SQLITE_CANTOPEN, SQLITE_IOERR, SQLITE_PROTOCOL and
// a lost or closed connection (driver.ErrBadConn, sql.ErrConnDone) to match
// [idem.ErrStoreUnavailable]. Every other error, and one that already
// matches either, is returned unchanged, so an application's own errors pass
// through untouched. The driver's error stays reachable with errors.As.
func Classify(err error) error {
	if err == nil || errors.Is(err, idem.ErrRetryable) || errors.Is(err, idem.ErrStoreUnavailable) {
		return err
	}
	var serr *msqlite.Error
	if errors.As(err, &serr) {
		if class := sqliteErrorClass(serr); class != nil {
			return fmt.Errorf("%w: %w", class, err)
		}
		return err
	}
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) {
		return fmt.Errorf("%w: %w", idem.ErrStoreUnavailable, err)
	}
	return err
}

// isSQLiteError reports whether err was returned by SQLite itself, as
// opposed to the context, the pool or the driver around it.
func isSQLiteError(err error) bool {
	var serr *msqlite.Error
	return errors.As(err, &serr)
}

// isBusy reports whether err is SQLite's SQLITE_BUSY (any extended code):
// another connection held the lock.
func isBusy(err error) bool {
	var serr *msqlite.Error
	return errors.As(err, &serr) && serr.Code()&0xff == sqlite3.SQLITE_BUSY
}

// ErrorCode returns the extended result code of the SQLite error in err's
// chain, or "" if there is none. The Store logs it in place of the error's
// text.
func (d *Dialect) ErrorCode(err error) string {
	var serr *msqlite.Error
	if errors.As(err, &serr) {
		return strconv.Itoa(serr.Code())
	}
	return ""
}
