package mysql

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/codec"
	"github.com/idemstore/idem/internal/failexec"
)

// Dialect runs idem's statements on MySQL or MariaDB through database/sql and
// github.com/go-sql-driver/mysql. Create it with [New]; it is safe for
// concurrent use.
type Dialect struct {
	db   *sql.DB
	pool *executor
	// piped is true when db was opened with NewConnector: Do's
	// transactions then begin with their claim and commit with their
	// completion, on MariaDB. Read by the first BeginClaim (New does not
	// touch db: a zero sql.DB has no driver to ask).
	pipedOnce sync.Once
	piped     bool
	// server is nil until the first statement that bounds its lock wait
	// has read it; see serverInfo.
	server atomic.Pointer[serverInfo]
	// prefix and claimSQL cache the statement texts built for the last
	// lock wait bound used, so that a claim builds no string; Config's
	// WaitTimeout is usually one value per Dialect.
	prefix   atomic.Pointer[waitPrefix]
	claimSQL atomic.Pointer[claimStatements]
	// insertCommitSQL caches, likewise, the optimistic Do's last
	// completeInsertCommit text.
	insertCommitSQL atomic.Pointer[insertCommitText]
	// optimistic is set by WithOptimisticDo.
	optimistic bool
	// replay is what the Dialects over db share about the replay read
	// (its prepared statement, the last refusal to prepare it), once this
	// Dialect has joined it. See sharedReplay.
	replay atomic.Pointer[sharedReplay]
}

// waitPrefix is the SET STATEMENT prefix for secs seconds.
type waitPrefix struct {
	secs int
	text string
}

// claimStatements are the claim's statements with one prefix prepended.
type claimStatements struct {
	prefix, insert, insertReturning, sel string
	// beginInsert is START TRANSACTION and insert in one compound
	// statement, for a transaction of BeginClaim.
	beginInsert string
}

// claimStatementsFor returns the claim's statements prefixed by prefix.
func (d *Dialect) claimStatementsFor(prefix string) *claimStatements {
	if c := d.claimSQL.Load(); c != nil && c.prefix == prefix {
		return c
	}
	c := &claimStatements{
		prefix:          prefix,
		insert:          prefix + claimInsert,
		insertReturning: prefix + claimInsertReturning,
		sel:             prefix + claimSelect,

		beginInsert: beginWith(prefix + claimInsert),
	}
	d.claimSQL.Store(c)
	return c
}

// waitPrefixFor returns MariaDB's SET STATEMENT prefix bounding a lock wait
// to secs seconds. SET STATEMENT takes no bind parameters: secs is an int
// formatted here, never outside text.
func (d *Dialect) waitPrefixFor(secs int) string {
	if p := d.prefix.Load(); p != nil && p.secs == secs {
		return p.text
	}
	p := &waitPrefix{secs: secs, text: "SET STATEMENT innodb_lock_wait_timeout=" + strconv.Itoa(secs) + " FOR "}
	d.prefix.Store(p)
	return p.text
}

// serverInfo is what a bounded lock wait must know about the server behind
// the pool.
type serverInfo struct {
	// mariaDB selects SET STATEMENT to bound a statement's lock wait; MySQL
	// lacks it and gets a session variable set and restored around it.
	mariaDB bool
	// rollbackOnTimeout mirrors innodb_rollback_on_timeout: when ON, a lock
	// wait timeout rolls back the whole transaction, not just the statement.
	rollbackOnTimeout bool
}

var _ idem.Dialect[*sql.Tx] = (*Dialect)(nil)

// errNilTx is returned for a nil *sql.Tx instead of a nil-pointer panic.
var errNilTx = errors.New("idem: mysql: nil *sql.Tx")

// New returns a Dialect over db, which must be opened with the
// github.com/go-sql-driver/mysql driver and a DSN with parseTime=true and
// the default loc (UTC); see the package documentation. New does not touch
// the database: the server's flavour is read by the first claim, takeover
// or lease renewal.
//
// A pool opened with [NewConnector] saves two round trips in every
// [idem.Store.Do] on MariaDB; any other pool of the driver works as well,
// with the round trips database/sql sends.
//
// Options: [WithOptimisticDo].
func New(db *sql.DB, opts ...Option) *Dialect {
	d := &Dialect{db: db}
	for _, o := range opts {
		o(d)
	}
	d.pool = &executor{d: d, h: db, db: db}
	return d
}

