package sqlite

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/codec"
	"github.com/idemstore/idem/internal/digest"
	"github.com/idemstore/idem/internal/failexec"
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
	// stmts are the statements of a claim and its completion inside a
	// transaction, prepared once by Begin and then used by every
	// transaction: modernc.org/sqlite parses an unprepared statement on
	// every call, and inside the write lock the parse is a large part of
	// what a claim costs.
	stmts *txStatements
}

// txStatements are prepared on the pool by Begin, before it takes a
// connection for the transaction (preparing from inside a transaction
// could wait forever for a one-connection pool's only connection).
// Transactions run them through Tx.StmtContext, which reuses a statement
// already prepared on the transaction's connection.
type txStatements struct {
	claimSelect, claimInsert, completeUpdate, completeInsert preparedStmt
	// preparing is set while prepareLater's goroutine runs.
	preparing atomic.Bool
}

func newTxStatements(db *sql.DB) *txStatements {
	return &txStatements{
		claimSelect:    preparedStmt{db: db, query: claimSelect},
		claimInsert:    preparedStmt{db: db, query: claimInsert},
		completeUpdate: preparedStmt{db: db, query: completeUpdate},
		completeInsert: preparedStmt{db: db, query: completeInsert},
	}
}

// all lists the statements.
func (ts *txStatements) all() []*preparedStmt {
	return []*preparedStmt{&ts.claimSelect, &ts.claimInsert, &ts.completeUpdate, &ts.completeInsert}
}

// prepare prepares the statements not prepared yet. A failure (no table
// before Migrate, a closed DB) leaves the statement unprepared: it runs
// unprepared, and the next Begin (or prepareLater) tries again.
func (ts *txStatements) prepare(ctx context.Context) {
	for _, p := range ts.all() {
		if p.st.Load() == nil {
			p.stmt(ctx)
		}
	}
}

// prepareLater prepares the statements not prepared yet in a goroutine of
// its own, one at a time, for a transaction the caller began with
// db.BeginTx (as README.md shows) rather than through Begin: preparing on
// the pool from the caller's goroutine could wait forever for a
// one-connection pool's only connection, which the transaction holds. So
// that transaction runs them unprepared, and the goroutine waits for a free
// connection; it ends once the statements are prepared, a prepare failed,
// or db is closed.
func (ts *txStatements) prepareLater() {
	for _, p := range ts.all() {
		if p.st.Load() == nil {
			if ts.preparing.CompareAndSwap(false, true) {
				go func() {
					defer ts.preparing.Store(false)
					ts.prepare(context.Background())
				}()
			}
			return
		}
	}
}

// New returns a Dialect over db, which must not be nil. Open db with [Open],
// or with a DSN carrying the same settings (see the package documentation):
// WAL, a busy timeout, and _txlock=immediate so that every transaction takes
// the write lock at BEGIN. The schema must be migrated ([Migrate]).
//
// New performs no I/O, and the Dialect never closes db.
func New(db *sql.DB) *Dialect {
	return &Dialect{db: db, pool: &executor{h: db, pool: db, get: &preparedStmt{db: db, query: getSelect}, getCompleted: &preparedStmt{db: db, query: getCompletedSelect}}, stmts: newTxStatements(db)}
}

// Name returns "sqlite".
func (d *Dialect) Name() string { return "sqlite" }

// DB returns an Executor that runs each statement on the pool, in autocommit
// mode, except Claim, which runs in a BEGIN IMMEDIATE transaction of its own
// whose wait for the write lock is bounded by ClaimParams.WaitTimeout.
// Takeover and RenewLease bound their wait by their WaitTimeout too, and
// DeleteExpired shares the lock with claims as the package documentation
// describes.
func (d *Dialect) DB() idem.Executor { return d.pool }

// Tx returns an Executor that runs inside tx. It never commits or rolls back
// tx. tx should have begun with BEGIN IMMEDIATE (through a DB opened by
// [Open]); then it holds the database's write lock and Claim never waits.
// The claim and completion statements run prepared in tx once they are
// prepared on the pool: by [Dialect.Begin], or, for transactions begun
// otherwise, in the background from the first such call on.
func (d *Dialect) Tx(tx *sql.Tx) idem.Executor {
	if tx == nil {
		return failexec.Executor{Err: errNilTx}
	}
	d.stmts.prepareLater()
	return &executor{h: tx, tx: tx, stmts: d.stmts}
}

