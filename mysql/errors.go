package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemstore/idem"
)

// Server error numbers, shared by MySQL and MariaDB.
const (
	erCheckRead       = 1020 // ER_CHECKREAD: record changed since the snapshot (MariaDB innodb_snapshot_isolation)
	erConCount        = 1040 // ER_CON_COUNT_ERROR: too many connections
	erServerShutdown  = 1053 // ER_SERVER_SHUTDOWN
	erDupEntry        = 1062 // ER_DUP_ENTRY
	erLockWaitTimeout = 1205 // ER_LOCK_WAIT_TIMEOUT
	erLockDeadlock    = 1213 // ER_LOCK_DEADLOCK
)

var (
	// errUniqueViolation should never be seen: the claim absorbs its
	// duplicate key errors, and no other statement writes a key.
	errUniqueViolation = errors.New("idem: mysql: unique violation")

	// errParseTime and errNotUTC report a DSN that idem cannot work with.
	// They are configuration errors, not an unavailable store.
	errParseTime = errors.New("idem: mysql: DATETIME values arrive as text: add parseTime=true to the DSN")
	errNotUTC    = errors.New("idem: mysql: DATETIME values arrive in a zone other than UTC: remove loc from the DSN or set loc=UTC")
)

// interpretError classifies an error from the driver or database/sql:
// server errors by number, everything else by where it came from. The
// original error stays reachable with errors.Is and errors.As (the text of
// a duplicate key error is dropped: it quotes the key). A statement whose
// lock wait is bounded (see executor.boundWait) turns its own lock wait
// timeout into an *idem.InProgressError before calling it.
func interpretError(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, sql.ErrNoRows) {
		return idem.ErrNotFound
	}
	if errors.Is(err, errParseTime) || errors.Is(err, errNotUTC) {
		return err
	}
	var myErr *gomysql.MySQLError
	if errors.As(err, &myErr) {
		switch myErr.Number {
		case erLockDeadlock, erCheckRead:
			// InnoDB rolled back the whole transaction. 1020 is MariaDB's
			// serialization failure with innodb_snapshot_isolation=ON (the
			// default from 11.6): a locking read or write met a row
			// changed after the transaction's snapshot.
			return fmt.Errorf("%w: %w", idem.ErrRetryable, err)
		case erLockWaitTimeout:
			// Only the statement was rolled back (unless
			// innodb_rollback_on_timeout=ON), but the transaction cannot
			// know whether its earlier writes still make sense: retry it.
			return fmt.Errorf("%w: %w", idem.ErrRetryable, err)
		case erConCount, erServerShutdown:
			return fmt.Errorf("%w: %w", idem.ErrStoreUnavailable, err)
		case erDupEntry:
			// The server's message quotes the duplicate key: keep the
			// error reachable, not its text.
			return &redactedError{msg: errUniqueViolation.Error(), errs: []error{errUniqueViolation, err}}
		default:
			return fmt.Errorf("idem: mysql: %w", err)
		}
	}
	switch {
	case errors.Is(err, context.Canceled):
		// The caller gave up; the store is not at fault.
		return fmt.Errorf("idem: mysql: %w", err)
	case errors.Is(err, sql.ErrTxDone):
		// A transaction used after its end is a caller bug, not an outage.
		return fmt.Errorf("idem: mysql: %w", err)
	default:
		// Everything else comes from the client side of the connection:
		// driver.ErrBadConn, mysql.ErrInvalidConn, network errors, a closed
		// *sql.DB ("sql: database is closed"), sql.ErrConnDone,
		// context.DeadlineExceeded.
		return fmt.Errorf("%w: %w", idem.ErrStoreUnavailable, err)
	}
}

// redactedError wraps errors without repeating their messages, for driver
// errors whose text quotes keys or scopes.
type redactedError struct {
	msg  string
	errs []error
}

func (e *redactedError) Error() string   { return e.msg }
func (e *redactedError) Unwrap() []error { return e.errs }

// isDupEntry reports whether err is the server's duplicate key error, by
// number: its message quotes the key.
func isDupEntry(err error) bool {
	var myErr *gomysql.MySQLError
	return errors.As(err, &myErr) && myErr.Number == erDupEntry
}

// isLockWaitTimeout reports whether err is the server's lock wait timeout.
func isLockWaitTimeout(err error) bool {
	var myErr *gomysql.MySQLError
	return errors.As(err, &myErr) && myErr.Number == erLockWaitTimeout
}