// Name returns "mysql", for MariaDB too.
func (d *Dialect) Name() string { return "mysql" }

// DB returns an Executor whose statements run on the pool in autocommit
// mode, except Claim, Takeover and RenewLease, which run in a short
// transaction of their own so that a cancelled wait commits nothing.
func (d *Dialect) DB() idem.Executor { return d.pool }

// Tx returns an Executor that runs inside tx. It never commits or rolls back
// tx. As with any *sql.Tx, it must not be used by two goroutines at once. For
// a nil tx, every method of the Executor fails.
func (d *Dialect) Tx(tx *sql.Tx) idem.Executor {
	if tx == nil {
		return failexec.Executor{Err: errNilTx}
	}
	return &executor{d: d, h: tx}
}

// Begin starts a transaction at the pool's default isolation level
// (REPEATABLE READ unless configured otherwise). The transaction is rolled
// back by database/sql if ctx is cancelled before Commit.
func (d *Dialect) Begin(ctx context.Context) (*sql.Tx, error) {
	tx, err := d.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, interpretError(err)
	}
	return tx, nil
}

// Commit commits tx; its error is classified like an Executor's.
func (d *Dialect) Commit(_ context.Context, tx *sql.Tx) error {
	if tx == nil {
		return errNilTx
	}
	return interpretError(tx.Commit())
}

// Rollback rolls tx back. A transaction that already ended is not an error.
func (d *Dialect) Rollback(_ context.Context, tx *sql.Tx) error {
	if tx == nil {
		return errNilTx
	}
	if err := tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
		return interpretError(err)
	}
	return nil
}

// serverInfo returns what a bounded lock wait needs to know about the
// server, reading it on h the first time. h is the executor's own handle, so
// a transaction never waits for a second pool connection. A failed read is
// not cached: the next call tries again. Concurrent first reads are harmless; they agree.
func (d *Dialect) serverInfo(ctx context.Context, h dbtx) (*serverInfo, error) {
	if s := d.server.Load(); s != nil {
		return s, nil
	}
	var (
		version  string
		rollback bool
		clock    dbTime // scanned only to check parseTime and loc
	)
	if err := h.QueryRowContext(ctx, detectServer).Scan(&version, &rollback, &clock); err != nil {
		return nil, interpretError(err)
	}
	d.server.CompareAndSwap(nil, &serverInfo{
		mariaDB:           strings.Contains(version, "MariaDB"),
		rollbackOnTimeout: rollback,
	})
	return d.server.Load(), nil
}

// dbtx is what the executor needs from a pool, a transaction or a pinned
// connection.
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

// executor implements idem.Executor on one handle.
type executor struct {
	d *Dialect
	h dbtx
	// db is set for the pool executor only. On MySQL, Claim takes one
	// connection from it so that its session setting and its statements
	// share a connection.
	db *sql.DB
}

var _ idem.Executor = (*executor)(nil)

// restoreTimeout bounds the statement that puts a connection's lock wait
// timeout back on MySQL. It runs even when the caller's context has ended,
// since the connection outlives the call, but must not hang on a dead one.
const restoreTimeout = 5 * time.Second

