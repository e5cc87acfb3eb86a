package mysql

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/codec"
)

// Dialect runs idem's statements on MySQL or MariaDB through database/sql and
// github.com/go-sql-driver/mysql. Create it with [New]; it is safe for
// concurrent use.
type Dialect struct {
	db   *sql.DB
	pool *executor
	// server is nil until the first Claim has read it; see serverInfo.
	server atomic.Pointer[serverInfo]
}

// serverInfo is what Claim must know about the server behind the pool.
type serverInfo struct {
	// mariaDB selects SET STATEMENT to bound the claim's lock wait; MySQL
	// lacks it and gets a session variable set and restored around the claim.
	mariaDB bool
	// rollbackOnTimeout mirrors innodb_rollback_on_timeout: when ON, a lock
	// wait timeout rolls back the whole transaction, not just the statement.
	rollbackOnTimeout bool
}

var _ idem.Dialect[*sql.Tx] = (*Dialect)(nil)

// New returns a Dialect over db, which must be opened with the
// github.com/go-sql-driver/mysql driver and a DSN with parseTime=true and
// the default loc (UTC); see the package documentation. New does not touch
// the database: the server's flavour is read by the first Claim.
func New(db *sql.DB) *Dialect {
	d := &Dialect{db: db}
	d.pool = &executor{d: d, h: db, db: db}
	return d
}

// Name returns "mysql", for MariaDB too.
func (d *Dialect) Name() string { return "mysql" }

// DB returns an Executor whose statements each run on the pool in autocommit
// mode.
func (d *Dialect) DB() idem.Executor { return d.pool }

// Tx returns an Executor that runs inside tx. It never commits or rolls back
// tx. As with any *sql.Tx, it must not be used by two goroutines at once.
func (d *Dialect) Tx(tx *sql.Tx) idem.Executor { return &executor{d: d, h: tx} }

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
	return interpretError(tx.Commit())
}

// Rollback rolls tx back. A transaction that already ended is not an error.
func (d *Dialect) Rollback(_ context.Context, tx *sql.Tx) error {
	if err := tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
		return interpretError(err)
	}
	return nil
}

// serverInfo returns what Claim needs to know about the server, reading it
// on h the first time. h is the executor's own handle, so a transaction
// never waits for a second pool connection. A failed read is not cached: the
// next Claim tries again. Concurrent first reads are harmless; they agree.
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

// Claim implements idem.Executor. On MariaDB each statement is prefixed by
// SET STATEMENT innodb_lock_wait_timeout=N, where N is WaitTimeout rounded up
// to whole seconds; on MySQL the session variable is set and restored around
// the claim. A lock wait timeout rolls back only the statement unless the
// server runs with innodb_rollback_on_timeout=ON, which TxAborted reports.
func (e *executor) Claim(ctx context.Context, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	srv, err := e.d.serverInfo(ctx, e.h)
	if err != nil {
		return nil, err
	}
	secs := lockWaitSeconds(p.WaitTimeout)
	var res *idem.ClaimResult
	if srv.mariaDB {
		res, err = e.claimMariaDB(ctx, p, secs)
	} else {
		res, err = e.claimMySQL(ctx, p, secs)
	}
	if isLockWaitTimeout(err) {
		return nil, &idem.InProgressError{
			RetryAfter: max(p.WaitTimeout, 0),
			TxAborted:  e.db == nil && srv.rollbackOnTimeout,
		}
	}
	if err != nil {
		return nil, interpretError(err)
	}
	return res, nil
}

// claimMariaDB bounds each claim statement with SET STATEMENT, which applies
// to that statement alone, so it works on the pool as well as in a
// transaction and costs no extra round trip. SET STATEMENT takes no bind
// parameters, so the timeout is formatted into the text: it is an int
// derived from Config.WaitTimeout, never user input, and formats as digits
// only.
func (e *executor) claimMariaDB(ctx context.Context, p *idem.ClaimParams, secs int) (*idem.ClaimResult, error) {
	prefix := "SET STATEMENT innodb_lock_wait_timeout=" + strconv.Itoa(secs) + " FOR "
	return claim(ctx, e.h, p, prefix)
}

// claimMySQL sets the session's innodb_lock_wait_timeout, claims, and puts
// the previous value back, all on one connection: the transaction's, or one
// taken from the pool for the purpose. Context cancellation makes the driver
// close the connection, so the wait is bounded by the server, never by a
// context deadline, which would destroy the caller's transaction.
func (e *executor) claimMySQL(ctx context.Context, p *idem.ClaimParams, secs int) (*idem.ClaimResult, error) {
	h := e.h
	var conn *sql.Conn
	if e.db != nil {
		var err error
		if conn, err = e.db.Conn(ctx); err != nil {
			return nil, err
		}
		defer func() { _ = conn.Close() }()
		h = conn
	}
	if _, err := h.ExecContext(ctx, setLockWait, secs); err != nil {
		return nil, err
	}
	res, err := claim(ctx, h, p, "")
	// Restore even if ctx is done: the connection outlives this call.
	if _, rerr := h.ExecContext(context.WithoutCancel(ctx), restoreLockWait); rerr != nil {
		if conn != nil {
			// Never return a connection with a shortened timeout to the
			// pool: make database/sql discard it. The claim stands.
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		} else if err == nil {
			return nil, rerr
		}
	}
	return res, err
}

