package mysql

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"strconv"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemstore/idem"
)

// Server error numbers, shared by MySQL and MariaDB.
const (
	erCheckRead         = 1020 // ER_CHECKREAD: record changed since the snapshot (MariaDB innodb_snapshot_isolation)
	erConCount          = 1040 // ER_CON_COUNT_ERROR: too many connections
	erUnknownCom        = 1047 // ER_UNKNOWN_COM_ERROR: Galera's "WSREP has not yet prepared node for application use"
	erServerShutdown    = 1053 // ER_SERVER_SHUTDOWN
	erDupEntry          = 1062 // ER_DUP_ENTRY
	erErrorDuringCommit = 1180 // ER_ERROR_DURING_COMMIT: Galera's commit on a node that lost the primary component
	erLockWaitTimeout   = 1205 // ER_LOCK_WAIT_TIMEOUT
	erLockDeadlock      = 1213 // ER_LOCK_DEADLOCK, also Galera's certification failure and brute-force abort
	erReadOnly          = 1290 // ER_OPTION_PREVENTS_STATEMENT: a --read-only server
	erUnsupportedPS     = 1295 // ER_UNSUPPORTED_PS: the statement cannot be prepared
	erMaxPreparedStmts  = 1461 // ER_MAX_PREPARED_STMT_COUNT_REACHED: max_prepared_stmt_count
	erSignalException   = 1644 // ER_SIGNAL_EXCEPTION: completeCommit's SIGNAL
	erConnectionKilled  = 1927 // ER_CONNECTION_KILLED: MariaDB, the server is shutting down
)

// serverErrorClass returns idem.ErrRetryable or idem.ErrStoreUnavailable for
// the server error numbers of those classes, nil for the others.
func serverErrorClass(number uint16) error {
	switch number {
	case erLockDeadlock, erCheckRead:
		// InnoDB rolled back the whole transaction. 1020 is MariaDB's
		// serialization failure with innodb_snapshot_isolation=ON (the
		// default from 11.6): a locking read or write met a row changed
		// after the transaction's snapshot. On Galera 1213 is also a
		// certification failure (at COMMIT, or at the next statement of a
		// transaction a replicated one aborted): nothing was committed.
		return idem.ErrRetryable
	case erLockWaitTimeout:
		// Only the statement was rolled back (unless
		// innodb_rollback_on_timeout=ON), but the transaction cannot know
		// whether its earlier writes still make sense: retry it.
		return idem.ErrRetryable
	case erConCount, erServerShutdown, erConnectionKilled:
		return idem.ErrStoreUnavailable
	case erUnknownCom, erErrorDuringCommit, erReadOnly:
		// Galera answers 1047 on a node outside the primary component,
		// still joining, or rejecting queries (wsrep_reject_queries), and
		// 1180 when a COMMIT could not be replicated (the transaction did
		// not commit); 1290 is a server in read-only mode. None can take a
		// write now; another node or a later try may.
		return idem.ErrStoreUnavailable
	default:
		return nil
	}
}

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
		if class := serverErrorClass(myErr.Number); class != nil {
			return fmt.Errorf("%w: %w", class, err)
		}
		if myErr.Number == erDupEntry {
			// The server's message quotes the duplicate key: keep the
			// error reachable, not its text.
			return &redactedError{msg: errUniqueViolation.Error(), errs: []error{errUniqueViolation, err}}
		}
		return fmt.Errorf("idem: mysql: %w", err)
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

// Classify implements [idem.ErrorClassifier] with [Classify].
func (d *Dialect) Classify(err error) error { return Classify(err) }

// Classify classifies an error of the caller's own statements on a *sql.DB
// or *sql.Tx of this driver, such as tx.Commit() after [idem.Store.ClaimTx]
// (which [idem.Store.Classify] calls for you): a deadlock, lock wait timeout,
// serialization failure or Galera certification failure (1213, 1205, 1020)
// is wrapped to match [idem.ErrRetryable]; too many connections, a server
// shutting down, a Galera node not ready or outside the primary component
// (1047), a commit Galera could not replicate (1180), a read-only server
// (1290) and a lost connection (driver.ErrBadConn, mysql.ErrInvalidConn,
// sql.ErrConnDone, a network error) to match [idem.ErrStoreUnavailable].
// Every other error, and one that already matches either, is returned
// unchanged, so an application's own errors pass through untouched. The
// driver's error stays reachable with errors.Is and errors.As.
func Classify(err error) error {
	if err == nil || errors.Is(err, idem.ErrRetryable) || errors.Is(err, idem.ErrStoreUnavailable) {
		return err
	}
	var myErr *gomysql.MySQLError
	if errors.As(err, &myErr) {
		if class := serverErrorClass(myErr.Number); class != nil {
			return fmt.Errorf("%w: %w", class, err)
		}
		return err
	}
	var netErr *net.OpError
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, gomysql.ErrInvalidConn) ||
		errors.Is(err, sql.ErrConnDone) || errors.As(err, &netErr) {
		return fmt.Errorf("%w: %w", idem.ErrStoreUnavailable, err)
	}
	return err
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

// isPrepareRefused reports whether err, from a prepare, is the server's
// refusal to prepare the statement (it cannot, or holds as many prepared
// statements as max_prepared_stmt_count allows): the session and its
// transaction are as they were, and the text may be sent instead. Any
// other error is the statement's own.
func isPrepareRefused(err error) bool {
	var myErr *gomysql.MySQLError
	return errors.As(err, &myErr) && (myErr.Number == erUnsupportedPS || myErr.Number == erMaxPreparedStmts)
}

// isLockWaitTimeout reports whether err is the server's lock wait timeout.
func isLockWaitTimeout(err error) bool {
	var myErr *gomysql.MySQLError
	return errors.As(err, &myErr) && myErr.Number == erLockWaitTimeout
}

// ErrorCode returns the number of the server error in err's chain, or ""
// if there is none. The Store logs it in place of the error's text, which
// can quote values ("Duplicate entry '…' for key …").
func (d *Dialect) ErrorCode(err error) string {
	var myErr *gomysql.MySQLError
	if errors.As(err, &myErr) {
		return strconv.Itoa(int(myErr.Number))
	}
	return ""
}
