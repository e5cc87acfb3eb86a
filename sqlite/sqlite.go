package sqlite

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/codec"
)

// dbtx is what the executor needs from a handle: satisfied by the pool, a
// transaction and a single connection alike.
type dbtx interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

var (
	_ dbtx = (*sql.DB)(nil)
	_ dbtx = (*sql.Tx)(nil)
	_ dbtx = (*sql.Conn)(nil)
)

var _ idem.Dialect[*sql.Tx] = (*Dialect)(nil)

// errNilTx is returned for a nil *sql.Tx instead of a nil-pointer panic.
var errNilTx = errors.New("idem: sqlite: nil *sql.Tx")

// Dialect runs idem's statements on a SQLite database through database/sql
// and modernc.org/sqlite. Create it with [New]. It is safe for concurrent use.
type Dialect struct {
	db   *sql.DB
	pool *executor
}

// New returns a Dialect over db, which must not be nil. Open db with [Open],
// or with a DSN carrying the same settings (see the package documentation):
// WAL, a busy timeout, and _txlock=immediate so that every transaction takes
// the write lock at BEGIN. The schema must be migrated ([Migrate]).
//
// New performs no I/O, and the Dialect never closes db.
func New(db *sql.DB) *Dialect {
	return &Dialect{db: db, pool: &executor{h: db, pool: db}}
}

// Name returns "sqlite".
func (d *Dialect) Name() string { return "sqlite" }

// DB returns an Executor that runs each statement on the pool, in autocommit
// mode, except Claim, which runs in a BEGIN IMMEDIATE transaction of its own
// whose wait for the write lock is bounded by ClaimParams.WaitTimeout.
func (d *Dialect) DB() idem.Executor { return d.pool }

// Tx returns an Executor that runs inside tx. It never commits or rolls back
// tx. tx should have begun with BEGIN IMMEDIATE (through a DB opened by
// [Open]); then it holds the database's write lock and Claim never waits.
func (d *Dialect) Tx(tx *sql.Tx) idem.Executor {
	if tx == nil {
		return failedExecutor{err: errNilTx}
	}
	return &executor{h: tx}
}

// Begin starts a transaction on the pool. With a DB opened by [Open] it is
// BEGIN IMMEDIATE: it waits for the database's write lock, up to the DSN's
// busy timeout, and fails with [idem.ErrStoreUnavailable] past it.
func (d *Dialect) Begin(ctx context.Context) (*sql.Tx, error) {
	tx, err := d.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, interpretError(err)
	}
	return tx, nil
}

// Commit commits tx. database/sql watches the context given to BeginTx, not
// ctx, for a commit.
func (d *Dialect) Commit(_ context.Context, tx *sql.Tx) error {
	if tx == nil {
		return errNilTx
	}
	return interpretError(tx.Commit())
}

// Rollback rolls tx back; a transaction that has already finished is not an
// error.
func (d *Dialect) Rollback(_ context.Context, tx *sql.Tx) error {
	if tx == nil {
		return errNilTx
	}
	if err := tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
		return interpretError(err)
	}
	return nil
}

// executor implements idem.Executor over one handle. pool is set for the
// pool executor only: its Claim takes a connection of its own.
type executor struct {
	h    dbtx
	pool *sql.DB
}

// Claim implements idem.Executor.
func (e *executor) Claim(ctx context.Context, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	if e.pool != nil {
		return e.claimOnConn(ctx, p)
	}
	// A caller's transaction from a DB opened by Open holds the write lock
	// since its BEGIN IMMEDIATE: no other writer can hold the key
	// uncommitted, and nothing can change between the two statements.
	return claim(ctx, e.h, p)
}

// claimOnConn runs the claim in a BEGIN IMMEDIATE transaction on a
// connection of its own, with the connection's busy timeout set to
// p.WaitTimeout while it waits for the write lock, then restored.
//
// A connection whose state is unknown (a statement interrupted by ctx, a
// failed ROLLBACK or restore) is discarded rather than returned to the pool,
// where it could hold the write lock or the wrong busy timeout forever.
func (e *executor) claimOnConn(ctx context.Context, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	conn, err := e.pool.Conn(ctx)
	if err != nil {
		return nil, interpretError(err)
	}
	// Cleanup runs even when ctx is done.
	cleanupCtx := context.WithoutCancel(ctx)
	clean := false
	defer func() {
		if !clean {
			// Raw returning driver.ErrBadConn makes database/sql close the
			// connection instead of pooling it; closing rolls back any
			// transaction open on it.
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		}
		_ = conn.Close()
	}()

	var prev int
	if err := conn.QueryRowContext(ctx, busyTimeoutGet).Scan(&prev); err != nil {
		return nil, interpretError(err)
	}
	wait := busyMillis(p.WaitTimeout)
	if wait != prev {
		if err := setBusyTimeout(ctx, conn, wait); err != nil {
			return nil, interpretError(err)
		}
	}

	res, clean, err := claimInTx(ctx, conn, p)

	if wait != prev {
		if rerr := setBusyTimeout(cleanupCtx, conn, prev); rerr != nil {
			clean = false
		}
	}
	return res, err
}

