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
	erConCount        = 1040 // ER_CON_COUNT_ERROR: too many connections
	erServerShutdown  = 1053 // ER_SERVER_SHUTDOWN
	erDupEntry        = 1062 // ER_DUP_ENTRY
	erLockWaitTimeout = 1205 // ER_LOCK_WAIT_TIMEOUT
	erLockDeadlock    = 1213 // ER_LOCK_DEADLOCK
)

var (
	// errUniqueViolation should never be seen: the claim absorbs duplicates
	// with ON DUPLICATE KEY UPDATE.
	errUniqueViolation = errors.New("idem: mysql: unique violation")

	// errParseTime and errNotUTC report a DSN that idem cannot work with.
	// They are configuration errors, not an unavailable store.
	errParseTime = errors.New("idem: mysql: DATETIME values arrive as text: add parseTime=true to the DSN")
	errNotUTC    = errors.New("idem: mysql: DATETIME values arrive in a zone other than UTC: remove loc from the DSN or set loc=UTC")
)

// interpretError classifies an error from the driver or database/sql:
// server errors by number, everything else by where it came from. The
// original error stays reachable with errors.Is and errors.As. Claim turns
// its own lock wait timeout into an *idem.InProgressError before calling it.
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
		case erLockDeadlock:
			// InnoDB rolled back the whole transaction.
			return fmt.Errorf("%w: %w", idem.ErrRetryable, err)
		case erLockWaitTimeout:
			// Only the statement was rolled back (unless
			// innodb_rollback_on_timeout=ON), but the transaction cannot
			// know whether its earlier writes still make sense: retry it.
			return fmt.Errorf("%w: %w", idem.ErrRetryable, err)
		case erConCount, erServerShutdown:
			return fmt.Errorf("%w: %w", idem.ErrStoreUnavailable, err)
		case erDupEntry:
			return fmt.Errorf("%w: %w", errUniqueViolation, err)
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

// isLockWaitTimeout reports whether err is the server's lock wait timeout.
func isLockWaitTimeout(err error) bool {
	var myErr *gomysql.MySQLError
	return errors.As(err, &myErr) && myErr.Number == erLockWaitTimeout
}
