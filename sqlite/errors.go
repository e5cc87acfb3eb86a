package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

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
		// Code is the extended result code (the driver enables them); the
		// low byte is the primary code.
		if serr.Code() == sqlite3.SQLITE_BUSY_SNAPSHOT {
			return fmt.Errorf("%w: %w", idem.ErrRetryable, err)
		}
		switch serr.Code() & 0xff {
		case sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED,
			sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_PROTOCOL:
			return fmt.Errorf("%w: %w", idem.ErrStoreUnavailable, err)
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