// boundWait runs fn, whose statements may wait for a row lock that another
// transaction holds, with that wait bounded by wait: InnoDB's
// innodb_lock_wait_timeout, in whole seconds rounded up. fn must run every
// statement on the handle it is given, with prefix prepended, and return
// driver errors unclassified; boundWait classifies them. A lock wait
// timeout (1205) becomes an *idem.InProgressError with RetryAfter wait and
// the driver's error as Cause.
//
// On MariaDB, prefix is SET STATEMENT innodb_lock_wait_timeout=N FOR, which
// applies to its statement alone and costs no extra round trip. SET
// STATEMENT takes no bind parameters, so N is formatted into the text: it is
// an int derived from a time.Duration in Config, never user input, and
// formats as digits only. MySQL lacks SET STATEMENT: there the session value
// is saved, set and restored around fn (see setLockWait).
//
// A context deadline is not used for the wait: when a context ends, the
// driver closes the connection, which would destroy a caller's transaction.
// Closing the connection does not stop the statement on the server either:
// it goes on waiting and, once the lock is granted, runs to its end. In a
// caller's transaction that is harmless, since the server rolls the
// transaction back when it sees the connection gone. On the pool, in
// autocommit mode, the statement would commit: a claim cancelled while it
// waited would leave a processing record that no one holds, or a takeover
// a token that no one knows. So on the pool fn runs in a transaction of its
// own, committed when fn succeeds: two more round trips (BEGIN, COMMIT).
//
// InnoDB rolls back only the statement that timed out, unless the server
// runs with innodb_rollback_on_timeout=ON, which rolls back the whole
// transaction: TxAborted reports that, in a caller's transaction.
func (e *executor) boundWait(ctx context.Context, wait time.Duration, fn func(h dbtx, prefix string) error) error {
	srv, err := e.d.serverInfo(ctx, e.h)
	if err != nil {
		return err
	}
	secs := lockWaitSeconds(wait)
	prefix := ""
	if srv.mariaDB {
		prefix = e.d.waitPrefixFor(secs)
	}
	switch {
	case e.db == nil && srv.mariaDB:
		err = fn(e.h, prefix)
	case e.db == nil:
		err = withSessionLockWait(ctx, e.h, nil, secs, fn)
	case srv.mariaDB:
		err = inTx(ctx, e.db.BeginTx, func(tx *sql.Tx) error { return fn(tx, prefix) })
	default:
		err = e.inConn(ctx, func(conn *sql.Conn) error {
			return withSessionLockWait(ctx, conn, conn, secs, func(dbtx, string) error {
				return inTx(ctx, conn.BeginTx, func(tx *sql.Tx) error { return fn(tx, "") })
			})
		})
	}
	if isLockWaitTimeout(err) {
		return &idem.InProgressError{
			RetryAfter: max(wait, 0),
			TxAborted:  e.db == nil && srv.rollbackOnTimeout,
			Cause:      err,
		}
	}
	return interpretError(err)
}

// inTx runs fn in a transaction from begin, committed if fn succeeds and
// rolled back otherwise. It returns driver errors unclassified.
func inTx(ctx context.Context, begin func(context.Context, *sql.TxOptions) (*sql.Tx, error), fn func(*sql.Tx) error) error {
	tx, err := begin(ctx, nil)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

// inConn runs fn on a connection taken from the pool.
func (e *executor) inConn(ctx context.Context, fn func(*sql.Conn) error) error {
	conn, err := e.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	return fn(conn)
}

// withSessionLockWait sets the session's innodb_lock_wait_timeout on h, runs
// fn on h, and puts the previous value back. h is a caller's transaction, or
// conn, a connection taken from the pool.
//
// The restore runs even if ctx is done, since the connection outlives the
// call, under its own restoreTimeout so that it cannot hang on a dead
// connection. If it fails, conn is discarded rather than returned to the
// pool with a shortened timeout. A transaction's connection cannot be
// discarded from here: the restore's error is returned (unless fn failed
// first), and the caller rolls back as after any error; when the restore
// timed out, the driver has closed that connection already.
func withSessionLockWait(ctx context.Context, h dbtx, conn *sql.Conn, secs int, fn func(h dbtx, prefix string) error) error {
	if _, err := h.ExecContext(ctx, setLockWait, secs); err != nil {
		return err
	}
	err := fn(h, "")
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), restoreTimeout)
	defer cancel()
	if _, rerr := h.ExecContext(rctx, restoreLockWait); rerr != nil {
		if conn != nil {
			// Make database/sql discard the connection. What fn did
			// stands or was rolled back already; either way it is over.
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		} else if err == nil {
			return rerr
		}
	}
	return err
}