// claimInTx runs claim between BEGIN IMMEDIATE and COMMIT on conn. clean
// reports whether conn is known to be outside any transaction afterwards.
func claimInTx(ctx context.Context, conn *sql.Conn, p *idem.ClaimParams) (_ *idem.ClaimResult, clean bool, _ error) {
	cleanupCtx := context.WithoutCancel(ctx)
	if _, err := conn.ExecContext(ctx, beginImmediate); err != nil {
		// A BEGIN that SQLite refused (SQLITE_BUSY past the timeout) left
		// no transaction. Any other failure, such as ctx ending while the
		// BEGIN ran, may have left one open.
		return nil, isSQLiteError(err), interpretError(err)
	}
	res, err := claim(ctx, conn, p)
	if err != nil {
		_, rerr := conn.ExecContext(cleanupCtx, rollbackTx)
		return nil, rerr == nil, err
	}
	// COMMIT runs even when ctx ended meanwhile, so that the claim either
	// commits or the error says why, never "maybe". In WAL mode it takes no
	// further lock; otherwise its wait is bounded by the busy timeout.
	if _, err := conn.ExecContext(cleanupCtx, commitTx); err != nil {
		_, rerr := conn.ExecContext(cleanupCtx, rollbackTx)
		return nil, rerr == nil, interpretError(err)
	}
	return res, true, nil
}

// setBusyTimeout sets the connection's busy timeout. PRAGMA takes no bind
// parameters; ms is an int formatted here, so no outside text reaches SQL.
func setBusyTimeout(ctx context.Context, conn *sql.Conn, ms int) error {
	_, err := conn.ExecContext(ctx, busyTimeoutSet+strconv.Itoa(ms))
	return err
}

// busyMillis converts a wait to the busy timeout's whole milliseconds,
// rounding up so that a positive wait never becomes "do not wait".
func busyMillis(d time.Duration) int {
	if d <= 0 {
		return 0
	}
	ms := (d + time.Millisecond - 1) / time.Millisecond
	return int(min(ms, math.MaxInt32))
}

// claim inserts the processing record unless one exists, then returns the
// record. h must hold the database's write lock, or take it with its first
// statement, so that both statements see the same state.
func claim(ctx context.Context, h dbtx, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	now := clock(p.Now)
	rec, err := scanRecord(h.QueryRowContext(ctx, claimInsert,
		p.Scope, p.Key, p.Fingerprint[:], p.Token,
		micros(now.Add(p.LeaseDuration)), micros(now), micros(now), micros(now.Add(p.Retention)),
	))
	if err == nil {
		return &idem.ClaimResult{Record: rec, Created: true, Now: now}, nil
	}
	if !errors.Is(err, idem.ErrNotFound) {
		return nil, err
	}
	// No row returned: a record exists. ErrNotFound from this read means it
	// vanished meanwhile, which the Store answers by claiming again.
	rec, err = scanRecord(h.QueryRowContext(ctx, claimSelect, p.Scope, p.Key))
	if err != nil {
		return nil, err
	}
	return &idem.ClaimResult{Record: rec, Created: false, Now: now}, nil
}

// Takeover implements idem.Executor.
func (e *executor) Takeover(ctx context.Context, p *idem.TakeoverParams) error {
	now := clock(p.Now)
	res, err := e.h.ExecContext(ctx, takeoverUpdate,
		p.NewToken, p.Fingerprint[:], p.Attempt, micros(now.Add(p.LeaseDuration)),
		micros(now), micros(now), micros(now.Add(p.Retention)),
		p.Scope, p.Key, p.Token,
	)
	return affectedOne(res, err)
}

