package postgres

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemstore/idem"
)

// SQLSTATE codes interpretError and the claim branch on.
const (
	codeSerializationFailure = "40001"
	codeDeadlockDetected     = "40P01"
	codeLockNotAvailable     = "55P03"
	codeDivisionByZero       = "22012"
	codeUniqueViolation      = "23505"
	codeQueryCanceled        = "57014"
	codeTooManyConnections   = "53300"
	codeAdminShutdown        = "57P01"
	codeCrashShutdown        = "57P02"
	codeCannotConnectNow     = "57P03"
	codeReadOnlyTransaction  = "25006"
	// A prepared statement missing on, or already on, the server
	// connection: pgx's statement cache behind a transaction pooler.
	codeInvalidStatementName       = "26000"
	codeDuplicatePreparedStatement = "42P05"
	codeProtocolViolation          = "08P01"
	classConnection                = "08"
)

// statementCacheAdvice is the fix for codeInvalidStatementName and
// codeDuplicatePreparedStatement, which idem's own statements meet only when
// the statements pgx prepared on one server connection are looked for on
// another: a transaction pooler in front of the server.
const statementCacheAdvice = "idem: postgres: a prepared statement was missing from, or already on, " +
	"the server connection: a transaction pooler (PgBouncer pool_mode=transaction) is between pgx and " +
	"PostgreSQL and pgx's statement cache is on; set ConnConfig.DefaultQueryExecMode to " +
	"pgx.QueryExecModeExec or pgx.QueryExecModeSimpleProtocol (default_query_exec_mode=exec in the " +
	"connection string), or enable max_prepared_statements on PgBouncer 1.21 or later"

// pgbouncerStartupParameter begins PgBouncer's refusal of a connection that
// sets a startup parameter it does not track (search_path, options,
// default_transaction_isolation, ...), SQLSTATE 08P01: every connection
// fails the same way, so it is configuration, not an outage. PgBouncer's
// messages are not translated.
const pgbouncerStartupParameter = "unsupported startup parameter"

// startupParameterAdvice is the fix for pgbouncerStartupParameter.
const startupParameterAdvice = "idem: postgres: PgBouncer refuses a startup parameter of the connection " +
	"(such as search_path in RuntimeParams or the URL): name idem's schema with postgres.WithSchema instead, " +
	"and drop the parameter, or list it in PgBouncer's ignore_startup_parameters if the server need not see it"

// interpretError classifies an error from a pgx call made with ctx. The
// driver's error stays reachable through %w wrapping (errors.As(err, &pgErr)
// works); nothing is added to the message that could carry a key, scope or
// body.
func interpretError(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return idem.ErrNotFound
	}
	// pgconn's default context watcher reports a canceled context as
	// context.Canceled itself, and a deadline as a timeout wrapping
	// context.DeadlineExceeded.
	if errors.Is(err, context.Canceled) {
		return fmt.Errorf("idem: postgres: %w", err)
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch class := serverErrorClass(pgErr); {
		case class != nil:
			return fmt.Errorf("%w: %w", class, err)
		case pgErr.Code == codeQueryCanceled && ctx.Err() != nil:
			// A context watcher that sends a cancel request
			// (pgconn.CancelRequestContextWatcherHandler) turns ctx's end
			// into the server's query_canceled, which carries no context
			// error: add it, so a cancellation stays one.
			if errors.Is(ctx.Err(), context.Canceled) {
				return fmt.Errorf("idem: postgres: %w: %w", ctx.Err(), err)
			}
			return fmt.Errorf("%w: %w: %w", idem.ErrStoreUnavailable, ctx.Err(), err)
		case pgErr.Code == codeInvalidStatementName, pgErr.Code == codeDuplicatePreparedStatement:
			return fmt.Errorf("%w: %s: %w", idem.ErrMisconfigured, statementCacheAdvice, err)
		case pgErr.Code == codeProtocolViolation && strings.HasPrefix(pgErr.Message, pgbouncerStartupParameter):
			return fmt.Errorf("%w: %s: %w", idem.ErrMisconfigured, startupParameterAdvice, err)
		case pgErr.Code == codeQueryCanceled: // statement_timeout or an administrator's cancel: no answer in time
			return fmt.Errorf("%w: %w", idem.ErrStoreUnavailable, err)
		default:
			return fmt.Errorf("idem: postgres: %w", err)
		}
	}
	// Misuse of a finished transaction is the caller's bug, not an outage.
	if errors.Is(err, pgx.ErrTxClosed) || errors.Is(err, pgx.ErrTxCommitRollback) {
		return fmt.Errorf("idem: postgres: %w", err)
	}
	// Everything else never reached a server that answered: connection
	// refused or lost, a closed pool, a deadline.
	return fmt.Errorf("%w: %w", idem.ErrStoreUnavailable, err)
}