// Claim implements idem.Executor, with its wait bounded as boundWait says.
func (e *executor) Claim(ctx context.Context, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	var res *idem.ClaimResult
	err := e.boundWait(ctx, p.WaitTimeout, func(h dbtx, prefix string) error {
		var err error
		res, err = claim(ctx, h, p, e.d.claimStatementsFor(prefix), e.d.server.Load().mariaDB)
		return err
	})
	if err != nil {
		return nil, err
	}
	return res, nil
}

// claim runs claimInsert then claimSelect on h, as prefixed in q; on
// MariaDB, claimInsertReturning, followed by claimSelect only when the key
// exists. The insert's duplicate key error is expected and absorbed, by
// number: its message quotes the key. Other errors are returned
// unclassified.
func claim(ctx context.Context, h dbtx, p *idem.ClaimParams, q *claimStatements, mariaDB bool) (*idem.ClaimResult, error) {
	now := pinned(p.Now)
	scope, key := []byte(p.Scope), []byte(p.Key)
	args := [...]any{
		scope, key, p.Fingerprint[:], idem.StatusProcessing, p.Token,
		now, p.LeaseDuration.Microseconds(), now, now,
		now, p.Retention.Microseconds(),
	}
	var err error
	switch {
	case mariaDB && ctx.Value(lazyBeginKey{}) != nil:
		// The first statement of BeginClaim's transaction (Do's) carries
		// its START TRANSACTION (see pipeConn), and returns nothing: the
		// server's times returned by RETURNING cost MariaDB about a tenth
		// of a small Do's throughput (docs/performance.md, round 11). The
		// stored times are still the server's; the record returned carries
		// them as of the client's clock (the pinned one, when set, exactly),
		// as PostgreSQL's deferred claim estimates its lease. Do's holder
		// keeps the row lock to its commit, so nothing decides on them.
		qctx := context.WithValue(ctx, firstStatementKey{}, q.beginInsert)
		if _, err = h.ExecContext(qctx, q.insert, args[:]...); err == nil {
			at := truncate(time.Now())
			if p.Now != nil {
				at = truncate(*p.Now)
			}
			rec := &idem.Record{
				Scope: p.Scope, Key: p.Key, Fingerprint: p.Fingerprint,
				Status: idem.StatusProcessing, Token: p.Token, Attempt: 1,
				LeaseExpiresAt: at.Add(p.LeaseDuration.Truncate(time.Microsecond)), CreatedAt: at, UpdatedAt: at,
				ExpiresAt: at.Add(p.Retention.Truncate(time.Microsecond)),
			}
			return &idem.ClaimResult{Record: rec, Created: true, Now: at}, nil
		}
	case mariaDB:
		var lease, created, expires dbTime
		// Prepared on a pool of NewConnector (ignored elsewhere).
		qctx := context.WithValue(ctx, preparedKey{}, true)
		err = h.QueryRowContext(qctx, q.insertReturning, args[:]...).Scan(&lease, &created, &expires)
		if err == nil {
			// Exactly the stored record; created_at is the statement's clock.
			rec := &idem.Record{
				Scope: p.Scope, Key: p.Key, Fingerprint: p.Fingerprint,
				Status: idem.StatusProcessing, Token: p.Token, Attempt: 1,
				LeaseExpiresAt: lease.Time, CreatedAt: created.Time, UpdatedAt: created.Time,
				ExpiresAt: expires.Time,
			}
			return &idem.ClaimResult{Record: rec, Created: true, Now: created.Time}, nil
		}
	default:
		_, err = h.ExecContext(ctx, q.insert, args[:]...)
	}
	created := err == nil
	if err != nil && !isDupEntry(err) {
		return nil, err
	}
	var dbNow dbTime
	rec, err := scanRecord(h.QueryRowContext(ctx, q.sel, scope, key), &dbNow)
	if err != nil {
		// sql.ErrNoRows: the record we conflicted with is gone already.
		return nil, err
	}
	out := &idem.ClaimResult{Record: rec, Created: created, Now: dbNow.Time}
	if p.Now != nil {
		out.Now = truncate(*p.Now)
	}
	return out, nil
}