// Get implements idem.Executor.
func (e *executor) Get(ctx context.Context, p *idem.GetParams) (*idem.Record, error) {
	now := clock(p.Now)
	return scanRecord(e.h.QueryRowContext(ctx, getSelect, p.Scope, p.Key, micros(now)))
}

// Complete implements idem.Executor.
func (e *executor) Complete(ctx context.Context, p *idem.CompleteParams) error {
	if p.Response == nil {
		return errors.New("idem: sqlite: complete needs a response")
	}
	headers, err := codec.EncodeHeader(p.Response.Header)
	if err != nil {
		return err
	}
	body := p.Response.Body
	if body == nil {
		// Stored as an empty BLOB, not NULL: a replay gets back exactly
		// the (empty) body.
		body = []byte{}
	}
	now := clock(p.Now)
	res, err := e.h.ExecContext(ctx, completeUpdate,
		int64(p.Status), p.Response.StatusCode, headers, body,
		micros(now), micros(now), micros(now.Add(p.Retention)),
		p.Scope, p.Key, p.Token,
	)
	return affectedOne(res, err)
}

// Release implements idem.Executor.
func (e *executor) Release(ctx context.Context, p *idem.ReleaseParams) error {
	res, err := e.h.ExecContext(ctx, releaseDelete, p.Scope, p.Key, p.Token)
	return affectedOne(res, err)
}

// affectedOne turns a fenced write (no row matched) into idem.ErrFenced.
func affectedOne(res sql.Result, err error) error {
	if err != nil {
		return interpretError(err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return interpretError(err)
	}
	if n == 0 {
		return idem.ErrFenced
	}
	return nil
}

// scanRecord scans one row of recordColumns. A missing row is
// idem.ErrNotFound; driver errors are classified by interpretError.
func scanRecord(row *sql.Row) (*idem.Record, error) {
	var (
		rec                                     idem.Record
		fingerprint, headers, body              []byte
		status                                  int64
		leaseExpires, created, updated, expires int64
		respStatus, completed                   sql.NullInt64
	)
	err := row.Scan(&rec.Scope, &rec.Key, &fingerprint, &status, &rec.Token, &rec.Attempt,
		&leaseExpires, &respStatus, &headers, &body, &created, &updated, &completed, &expires)
	if err != nil {
		return nil, interpretError(err)
	}
	if len(fingerprint) != len(rec.Fingerprint) {
		return nil, fmt.Errorf("idem: sqlite: stored fingerprint has %d bytes, want %d", len(fingerprint), len(rec.Fingerprint))
	}
	copy(rec.Fingerprint[:], fingerprint)
	rec.Status = idem.Status(status)
	rec.LeaseExpiresAt = fromMicros(leaseExpires)
	rec.CreatedAt = fromMicros(created)
	rec.UpdatedAt = fromMicros(updated)
	rec.ExpiresAt = fromMicros(expires)
	if completed.Valid {
		rec.CompletedAt = fromMicros(completed.Int64)
	}
	if rec.Status.Final() {
		h, err := codec.DecodeHeader(headers)
		if err != nil {
			return nil, err
		}
		if body == nil {
			body = []byte{} // the driver reads an empty BLOB as nil
		}
		rec.Response = &idem.Response{StatusCode: int(respStatus.Int64), Header: h, Body: body}
	}
	return &rec, nil
}

// clock returns the time a statement uses: the pinned time, or this
// process's clock, which is the database's clock for an in-process database.
// It is rounded down to the microseconds the schema stores, in UTC.
func clock(pinned *time.Time) time.Time {
	t := time.Now()
	if pinned != nil {
		t = *pinned
	}
	return fromMicros(t.UnixMicro())
}

func micros(t time.Time) int64 { return t.UnixMicro() }

func fromMicros(us int64) time.Time { return time.UnixMicro(us).UTC() }

// failedExecutor answers every call with err.
type failedExecutor struct{ err error }

func (f failedExecutor) Claim(context.Context, *idem.ClaimParams) (*idem.ClaimResult, error) {
	return nil, f.err
}

func (f failedExecutor) Takeover(context.Context, *idem.TakeoverParams) error { return f.err }

func (f failedExecutor) Get(context.Context, *idem.GetParams) (*idem.Record, error) {
	return nil, f.err
}

func (f failedExecutor) Complete(context.Context, *idem.CompleteParams) error { return f.err }

func (f failedExecutor) Release(context.Context, *idem.ReleaseParams) error { return f.err }