// isPgCode reports whether err is a server error with SQLSTATE code.
func isPgCode(err error, code string) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == code
}

// serverErrorClass is the class of a server error whatever statement met
// it: ErrRetryable for a transaction conflict, ErrStoreUnavailable for a
// server that cannot serve now, nil otherwise. PgBouncer's refusal of a
// startup parameter (08P01) is a configuration error, not an outage.
func serverErrorClass(pgErr *pgconn.PgError) error {
	switch {
	case pgErr.Code == codeSerializationFailure, pgErr.Code == codeDeadlockDetected,
		pgErr.Code == codeLockNotAvailable:
		return idem.ErrRetryable
	case pgErr.Code == codeProtocolViolation && strings.HasPrefix(pgErr.Message, pgbouncerStartupParameter):
		return nil
	case pgErr.Code == codeTooManyConnections,
		pgErr.Code == codeAdminShutdown, pgErr.Code == codeCrashShutdown,
		pgErr.Code == codeCannotConnectNow,
		// A hot standby (a failover not finished, or a name that still
		// points at the old standby) or default_transaction_read_only:
		// the store cannot write here now.
		pgErr.Code == codeReadOnlyTransaction,
		len(pgErr.Code) == 5 && pgErr.Code[:2] == classConnection:
		return idem.ErrStoreUnavailable
	}
	return nil
}

// Classify implements [idem.ErrorClassifier] with [Classify].
func (d *Dialect) Classify(err error) error { return Classify(err) }

// Classify classifies an error of the caller's own statements on this
// dialect's pool or a pgx.Tx of it, such as a [idem.Store.Do] callback's
// statement or tx.Commit(ctx) after [idem.Store.ClaimTx] (which
// [idem.Store.Classify] calls for you): a serialization failure, deadlock or
// lock timeout (40001, 40P01, 55P03) is wrapped to match
// [idem.ErrRetryable]; too many connections (53300), a server shutting down
// or starting (57P01, 57P02, 57P03), a read-only server (25006), a
// connection exception (08xxx) and a connection lost or never made (a
// network error, an unexpected EOF, a closed connection) to match
// [idem.ErrStoreUnavailable]. Every other error, and one that already
// matches either, is returned unchanged, so an application's own errors
// pass through untouched. The driver's error stays reachable with
// errors.Is and errors.As.
func Classify(err error) error {
	if err == nil || errors.Is(err, idem.ErrRetryable) || errors.Is(err, idem.ErrStoreUnavailable) {
		return err
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		if class := serverErrorClass(pgErr); class != nil {
			return fmt.Errorf("%w: %w", class, err)
		}
		return err
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err // the caller's deadline, not the server's state
	}
	var (
		netErr     net.Error
		connectErr *pgconn.ConnectError
	)
	if errors.As(err, &connectErr) || errors.As(err, &netErr) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) ||
		pgconn.SafeToRetry(err) {
		return fmt.Errorf("%w: %w", idem.ErrStoreUnavailable, err)
	}
	return err
}

// ErrorCode returns the SQLSTATE of the server error in err's chain, or ""
// if there is none. The Store logs it in place of the error's text, which
// can quote values.
func (d *Dialect) ErrorCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}