// Begin starts a transaction on the pool. With a DB opened by [Open] it is
// BEGIN IMMEDIATE: it waits for the database's write lock, up to the DSN's
// busy timeout, and fails with [idem.ErrStoreUnavailable] past it.
func (d *Dialect) Begin(ctx context.Context) (*sql.Tx, error) {
	d.stmts.prepare(ctx)
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
	// get is the pool's prepared Get, getCompleted its GetCompleted
	// (replay.go); nil in a transaction.
	get, getCompleted *preparedStmt
	// tx and stmts are set in a transaction: the statements Begin prepared.
	tx    *sql.Tx
	stmts *txStatements
}

// txExec runs ps's statement on the executor's handle: through the
// prepared statement when in a transaction and it is prepared, as text
// otherwise, and also when the transaction belongs to another *sql.DB than
// the Dialect's (which database/sql cannot run the Dialect's statements in).
func (e *executor) txExec(ctx context.Context, ps func(*txStatements) *preparedStmt, query string, args ...any) (sql.Result, error) {
	if e.tx != nil && e.stmts != nil {
		if st := ps(e.stmts).st.Load(); st != nil {
			res, err := e.tx.StmtContext(ctx, st).ExecContext(ctx, args...) //nolint:sqlclosecheck // closed when the transaction ends; the prepared statement it wraps stays on the DB
			if !isForeignStmt(err) {
				return res, err
			}
		}
	}
	return e.h.ExecContext(ctx, query, args...)
}

// txQueryRow is txExec for a query of one row.
func (e *executor) txQueryRow(ctx context.Context, ps func(*txStatements) *preparedStmt, query string, args ...any) *sql.Row {
	if e.tx != nil && e.stmts != nil {
		if st := ps(e.stmts).st.Load(); st != nil {
			row := e.tx.StmtContext(ctx, st).QueryRowContext(ctx, args...) //nolint:sqlclosecheck // closed when the transaction ends; the prepared statement it wraps stays on the DB
			if !isForeignStmt(row.Err()) {
				return row
			}
		}
	}
	return e.h.QueryRowContext(ctx, query, args...)
}

// isForeignStmt reports the error of Tx.StmtContext given a statement of
// another *sql.DB than the transaction's. database/sql makes it with
// errors.New and exports nothing to match, so its text is compared; it is
// returned before anything reaches the database, so running the statement
// as text afterwards is safe.
func isForeignStmt(err error) bool {
	return err != nil && err.Error() == "sql: Tx.Stmt: statement from different database used"
}

func stmtClaimSelect(ts *txStatements) *preparedStmt    { return &ts.claimSelect }
func stmtClaimInsert(ts *txStatements) *preparedStmt    { return &ts.claimInsert }
func stmtCompleteUpdate(ts *txStatements) *preparedStmt { return &ts.completeUpdate }
func stmtCompleteInsert(ts *txStatements) *preparedStmt { return &ts.completeInsert }

// Claim implements idem.Executor.
func (e *executor) Claim(ctx context.Context, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	if e.pool != nil {
		return e.claimOnConn(ctx, p)
	}
	// A caller's transaction from a DB opened by Open holds the write lock
	// since its BEGIN IMMEDIATE: no other writer can hold the key
	// uncommitted, and nothing can change between the two statements.
	return claim(ctx, e, p)
}

var _ idem.DeferredClaimer[*sql.Tx] = (*Dialect)(nil)

// ClaimDeferred implements [idem.DeferredClaimer]: tx's write lock, held
// since BEGIN IMMEDIATE, already keeps every other claimer of the key out
// until tx ends, so a free key needs no write now; the completion inserts
// the finished record ([Dialect.CompleteDeferred]). Under the single write
// lock that saves a whole statement's work (an insert then an update of the
// same row become one insert), which is what a SQLite transaction's
// throughput is made of. The read sees the latest commit: an IMMEDIATE
// transaction's snapshot is taken with the write lock. tx must have begun
// with BEGIN IMMEDIATE (see [Dialect.Tx]).
func (d *Dialect) ClaimDeferred(ctx context.Context, tx *sql.Tx, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	if tx == nil {
		return nil, errNilTx
	}
	d.stmts.prepareLater()
	return claimDeferred(ctx, &executor{h: tx, tx: tx, stmts: d.stmts}, p)
}