// Takeover implements idem.Executor, with its wait bounded as boundWait
// says. An unknown Condition fails before any statement runs.
func (e *executor) Takeover(ctx context.Context, p *idem.TakeoverParams) error {
	now := pinned(p.Now)
	args := []any{
		p.NewToken, p.Fingerprint[:], idem.StatusProcessing, p.Attempt,
		now, p.LeaseDuration.Microseconds(), now, now,
		now, p.Retention.Microseconds(),
		[]byte(p.Scope), []byte(p.Key), p.Token,
	}
	var query string
	switch p.Condition {
	case idem.TakeoverRetentionExpired:
		query = takeoverRetentionExpired
		args = append(args, now)
	case idem.TakeoverLeaseExpired:
		query = takeoverLeaseExpired
		args = append(args, idem.StatusProcessing, now)
	case idem.TakeoverReserved:
		query = takeover
	default:
		return fmt.Errorf("idem: mysql: unknown takeover condition %d", p.Condition)
	}
	var n int64
	err := e.boundWait(ctx, p.WaitTimeout, func(h dbtx, prefix string) error {
		res, err := h.ExecContext(ctx, prefix+query, args...)
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	})
	if err != nil {
		return err
	}
	if n == 0 {
		return idem.ErrFenced
	}
	return nil
}

// Get implements idem.Executor.
func (e *executor) Get(ctx context.Context, p *idem.GetParams) (*idem.Record, error) {
	rec, err := scanRecord(e.h.QueryRowContext(ctx, get, []byte(p.Scope), []byte(p.Key), pinned(p.Now)))
	if err != nil {
		return nil, interpretError(err)
	}
	return rec, nil
}

// Complete implements idem.Executor. An empty body is stored as an empty
// value, not NULL, and an empty header as NULL.
func (e *executor) Complete(ctx context.Context, p *idem.CompleteParams) error {
	args, err := completeArgs(p)
	if err != nil {
		return err
	}
	// Prepared on a pool of NewConnector (ignored elsewhere).
	res, err := e.h.ExecContext(context.WithValue(ctx, preparedKey{}, true), complete, args...)
	return fencedUnlessOne(res, err)
}

// completeArgs returns the arguments of complete (and completeCommit) for p.
func completeArgs(p *idem.CompleteParams) ([]any, error) {
	resp := p.Response
	if resp == nil {
		resp = &idem.Response{}
	}
	header, err := codec.EncodeHeader(resp.Header)
	if err != nil {
		return nil, err
	}
	body := resp.Body
	if body == nil {
		body = []byte{}
	}
	now := pinned(p.Now)
	return []any{
		p.Status, resp.StatusCode, header, body,
		now, now, now, p.Retention.Microseconds(),
		[]byte(p.Scope), []byte(p.Key), p.Token, idem.StatusProcessing,
	}, nil
}

// Release implements idem.Executor.
func (e *executor) Release(ctx context.Context, p *idem.ReleaseParams) error {
	query := release
	args := []any{[]byte(p.Scope), []byte(p.Key), p.Token, idem.StatusProcessing}
	if p.OnlyIfLeaseExpired {
		query = releaseLeaseExpired
		args = append(args, pinned(p.Now))
	}
	res, err := e.h.ExecContext(ctx, query, args...)
	return fencedUnlessOne(res, err)
}