// claim runs claimInsert then claimSelect on h, each prefixed by prefix. It
// returns driver errors unclassified.
func claim(ctx context.Context, h dbtx, p *idem.ClaimParams, prefix string) (*idem.ClaimResult, error) {
	now := pinned(p.Now)
	scope, key := []byte(p.Scope), []byte(p.Key)
	res, err := h.ExecContext(ctx, prefix+claimInsert,
		scope, key, p.Fingerprint[:], idem.StatusProcessing, p.Token,
		now, p.LeaseDuration.Microseconds(), now, now,
		now, p.Retention.Microseconds())
	if err != nil {
		return nil, err
	}
	inserted, err := res.RowsAffected()
	if err != nil {
		return nil, err
	}
	var dbNow dbTime
	rec, err := scanRecord(h.QueryRowContext(ctx, prefix+claimSelect, scope, key), &dbNow)
	if err != nil {
		// sql.ErrNoRows: the record we conflicted with is gone already.
		return nil, err
	}
	out := &idem.ClaimResult{
		Record: rec,
		// RowsAffected decides. The token check is a second guard for a DSN
		// with clientFoundRows=true, where a found row counts as affected:
		// it catches every such case except two claims that drew the same
		// token, so that setting remains unsupported.
		Created: inserted == 1 && rec.Token == p.Token,
		Now:     dbNow.Time,
	}
	if p.Now != nil {
		out.Now = truncate(*p.Now)
	}
	return out, nil
}

// Takeover implements idem.Executor.
func (e *executor) Takeover(ctx context.Context, p *idem.TakeoverParams) error {
	now := pinned(p.Now)
	res, err := e.h.ExecContext(ctx, takeover,
		p.NewToken, p.Fingerprint[:], idem.StatusProcessing, p.Attempt,
		now, p.LeaseDuration.Microseconds(), now, now,
		now, p.Retention.Microseconds(),
		[]byte(p.Scope), []byte(p.Key), p.Token)
	return fencedUnlessOne(res, err)
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
	resp := p.Response
	if resp == nil {
		resp = &idem.Response{}
	}
	header, err := codec.EncodeHeader(resp.Header)
	if err != nil {
		return err
	}
	body := resp.Body
	if body == nil {
		body = []byte{}
	}
	now := pinned(p.Now)
	res, err := e.h.ExecContext(ctx, complete,
		p.Status, resp.StatusCode, header, body,
		now, now, now, p.Retention.Microseconds(),
		[]byte(p.Scope), []byte(p.Key), p.Token, idem.StatusProcessing)
	return fencedUnlessOne(res, err)
}

// Release implements idem.Executor.
func (e *executor) Release(ctx context.Context, p *idem.ReleaseParams) error {
	res, err := e.h.ExecContext(ctx, release,
		[]byte(p.Scope), []byte(p.Key), p.Token, idem.StatusProcessing)
	return fencedUnlessOne(res, err)
}

// fencedUnlessOne turns the result of a fenced write into ErrFenced when it
// matched no row. Each such statement changes at least one column of the row
// it matches, so with clientFoundRows=false a match counts as one row.
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

// scanRecord scans recordColumns, then extra, from row.
func scanRecord(row *sql.Row, extra ...any) (*idem.Record, error) {
	var (
		scope, key, fingerprint, header, body         []byte
		status                                        idem.Status
		token                                         int64
		attempt                                       int
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
	rec := &idem.Record{
		Scope:          string(scope),
		Key:            string(key),
		Status:         status,
		Token:          token,
		Attempt:        attempt,
		LeaseExpiresAt: leaseExpires.Time,
		CreatedAt:      created.Time,
		UpdatedAt:      updated.Time,
		CompletedAt:    done.Time,
		ExpiresAt:      expires.Time,
	}
	if len(fingerprint) != len(rec.Fingerprint) {
		return nil, fmt.Errorf("idem: mysql: stored fingerprint has %d bytes, want %d", len(fingerprint), len(rec.Fingerprint))
	}
	copy(rec.Fingerprint[:], fingerprint)
	if status.Final() {
		h, err := codec.DecodeHeader(header)
		if err != nil {
			return nil, err
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