// claimDeferred is ClaimDeferred on e, an executor in the transaction.
func claimDeferred(ctx context.Context, e *executor, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	now := clock(p.Now)
	rec, err := scanRecord(e.txQueryRow(ctx, stmtClaimSelect, claimSelect, p.Scope, p.Key))
	if err == nil {
		return &idem.ClaimResult{Record: rec, Created: false, Now: now}, nil
	}
	if !errors.Is(err, idem.ErrNotFound) {
		return nil, err
	}
	rec = &idem.Record{
		Scope: p.Scope, Key: p.Key, Fingerprint: p.Fingerprint,
		Status: idem.StatusProcessing, Token: p.Token, Attempt: 1,
		LeaseExpiresAt: fromMicros(micros(now.Add(p.LeaseDuration))), CreatedAt: now, UpdatedAt: now,
		ExpiresAt: fromMicros(micros(now.Add(p.Retention))),
	}
	return &idem.ClaimResult{Record: rec, Created: true, Now: now}, nil
}

// claimOnConn runs the claim in a BEGIN IMMEDIATE transaction on a
// connection of its own (onConn), with the connection's busy timeout set to
// p.WaitTimeout while it waits for the write lock, then restored.
func (e *executor) claimOnConn(ctx context.Context, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	var res *idem.ClaimResult
	err := e.onConn(ctx, func(int) int { return busyMillis(p.WaitTimeout) }, func(conn *sql.Conn, _ int) (clean bool, err error) {
		res, clean, err = claimInTx(ctx, conn, p)
		return clean, err
	})
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
	res, err := claim(ctx, &executor{h: conn}, p)
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
func claim(ctx context.Context, e *executor, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	now := clock(p.Now)
	lease, expires := fromMicros(micros(now.Add(p.LeaseDuration))), fromMicros(micros(now.Add(p.Retention)))
	res, err := e.txExec(ctx, stmtClaimInsert, claimInsert,
		p.Scope, p.Key, p.Fingerprint[:], p.Token,
		micros(lease), micros(now), micros(now), micros(expires), keyDigest(p.Scope, p.Key),
	)
	if err != nil {
		return nil, interpretError(err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return nil, interpretError(err)
	}
	if n == 1 {
		// Exactly what the statement stored: the same microsecond values.
		rec := &idem.Record{
			Scope: p.Scope, Key: p.Key, Fingerprint: p.Fingerprint,
			Status: idem.StatusProcessing, Token: p.Token, Attempt: 1,
			LeaseExpiresAt: lease, CreatedAt: now, UpdatedAt: now, ExpiresAt: expires,
		}
		return &idem.ClaimResult{Record: rec, Created: true, Now: now}, nil
	}
	// A record exists. ErrNotFound from this read means it vanished
	// meanwhile, which the Store answers by claiming again.
	rec, err := scanRecord(e.txQueryRow(ctx, stmtClaimSelect, claimSelect, p.Scope, p.Key))
	if err != nil {
		return nil, err
	}
	return &idem.ClaimResult{Record: rec, Created: false, Now: now}, nil
}

// Takeover implements idem.Executor. An unknown p.Condition fails before
// any statement runs. On the pool, the wait for the write lock is bounded by
// p.WaitTimeout, as in Claim.
func (e *executor) Takeover(ctx context.Context, p *idem.TakeoverParams) error {
	now := clock(p.Now)
	args := []any{
		p.NewToken, p.Fingerprint[:], p.Attempt, micros(now.Add(p.LeaseDuration)),
		micros(now), micros(now), micros(now.Add(p.Retention)),
		p.Scope, p.Key, p.Token,
	}
	var query string
	switch p.Condition {
	case idem.TakeoverRetentionExpired:
		query, args = takeoverIfRetentionExpired, append(args, micros(now))
	case idem.TakeoverLeaseExpired:
		query, args = takeoverIfLeaseExpired, append(args, micros(now))
	case idem.TakeoverReserved:
		query = takeoverUpdate
	default:
		return fmt.Errorf("idem: sqlite: unknown takeover condition %d", p.Condition)
	}
	res, err := e.execWait(ctx, p.WaitTimeout, query, args...)
	return affectedOne(res, err)
}

// Get implements idem.Executor. On the pool it runs a prepared statement:
// it is the replay path of every pool-level claim, and modernc.org/sqlite
// parses an unprepared statement anew on every call, which costs more than
// reading the row.
func (e *executor) Get(ctx context.Context, p *idem.GetParams) (*idem.Record, error) {
	now := clock(p.Now)
	if e.get != nil {
		if st := e.get.stmt(ctx); st != nil { //nolint:sqlclosecheck // cached for the life of the *sql.DB, which closes it
			return scanRecord(st.QueryRowContext(ctx, p.Scope, p.Key, micros(now)))
		}
	}
	return scanRecord(e.h.QueryRowContext(ctx, getSelect, p.Scope, p.Key, micros(now)))
}

// preparedStmt is one statement prepared on the pool when first used.
// database/sql keeps it prepared on each connection it runs on.
type preparedStmt struct {
	db    *sql.DB
	query string
	mu    sync.Mutex
	st    atomic.Pointer[sql.Stmt]
}

// stmt returns the prepared statement, preparing it on first use; nil if
// that failed (the caller then runs the query unprepared, and the next call
// tries again).
func (p *preparedStmt) stmt(ctx context.Context) *sql.Stmt {
	if st := p.st.Load(); st != nil {
		return st
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if st := p.st.Load(); st != nil {
		return st
	}
	st, err := p.db.PrepareContext(ctx, p.query) //nolint:sqlclosecheck // kept for the life of the *sql.DB, which closes it
	if err != nil {
		return nil
	}
	p.st.Store(st)
	return st
}

// Complete implements idem.Executor.
func (e *executor) Complete(ctx context.Context, p *idem.CompleteParams) error {
	headers, body, err := responseArgs(p.Response)
	if err != nil {
		return err
	}
	now := clock(p.Now)
	nowArg := any(micros(now)) // boxed once for its two uses
	res, err := e.txExec(ctx, stmtCompleteUpdate, completeUpdate,
		int64(p.Status), p.Response.StatusCode, headers, body,
		nowArg, nowArg, micros(now.Add(p.Retention)),
		p.Scope, p.Key, p.Token,
	)
	return affectedOne(res, err)
}

// CompleteDeferred implements [idem.DeferredClaimer]: it inserts the
// finished record (completeInsert). A record that exists regardless makes
// the insert do nothing (ON CONFLICT DO NOTHING), reported as
// [idem.ErrFenced].
func (d *Dialect) CompleteDeferred(ctx context.Context, tx *sql.Tx, p *idem.CompleteDeferredParams) error {
	if tx == nil {
		return errNilTx
	}
	headers, body, err := responseArgs(p.Response)
	if err != nil {
		return err
	}
	e := &executor{h: tx, tx: tx, stmts: d.stmts}
	now := clock(p.Now)
	nowArg := any(micros(now)) // boxed once for its two uses
	res, err := e.txExec(ctx, stmtCompleteInsert, completeInsert,
		p.Scope, p.Key, p.Fingerprint[:], int64(p.Status), p.Token, micros(p.LeaseExpiresAt),
		p.Response.StatusCode, headers, body,
		micros(p.CreatedAt), nowArg, nowArg, micros(now.Add(p.Retention)), keyDigest(p.Scope, p.Key),
	)
	return affectedOne(res, err)
}

// responseArgs returns the stored forms of resp's headers and body.
func responseArgs(resp *idem.Response) (headers, body []byte, _ error) {
	if resp == nil {
		return nil, nil, errors.New("idem: sqlite: complete needs a response")
	}
	headers, err := codec.EncodeHeader(resp.Header)
	if err != nil {
		return nil, nil, err
	}
	body = resp.Body
	if body == nil {
		// Stored as an empty BLOB, not NULL: a replay gets back exactly
		// the (empty) body.
		body = []byte{}
	}
	return headers, body, nil
}

// Release implements idem.Executor.
func (e *executor) Release(ctx context.Context, p *idem.ReleaseParams) error {
	query, args := releaseDelete, []any{p.Scope, p.Key, p.Token}
	if p.OnlyIfLeaseExpired {
		query, args = releaseIfLeaseExpired, append(args, micros(clock(p.Now)))
	}
	res, err := e.h.ExecContext(ctx, query, args...)
	return affectedOne(res, err)
}

// RenewLease implements idem.Executor. The returned expiry is the value
// stored: both come from the same microsecond-truncated now. On the pool,
// the wait for the write lock is bounded by p.WaitTimeout, as in Claim.
func (e *executor) RenewLease(ctx context.Context, p *idem.RenewLeaseParams) (time.Time, error) {
	now := clock(p.Now)
	lease := fromMicros(micros(now.Add(p.Duration)))
	query, args := renewLeaseUpdate, []any{
		p.NewToken, micros(lease), micros(lease), micros(now),
		p.Scope, p.Key, p.Token,
	}
	if p.OnlyIfExpired {
		query, args = renewExpiredLeaseUpdate, append(args, micros(now))
	}
	res, err := e.execWait(ctx, p.WaitTimeout, query, args...)
	if err := affectedOne(res, err); err != nil {
		return time.Time{}, err
	}
	return lease, nil
}

// ListStaleLeases implements idem.Executor. In WAL mode the read never
// waits for a writer.
func (e *executor) ListStaleLeases(ctx context.Context, p *idem.ListStaleLeasesParams) ([]*idem.Record, time.Time, error) {
	if err := checkLimit(p.Limit); err != nil {
		return nil, time.Time{}, err
	}
	now := clock(p.Now)
	rows, err := e.h.QueryContext(ctx, staleLeasesSelect, micros(now), micros(now), p.Limit)
	if err != nil {
		return nil, time.Time{}, interpretError(err)
	}
	defer func() { _ = rows.Close() }()
	var recs []*idem.Record
	for rows.Next() {
		rec, err := scanRecord(rows)
		if err != nil {
			return nil, time.Time{}, err
		}
		recs = append(recs, rec)
	}
	if err := rows.Err(); err != nil {
		return nil, time.Time{}, interpretError(err)
	}
	return recs, now, nil
}

// The pool's DeleteExpired shares SQLite's single write lock with claims.
// SQLite's lock has no queue: a writer waiting for it polls, with sleeps
// growing to 100ms. Left to that, the reaper and the claimers starve each
// other: a reaper that starts its next batch as soon as one commits takes
// the lock again before sleeping claimers wake, and under a steady stream of
// claims the reaper, sleeping 100ms between tries, rarely finds the lock
// free. So the pool's DeleteExpired polls for the lock itself, every
// reapPoll, within the connection's busy timeout; and after a full batch it
// leaves the lock free for as long as the batch held it, up to maxReapYield,
// so that it holds the lock at most about half the time.
const (
	// reapPoll is how often DeleteExpired tries the write lock while
	// another writer holds it.
	reapPoll = time.Millisecond
	// maxReapYield bounds the pause after a full batch. It is the busy
	// handler's longest sleep: every waiting claimer polls within a free
	// window this long.
	maxReapYield = 100 * time.Millisecond
)

// DeleteExpired implements idem.Executor. On the pool the statement is its
// own (autocommit) transaction, which waits for the write lock up to the
// connection's busy timeout, like any write, and holds it only while it
// deletes at most p.Limit rows. See reapPoll for how it waits, and why it
// pauses after a full batch (n == p.Limit: the caller is likely to delete
// again at once) before it returns; the pause ends early, with the count,
// when ctx ends. Inside a caller's transaction, which holds the lock
// already, it runs the statement and nothing else.
func (e *executor) DeleteExpired(ctx context.Context, p *idem.DeleteExpiredParams) (int, error) {
	if err := checkLimit(p.Limit); err != nil {
		return 0, err
	}
	now := clock(p.Now)
	if e.pool == nil {
		n, _, err := deleteExpired(ctx, e.h, now, p.Limit)
		return n, err
	}
	n, held, err := e.deleteExpiredOnConn(ctx, now, p.Limit)
	if err == nil && p.Limit > 0 && n == p.Limit {
		sleepCtx(ctx, min(held, maxReapYield))
	}
	return n, err
}

// deleteExpiredOnConn runs the delete on a connection whose busy timeout
// is zero meanwhile, so that SQLite fails at once instead of sleeping, and
// retries every reapPoll until the connection's own busy timeout has passed.
// It returns how long the statement that ran took.
func (e *executor) deleteExpiredOnConn(ctx context.Context, now time.Time, limit int) (n int, held time.Duration, err error) {
	err = e.onConn(ctx, func(int) int { return 0 }, func(conn *sql.Conn, prev int) (bool, error) {
		deadline := time.Now().Add(time.Duration(prev) * time.Millisecond)
		for {
			var err error
			n, held, err = deleteExpired(ctx, conn, now, limit)
			if !isBusy(err) || !time.Now().Add(reapPoll).Before(deadline) {
				return autocommitted(err), err
			}
			if !sleepCtx(ctx, reapPoll) {
				return autocommitted(ctx.Err()), interpretError(ctx.Err())
			}
		}
	})
	return n, held, err
}

// execWait runs one statement on e's handle. On the pool it runs on a
// connection whose busy timeout is wait (rounded up to a millisecond)
// meanwhile, so that its wait for the write lock is bounded like Claim's. The
// error is returned as the driver gave it.
func (e *executor) execWait(ctx context.Context, wait time.Duration, query string, args ...any) (sql.Result, error) {
	if e.pool == nil {
		// A caller's transaction holds the write lock already.
		return e.h.ExecContext(ctx, query, args...)
	}
	var res sql.Result
	err := e.onConn(ctx, func(int) int { return busyMillis(wait) }, func(conn *sql.Conn, _ int) (bool, error) {
		var err error
		res, err = conn.ExecContext(ctx, query, args...)
		return autocommitted(err), err
	})
	return res, err
}

// onConn runs fn on a connection of its own whose busy timeout is
// busy(prev) while fn runs, prev being the connection's own, then restored.
// fn reports whether it left conn clean: outside any transaction, as
// autocommit statements that succeed or that SQLite refuses leave it
// (autocommitted). A connection whose state is unknown (a statement
// interrupted by ctx, a failed ROLLBACK or restore) is discarded rather than
// returned to the pool, where it could hold the write lock or the wrong busy
// timeout forever. fn's error is returned unchanged; onConn's own are
// classified by interpretError.
func (e *executor) onConn(ctx context.Context, busy func(prev int) int, fn func(conn *sql.Conn, prev int) (clean bool, err error)) error {
	conn, err := e.pool.Conn(ctx)
	if err != nil {
		return interpretError(err)
	}
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
		return interpretError(err)
	}
	ms := busy(prev)
	if ms != prev {
		if err := setBusyTimeout(ctx, conn, ms); err != nil {
			return interpretError(err)
		}
	}
	clean, err = fn(conn, prev)
	if ms != prev {
		if rerr := setBusyTimeout(context.WithoutCancel(ctx), conn, prev); rerr != nil {
			clean = false
		}
	}
	return err
}

// autocommitted reports whether an autocommit statement that ended with err
// left its connection outside any transaction: it succeeded, or SQLite
// refused it.
func autocommitted(err error) bool { return err == nil || isSQLiteError(err) }

// deleteExpired runs expiredDelete on h and returns the count and how long
// the statement took.
func deleteExpired(ctx context.Context, h dbtx, now time.Time, limit int) (int, time.Duration, error) {
	start := time.Now()
	res, err := h.ExecContext(ctx, expiredDelete, micros(now), limit)
	if err != nil {
		return 0, 0, interpretError(err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, 0, interpretError(err)
	}
	return int(n), time.Since(start), nil
}

// sleepCtx sleeps for d and reports true, or reports false as soon as ctx
// ends.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// checkLimit rejects a limit below 1, as the other dialects do: SQLite
// would read a negative one as "no limit", and a reaper bug must not turn
// into one unbounded delete holding the write lock.
func checkLimit(limit int) error {
	if limit < 1 {
		return fmt.Errorf("idem: sqlite: limit %d must be at least 1", limit)
	}
	return nil
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

// rowScanner is a *sql.Row or a *sql.Rows positioned on a row.
type rowScanner interface {
	Scan(dest ...any) error
}

// scanRecord scans one row of recordColumns. A missing row (*sql.Row only)
// is idem.ErrNotFound; driver errors are classified by interpretError.
func scanRecord(row rowScanner) (*idem.Record, error) {
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
		return nil, &idem.CorruptRecordError{Reason: fmt.Sprintf("its fingerprint has %d bytes, want %d", len(fingerprint), len(rec.Fingerprint))}
	}
	copy(rec.Fingerprint[:], fingerprint)
	rec.Status = idem.Status(status) //nolint:gosec // the schema's CHECK (status IN (1, 2, 3)) keeps it in range
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
			// The decoder's message may quote stored bytes: kept as the cause only.
			return nil, &idem.CorruptRecordError{Reason: "its response headers do not decode", Cause: err}
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

// keyDigest is the key_digest column's value (see claimInsert).
func keyDigest(scope, key string) []byte {
	d := digest.Sum(scope, key)
	return d[:]
}