// RenewLease implements idem.Executor, with its wait bounded as boundWait
// says. MySQL has no RETURNING, so the new expiry is computed here from the
// now given to the statement (the pinned one, or the server's clock read
// just before) with the statement's own arithmetic: it equals the stored
// value to the microsecond. With the server's clock that costs one extra
// round trip, and the now is the time of that read: a statement that then
// waits for a lock compares and writes a now that lags by the wait.
func (e *executor) RenewLease(ctx context.Context, p *idem.RenewLeaseParams) (time.Time, error) {
	now, err := e.statementNow(ctx, p.Now)
	if err != nil {
		return time.Time{}, err
	}
	// DATE_ADD(now, INTERVAL µs MICROSECOND), both truncating toward zero.
	lease := now.Add(p.Duration.Truncate(time.Microsecond))
	micros := p.Duration.Microseconds()
	scope, key := []byte(p.Scope), []byte(p.Key)
	found := false
	err = e.boundWait(ctx, p.WaitTimeout, func(h dbtx, prefix string) error {
		res, err := h.ExecContext(ctx, prefix+renewLease,
			p.NewToken, now, micros, now, now, micros,
			scope, key, p.Token, idem.StatusProcessing, p.OnlyIfExpired, now)
		if err != nil {
			return err
		}
		n, err := res.RowsAffected()
		if err != nil || n > 0 {
			found = n > 0
			return err
		}
		if p.NewToken != p.Token {
			// A matched row would have changed: its token.
			return nil
		}
		// Fenced, or identical to the previous renewal (see renewLease).
		var one int
		err = h.QueryRowContext(ctx, prefix+renewLeaseCheck,
			scope, key, p.Token, idem.StatusProcessing, lease, now, lease, p.OnlyIfExpired, now).Scan(&one)
		if errors.Is(err, sql.ErrNoRows) {
			return nil
		}
		found = err == nil
		return err
	})
	if err != nil {
		return time.Time{}, err
	}
	if !found {
		return time.Time{}, idem.ErrFenced
	}
	return lease, nil
}

// ListStaleLeases implements idem.Executor. The time it returns is the one
// its statement compared with: the pinned now, or the server's clock read
// just before.
func (e *executor) ListStaleLeases(ctx context.Context, p *idem.ListStaleLeasesParams) ([]*idem.Record, time.Time, error) {
	if err := checkLimit(p.Limit); err != nil {
		return nil, time.Time{}, err
	}
	now, err := e.statementNow(ctx, p.Now)
	if err != nil {
		return nil, time.Time{}, err
	}
	rows, err := e.h.QueryContext(ctx, listStaleLeases, idem.StatusProcessing, now, now, p.Limit)
	if err != nil {
		return nil, time.Time{}, interpretError(err)
	}
	defer func() { _ = rows.Close() }()
	var recs []*idem.Record
	for rows.Next() {
		rec, err := scanRecord(rows)
		if err != nil {
			return nil, time.Time{}, interpretError(err)
		}
		recs = append(recs, rec)
	}
	if err := rows.Err(); err != nil {
		return nil, time.Time{}, interpretError(err)
	}
	return recs, now, nil
}

