package idem

import (
	"errors"
	"fmt"
	"time"
)

// Sentinel errors. Every error a Store returns that a caller may branch on
// matches one of these with [errors.Is]; errors that carry data (such as
// [InProgressError]) also match their sentinel.
//
// No error message produced by idem contains a raw key, scope or body; where
// a record must be identified, messages carry a short digest instead.
var (
	// ErrNotFound means no live record exists for the scope and key.
	ErrNotFound = errors.New("idem: key not found")

	// ErrInProgress means another holder owns the key and has not finished.
	// It is always returned as an *InProgressError, which tells how long to wait.
	ErrInProgress = errors.New("idem: key is being processed")

	// ErrFingerprint means the key was used before with a different request.
	// The stored record is left exactly as it was.
	ErrFingerprint = errors.New("idem: key reused with a different request")

	// ErrFenced means the caller no longer owns the key: the record was
	// completed already, taken over by a newer holder (its fencing token
	// changed), released, or never claimed. Nothing was written; a caller
	// inside a transaction must roll it back.
	ErrFenced = errors.New("idem: key not owned by this claim (fenced)")

	// ErrInvalidKey means the idempotency key is empty, too long, not valid
	// UTF-8 or contains control characters. Nothing was written.
	ErrInvalidKey = errors.New("idem: invalid idempotency key")

	// ErrInvalidScope means the scope is empty, too long, not valid UTF-8 or
	// contains control characters. Nothing was written.
	ErrInvalidScope = errors.New("idem: invalid scope")

	// ErrStoreUnavailable means the database could not be reached or did not
	// answer in time (connection refused or lost, pool closed, deadline
	// exceeded, SQLite database locked past its busy timeout). The request
	// must be refused, never run unprotected. The driver's error stays
	// reachable through wrapping.
	ErrStoreUnavailable = errors.New("idem: store unavailable")

	// ErrRetryable means the database aborted the statement or the whole
	// transaction because of a concurrent one: a serialization failure
	// (PostgreSQL 40001 under REPEATABLE READ or SERIALIZABLE, MariaDB 1020
	// with innodb_snapshot_isolation), a deadlock (PostgreSQL 40P01, MySQL
	// 1213) or a lock wait timeout on anything but idem's own bounded waits
	// (PostgreSQL 55P03, MySQL 1205), or SQLite's SQLITE_BUSY_SNAPSHOT. Roll
	// back and run the whole transaction again; [Store.Do] does so by itself.
	ErrRetryable = errors.New("idem: transaction conflict, retry the transaction")

	// ErrMisconfigured means the store cannot work as it is set up, and
	// retrying will not help until the configuration changes: for example
	// pgx's statement cache behind a transaction pooler such as PgBouncer
	// (prepared statements lost between server connections), or an invalid
	// dialect option. The message says what to change. [Store.Do] does not
	// retry it; the request must be refused.
	ErrMisconfigured = errors.New("idem: store misconfigured")
)

// InProgressError reports a key that another holder owns: an uncommitted
// claim that did not finish within Config.WaitTimeout, a committed
// processing record whose lease has not expired, or one whose lease ran out
// and that the status check has not settled yet.
type InProgressError struct {
	// KeyDigest is a short digest of the scope and key, safe to log.
	KeyDigest string
	// RetryAfter is the time left on the holder's lease, or Config.WaitTimeout
	// when the holder's transaction has not committed. For a lease that ran
	// out and is not settled yet it is the pushed-out lease after an unknown
	// verdict, Config.LeaseDuration without a StatusCheck, or 1s for a claim
	// inside a caller's transaction (the check runs on the pool). Never
	// negative.
	RetryAfter time.Duration
	// TxAborted is true when the database aborted the caller's transaction
	// while waiting (PostgreSQL, where a lock timeout aborts the transaction;
	// MySQL with innodb_rollback_on_timeout=ON).
	// The caller must roll the transaction back. Never set by [Store.Do],
	// which rolls back its own transaction.
	TxAborted bool
	// Cause is the driver's error that ended the wait when the database
	// gave up waiting for another transaction's lock (a lock timeout), and
	// is reachable through errors.As. It is nil when idem itself found the
	// key held (a live lease, an unsettled stale one); it never holds an
	// error of idem's own.
	Cause error
}

// Error implements error.
func (e *InProgressError) Error() string {
	msg := fmt.Sprintf("idem: key %s is being processed, retry after %s", e.KeyDigest, e.RetryAfter.Round(time.Millisecond))
	if e.TxAborted {
		msg += " (the transaction was aborted and must be rolled back)"
	}
	return msg
}

// Is reports whether target is ErrInProgress.
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

// Unwrap returns Cause.
func (e *InProgressError) Unwrap() error { return e.Cause }