// DeleteExpired implements idem.Executor. Its statement skips rows that other
// transactions hold instead of waiting for them (see deleteExpired), so it
// needs no bound on lock waits; a skipped row is left for a later call.
func (e *executor) DeleteExpired(ctx context.Context, p *idem.DeleteExpiredParams) (int, error) {
	if err := checkLimit(p.Limit); err != nil {
		return 0, err
	}
	res, err := e.h.ExecContext(ctx, deleteExpired, pinned(p.Now), p.Limit)
	if err != nil {
		return 0, interpretError(err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, interpretError(err)
	}
	return int(n), nil
}

// statementNow returns the now to pass to a statement whose caller must know
// it: the pinned time at the columns' precision, or the server's UTC clock
// read on the executor's handle.
func (e *executor) statementNow(ctx context.Context, at *time.Time) (time.Time, error) {
	if at != nil {
		return truncate(*at), nil
	}
	var t dbTime
	if err := e.h.QueryRowContext(ctx, clock).Scan(&t); err != nil {
		return time.Time{}, interpretError(err)
	}
	return t.Time, nil
}

// fencedUnlessOne turns the result of a fenced write into ErrFenced when it
// matched no row. Each such statement changes at least one column of the row
// it matches, so a match counts as one row whatever clientFoundRows says.
func fencedUnlessOne(res sql.Result, err error) error {
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

// lockWaitSeconds converts a wait bound to innodb_lock_wait_timeout, which
// counts whole seconds from 1 to 1073741824: rounded up, clamped.
func lockWaitSeconds(d time.Duration) int {
	const maxSeconds = 1073741824
	secs := d / time.Second
	if d%time.Second != 0 {
		secs++
	}
	return int(min(max(secs, 1), maxSeconds))
}

// pinned returns the argument for the now placeholder: NULL for the
// server's clock, else the pinned time in UTC at the columns' precision.
// Truncating here makes MySQL (which rounds extra digits) and MariaDB (which
// truncates them) store the same value.
func pinned(t *time.Time) any {
	if t == nil {
		return nil
	}
	return truncate(*t)
}

func truncate(t time.Time) time.Time { return t.UTC().Truncate(time.Microsecond) }

// rowScanner is a *sql.Row or *sql.Rows.
type rowScanner interface {
	Scan(dest ...any) error
}

// scanRecord scans recordColumns, then extra, from row.
func scanRecord(row rowScanner, extra ...any) (*idem.Record, error) {
	rec, err := scanRecordOrNull(row, extra...)
	if err == nil && rec == nil {
		// NOT NULL columns: only a LEFT JOIN's missing side reads so.
		return nil, &idem.CorruptRecordError{Reason: "its scope is NULL"}
	}
	return rec, err
}

// scanRecordOrNull scans recordColumns, then extra, from row, and returns
// a nil record when they are NULL, the missing side of a LEFT JOIN.
func scanRecordOrNull(row rowScanner, extra ...any) (*idem.Record, error) {
	var (
		scope, key, fingerprint, header, body         []byte
		status                                        sql.Null[idem.Status]
		token                                         sql.NullInt64
		attempt                                       sql.NullInt64
		responseStatus                                sql.NullInt64
		leaseExpires, created, updated, done, expires dbTime
	)
	dest := append([]any{
		&scope, &key, &fingerprint, &status, &token, &attempt,
		&leaseExpires, &responseStatus, &header, &body,
		&created, &updated, &done, &expires,
	}, extra...)
	if err := row.Scan(dest...); err != nil {
		return nil, err
	}
	if scope == nil {
		return nil, nil
	}
	rec := &idem.Record{
		Scope:          string(scope),
		Key:            string(key),
		Status:         status.V,
		Token:          token.Int64,
		Attempt:        int(attempt.Int64),
		LeaseExpiresAt: leaseExpires.Time,
		CreatedAt:      created.Time,
		UpdatedAt:      updated.Time,
		CompletedAt:    done.Time,
		ExpiresAt:      expires.Time,
	}
	if len(fingerprint) != len(rec.Fingerprint) {
		return nil, &idem.CorruptRecordError{Reason: fmt.Sprintf("its fingerprint has %d bytes, want %d", len(fingerprint), len(rec.Fingerprint))}
	}
	copy(rec.Fingerprint[:], fingerprint)
	if rec.Status.Final() {
		h, err := codec.DecodeHeader(header)
		if err != nil {
			// The decoder's message may quote stored bytes: kept as the cause only.
			return nil, &idem.CorruptRecordError{Reason: "its response headers do not decode", Cause: err}
		}
		if body == nil {
			body = []byte{}
		}
		rec.Response = &idem.Response{StatusCode: int(responseStatus.Int64), Header: h, Body: body}
	}
	return rec, nil
}

// dbTime scans a DATETIME(6) column or expression, failing clearly when the
// DSN lacks parseTime=true (the value arrives as text) or sets a loc other
// than UTC (the value would be read in, and written from, the wrong zone).
// NULL leaves it zero.
type dbTime struct{ Time time.Time }

func (t *dbTime) Scan(src any) error {
	switch v := src.(type) {
	case nil:
		t.Time = time.Time{}
		return nil
	case time.Time:
		if v.Location() != time.UTC {
			return errNotUTC
		}
		t.Time = v
		return nil
	case []byte, string:
		return errParseTime
	default:
		return fmt.Errorf("idem: mysql: unexpected %T for a DATETIME value", src)
	}
}

// checkLimit rejects a limit below 1. Sent as a parameter of a server-side
// prepared statement (interpolateParams=false), LIMIT -1 reads as no limit
// at all: one call would delete every expired record.
func checkLimit(limit int) error {
	if limit < 1 {
		return fmt.Errorf("idem: mysql: limit %d must be at least 1", limit)
	}
	return nil
}
