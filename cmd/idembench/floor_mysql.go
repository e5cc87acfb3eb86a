package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/workload"
)

// The floor scenarios' statements on MySQL/MariaDB. The read is a plain
// consistent read: a locking one would take a gap lock on the absent key,
// which the floor does not need.
const (
	mysqlFloorTable = `CREATE TABLE ` + floorTable + ` LIKE idempotency_keys`
	mysqlFloorRead  = `SELECT ` + floorRecordColumns + `
FROM ` + floorTable + `
WHERE scope = ? AND idempotency_key = ?`
	// key_digest is generated: not written.
	mysqlFloorInsert = `INSERT INTO ` + floorTable + ` (` + floorRecordColumns + `)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`
	// floor's first and last statements on MariaDB, as idemmysql's
	// connector sends Do's claim and completion: START TRANSACTION and the
	// read in one compound statement, the INSERT and COMMIT in another.
	mysqlFloorBeginRead    = "BEGIN NOT ATOMIC\nSTART TRANSACTION;\n" + mysqlFloorRead + ";\nEND"
	mysqlFloorInsertCommit = "BEGIN NOT ATOMIC\n" + mysqlFloorInsert + ";\nCOMMIT;\nEND"
)

// The floorlock scenario's statements (MariaDB): the least a Do that holds
// the key before fn runs must write. The claim inserts a processing row
// into floorTable, which locks the key until the commit (a concurrent
// claim of it waits, then meets the row); the completion inserts the
// response into a table of its own instead of updating that row, since an
// InnoDB UPDATE of the row the transaction inserted costs about as much
// again as the insert (docs/performance-history.md, round 9). Two inserts,
// no UPDATE, no fencing (the claim's row lock is held to the commit), no
// lock wait bound, the values computed in Go: a design that keeps Do's
// promise, that a second call waits instead of running fn too, cannot
// write less on InnoDB. Nothing reads the response table: it is what a
// schema of two tables would write, not that schema.
const (
	floorResponsesTable = "idembench_floor_responses"

	mysqlFloorResponsesTable = `CREATE TABLE ` + floorResponsesTable + ` (
	scope            VARBINARY(255) NOT NULL,
	idempotency_key  VARBINARY(255) NOT NULL,
	response_status  INT            NOT NULL,
	response_headers MEDIUMBLOB     NOT NULL,
	response_body    LONGBLOB       NOT NULL,
	completed_at     DATETIME(6)    NOT NULL,
	PRIMARY KEY (scope, idempotency_key)
) ENGINE = InnoDB`

	mysqlFloorLockClaim = "BEGIN NOT ATOMIC\nSTART TRANSACTION;\nINSERT INTO " + floorTable + ` (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at, created_at, updated_at, expires_at)
VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?);
END`
	mysqlFloorLockComplete = "BEGIN NOT ATOMIC\nINSERT INTO " + floorResponsesTable + ` (
	scope, idempotency_key, response_status, response_headers, response_body, completed_at)
VALUES (?, ?, ?, ?, ?, ?);
COMMIT;
END`
)

// mysqlFloorLockBoundClaim is floorlockbound's claim: floorlock's, with
// what Do's claim owes its contract besides the lock. Its wait for an
// uncommitted holder of the key is bounded (Config.WaitTimeout, 5 s by
// default, as SET STATEMENT), and the record's times are the database's
// clock, computed by the server and returned (RETURNING), as every record
// idem writes keeps them.
const mysqlFloorLockBoundClaim = "BEGIN NOT ATOMIC\nSTART TRANSACTION;\nSET STATEMENT innodb_lock_wait_timeout=5 FOR INSERT INTO " + floorTable + ` (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at, created_at, updated_at, expires_at)
VALUES (?, ?, ?, ?, ?, 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6),
	UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
RETURNING lease_expires_at, created_at, expires_at;
END`

// The floorresp scenario's statements (MariaDB): a schema of two tables as
// Do would write it with its contract, the least such a design sends. The
// claim is Do's own (idemmysql's claimInsert: the wait bounded by SET
// STATEMENT, the record's times the server's, nothing returned); the
// completion inserts the response into a table shaped as such a design
// needs it (the token, so that a stale row is told apart, and expires_at
// with its index, for the reaper), guarded as it must be: a transaction the
// server rolled back during the callback (a deadlock, 1213) leaves the
// connection outside any transaction, and the completion must then fail
// instead of committing a response alone; ON DUPLICATE KEY UPDATE
// overwrites a response row left by an earlier record of the key (taken
// over, or deleted by an operator half way). What it leaves out, against a
// real design, is the fencing check of a claim that took a record over
// (its UPDATE path) and every read's join of the two tables.
const (
	floorRespTable = "idembench_floor_resp"

	mysqlFloorRespTable = `CREATE TABLE ` + floorRespTable + ` (
	scope            VARBINARY(255) NOT NULL,
	idempotency_key  VARBINARY(255) NOT NULL,
	token            BIGINT         NOT NULL,
	status           SMALLINT       NOT NULL,
	response_status  INT            NULL,
	response_headers MEDIUMBLOB     NULL,
	response_body    LONGBLOB       NULL,
	completed_at     DATETIME(6)    NOT NULL,
	expires_at       DATETIME(6)    NOT NULL,
	PRIMARY KEY (scope, idempotency_key),
	INDEX idembench_floor_resp_expires_at_idx (expires_at)
) ENGINE = InnoDB`

	floorNow = "COALESCE(CAST(? AS DATETIME(6)), UTC_TIMESTAMP(6))"

	// The wait bound is Config.WaitTimeout's default, 5 s, as the Store
	// the tool measures uses it.
	mysqlFloorRespClaim = "BEGIN NOT ATOMIC\nSTART TRANSACTION;\nSET STATEMENT innodb_lock_wait_timeout=5 FOR INSERT INTO " + floorTable + ` (
	scope, idempotency_key, fingerprint, status, token, attempt,
	lease_expires_at, created_at, updated_at, expires_at)
VALUES (?, ?, ?, ?, ?, 1,
	DATE_ADD(` + floorNow + `, INTERVAL ? MICROSECOND), ` + floorNow + `, ` + floorNow + `,
	DATE_ADD(` + floorNow + `, INTERVAL ? MICROSECOND));
END`
	mysqlFloorRespComplete = `BEGIN NOT ATOMIC
IF @@in_transaction = 0 THEN
	SIGNAL SQLSTATE '45000' SET MYSQL_ERRNO = 1644, MESSAGE_TEXT = 'idembench: completion outside its transaction';
END IF;
INSERT INTO ` + floorRespTable + ` (
	scope, idempotency_key, token, status, response_status, response_headers, response_body, completed_at, expires_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ` + floorNow + `, DATE_ADD(` + floorNow + `, INTERVAL ? MICROSECOND))
ON DUPLICATE KEY UPDATE token = VALUES(token), status = VALUES(status), response_status = VALUES(response_status),
	response_headers = VALUES(response_headers), response_body = VALUES(response_body),
	completed_at = VALUES(completed_at), expires_at = VALUES(expires_at);
COMMIT;
END`
)

// mysqlFloorResp is the operation of floorresp on fdb, a pool of
// floorConnector.
func mysqlFloorResp(fdb *sql.DB) func(ctx context.Context, insert func(context.Context, *sql.Tx, string) error, scope string) error {
	return func(ctx context.Context, insert func(context.Context, *sql.Tx, string) error, scope string) error {
		r := newFloorRow(scope, workload.NewKey())
		tx, err := fdb.BeginTx(context.WithValue(ctx, floorLazyKey{}, true), nil)
		if err != nil {
			return fmt.Errorf("floorresp: begin: %w", err)
		}
		defer func() { _ = tx.Rollback() }() // after the COMMIT: sends nothing
		qctx := context.WithValue(ctx, floorFirstKey{}, mysqlFloorRespClaim)
		if _, err := tx.ExecContext(qctx, mysqlFloorRespClaim, r.scope, r.key, fingerprint[:],
			int16(idem.StatusProcessing), r.token, nil, floorLease.Microseconds(), nil, nil, nil, floorRetention.Microseconds()); err != nil {
			return fmt.Errorf("floorresp: claim: %w", err)
		}
		if err := insert(ctx, tx, scope); err != nil {
			return err
		}
		cctx := context.WithValue(ctx, floorCommitsKey{}, true)
		if _, err := tx.ExecContext(cctx, mysqlFloorRespComplete, r.scope, r.key, r.token, int16(idem.StatusSucceeded),
			int32(response.StatusCode), floorHeader, response.Body, nil, nil, floorRetention.Microseconds()); err != nil {
			return fmt.Errorf("floorresp: complete: %w", err)
		}
		return tx.Commit()
	}
}

// mysqlFloorLock is the operation of floorlock on fdb, a pool of
// floorConnector, or with bound of floorlockbound.
func mysqlFloorLock(fdb *sql.DB, bound bool) func(ctx context.Context, insert func(context.Context, *sql.Tx, string) error, scope string) error {
	return func(ctx context.Context, insert func(context.Context, *sql.Tx, string) error, scope string) error {
		r := newFloorRow(scope, workload.NewKey())
		tx, err := fdb.BeginTx(context.WithValue(ctx, floorLazyKey{}, true), nil)
		if err != nil {
			return fmt.Errorf("floorlock: begin: %w", err)
		}
		defer func() { _ = tx.Rollback() }() // after the COMMIT: sends nothing
		if bound {
			qctx := context.WithValue(ctx, floorFirstKey{}, mysqlFloorLockBoundClaim)
			var lease, created, expires time.Time
			if err := tx.QueryRowContext(qctx, mysqlFloorLockBoundClaim, r.scope, r.key, fingerprint[:],
				int16(idem.StatusProcessing), r.token, floorLease.Microseconds(), floorRetention.Microseconds()).
				Scan(&lease, &created, &expires); err != nil {
				return fmt.Errorf("floorlockbound: claim: %w", err)
			}
			r.now = created
		} else {
			qctx := context.WithValue(ctx, floorFirstKey{}, mysqlFloorLockClaim)
			if _, err := tx.ExecContext(qctx, mysqlFloorLockClaim, r.scope, r.key, fingerprint[:],
				int16(idem.StatusProcessing), r.token, r.leaseExpires, r.now, r.now, r.expires); err != nil {
				return fmt.Errorf("floorlock: claim: %w", err)
			}
		}
		if err := insert(ctx, tx, scope); err != nil {
			return err
		}
		cctx := context.WithValue(ctx, floorCommitsKey{}, true)
		if _, err := tx.ExecContext(cctx, mysqlFloorLockComplete, r.scope, r.key,
			int32(response.StatusCode), floorHeader, response.Body, r.now); err != nil {
			return fmt.Errorf("floorlock: complete: %w", err)
		}
		return tx.Commit()
	}
}

// checkFloorLock is the floorlock scenarios' part of the exactly-once
// check: as many processing rows in floorTable (beyond the seeds), as many
// responses in responses (floorResponsesTable, or floorRespTable for
// floorresp), and as many of the two paired by key, as orders.
func checkFloorLock(ctx context.Context, a admin, responsesTable string, orders int64) error {
	processing := fmt.Sprint(int(idem.StatusProcessing))
	claims, err := a.queryInt(ctx, `SELECT COUNT(*) FROM `+floorTable+` f WHERE status = `+processing+` AND`+floorNotSeeded)
	if err != nil {
		return fmt.Errorf("count claims beside %s: %w", responsesTable, err)
	}
	responses, err := a.queryInt(ctx, `SELECT COUNT(*) FROM `+responsesTable)
	if err != nil {
		return fmt.Errorf("count responses in %s: %w", responsesTable, err)
	}
	paired, err := a.queryInt(ctx, `SELECT COUNT(*) FROM `+floorTable+` f
		JOIN `+responsesTable+` r ON r.scope = f.scope AND r.idempotency_key = f.idempotency_key
		WHERE f.status = `+processing)
	if err != nil {
		return fmt.Errorf("count claims paired in %s: %w", responsesTable, err)
	}
	if claims != orders || responses != orders || paired != orders {
		return fmt.Errorf("exactly-once check (%s): %d claims, %d responses and %d pairs for %d orders", responsesTable, claims, responses, paired, orders)
	}
	return nil
}

// mysqlFloorScan scans a row of mysqlFloorRead, for a fresh key none: nil
// then.
func mysqlFloorScan(row *sql.Row) error {
	var (
		scope, key, fp, hdr, body []byte
		status                    int16
		token                     int64
		attempt                   int32
		code                      sql.NullInt32
		lease, created, updated   time.Time
		completed                 sql.NullTime
		expires                   time.Time
	)
	err := row.Scan(&scope, &key, &fp, &status, &token, &attempt, &lease, &code, &hdr, &body, &created, &updated, &completed, &expires)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil
	case err == nil:
		return errFloorKeyFound
	}
	return fmt.Errorf("floor: read: %w", err)
}

// mysqlFloor runs the floor scenarios: floortx on s (the measured pool),
// floor on fdb (nil: floortx only), a pool opened through floorConnector,
// whose transactions begin with their first statement and commit with a
// statement of the caller's, as idemmysql.NewConnector's do for Do.
func mysqlFloor(s *idem.Store[*sql.Tx], fdb *sql.DB) *floorRunner[*sql.Tx] {
	do := func(ctx context.Context, insert func(context.Context, *sql.Tx, string) error, scope string) error {
		r := newFloorRow(scope, workload.NewKey())
		tx, err := fdb.BeginTx(context.WithValue(ctx, floorLazyKey{}, true), nil)
		if err != nil {
			return fmt.Errorf("floor: begin: %w", err)
		}
		defer func() { _ = tx.Rollback() }() // after the COMMIT: sends nothing
		qctx := context.WithValue(ctx, floorFirstKey{}, mysqlFloorBeginRead)
		if err := mysqlFloorScan(tx.QueryRowContext(qctx, mysqlFloorRead, r.scope, r.key)); err != nil {
			return err
		}
		if err := insert(ctx, tx, scope); err != nil {
			return err
		}
		cctx := context.WithValue(ctx, floorCommitsKey{}, true)
		if _, err := tx.ExecContext(cctx, mysqlFloorInsertCommit, r.args()...); err != nil {
			return fmt.Errorf("floor: complete: %w", err)
		}
		return tx.Commit()
	}
	tx := floorTxOp(s,
		func(ctx context.Context, tx *sql.Tx, r *floorRow) error {
			return mysqlFloorScan(tx.QueryRowContext(ctx, mysqlFloorRead, r.scope, r.key))
		},
		func(ctx context.Context, tx *sql.Tx, r *floorRow) error {
			_, err := tx.ExecContext(ctx, mysqlFloorInsert, r.args()...)
			return err
		})
	var lock, lockBound, resp func(context.Context, func(context.Context, *sql.Tx, string) error, string) error
	if fdb == nil {
		do = nil
	} else {
		lock, lockBound, resp = mysqlFloorLock(fdb, false), mysqlFloorLock(fdb, true), mysqlFloorResp(fdb)
	}
	return &floorRunner[*sql.Tx]{do: do, lock: lock, lockBound: lockBound, resp: resp, tx: tx, close: func() {}}
}

// Context keys of floorConn.
type (
	// floorLazyKey marks a BeginTx whose START TRANSACTION is to travel
	// with the transaction's first statement.
	floorLazyKey struct{}
	// floorFirstKey holds the text to send instead of the first statement
	// of a lazily begun transaction: that statement with START TRANSACTION.
	floorFirstKey struct{}
	// floorCommitsKey marks a statement that commits the transaction.
	floorCommitsKey struct{}
)

// floorConnector opens floorConns: the floor's own copy of what
// idemmysql.NewConnector does for Do (whose context keys are the
// package's), so that the floor makes Do's round trips without Do's code.
type floorConnector struct{ inner driver.Connector }

func newFloorConnector(cfg *gomysql.Config) (driver.Connector, error) {
	c := cfg.Clone()
	c.InterpolateParams = true // compound statements cannot be prepared
	inner, err := gomysql.NewConnector(c)
	if err != nil {
		return nil, err
	}
	return floorConnector{inner}, nil
}

func (c floorConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.inner.Connect(ctx)
	if err != nil {
		return nil, err
	}
	dc, ok := conn.(floorDriverConn)
	if !ok {
		_ = conn.Close()
		return nil, fmt.Errorf("floor: the driver's connection %T lacks methods database/sql uses", conn)
	}
	return &floorConn{floorDriverConn: dc}, nil
}

func (c floorConnector) Driver() driver.Driver { return c.inner.Driver() }

// floorDriverConn is every interface of go-sql-driver's connection, which
// floorConn forwards.
type floorDriverConn interface {
	driver.Conn
	driver.ConnBeginTx
	driver.ConnPrepareContext
	driver.ExecerContext
	driver.QueryerContext
	driver.Pinger
	driver.SessionResetter
	driver.Validator
	driver.NamedValueChecker
}

// floorConn is a connection whose transactions can begin lazily (BeginTx
// with floorLazyKey sends nothing) and commit in a statement (one with
// floorCommitsKey); database/sql never uses it from two goroutines at once.
type floorConn struct {
	floorDriverConn
	lazy, committed bool
}

func (c *floorConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	if ctx.Value(floorLazyKey{}) == nil || opts != (driver.TxOptions{}) {
		return c.floorDriverConn.BeginTx(ctx, opts)
	}
	c.lazy, c.committed = true, false
	return (*floorTx)(c), nil
}

// first returns the text to send for query and whether it is the text of
// floorFirstKey, which begins the transaction not begun yet; without that
// key it sends START TRANSACTION first if the transaction has not begun.
func (c *floorConn) first(ctx context.Context, query string) (string, bool, error) {
	if c.lazy {
		if alt, ok := ctx.Value(floorFirstKey{}).(string); ok {
			c.lazy = false
			return alt, true, nil
		}
	}
	return query, false, c.beginPlain(ctx)
}

// beginPlain sends START TRANSACTION if a lazy transaction has not begun.
func (c *floorConn) beginPlain(ctx context.Context) error {
	if !c.lazy {
		return nil
	}
	c.lazy = false
	_, err := c.floorDriverConn.ExecContext(ctx, "START TRANSACTION", nil)
	return err
}

// errNotInterpolated: the driver would have database/sql prepare a
// compound statement, which the server cannot prepare.
var errNotInterpolated = errors.New("floor: compound statement not interpolated by the driver")

func (c *floorConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	q, begins, err := c.first(ctx, query)
	if err != nil {
		return nil, err
	}
	rows, err := c.floorDriverConn.QueryContext(ctx, q, args)
	if begins && errors.Is(err, driver.ErrSkip) {
		return nil, errNotInterpolated
	}
	return rows, err
}

func (c *floorConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	q, begins, err := c.first(ctx, query)
	if err != nil {
		return nil, err
	}
	res, err := c.floorDriverConn.ExecContext(ctx, q, args)
	commits := ctx.Value(floorCommitsKey{}) != nil
	switch {
	case (begins || commits) && errors.Is(err, driver.ErrSkip):
		return nil, errNotInterpolated
	case commits && err == nil:
		c.committed = true
	}
	return res, err
}

func (c *floorConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	if err := c.beginPlain(ctx); err != nil {
		return nil, err
	}
	return c.floorDriverConn.PrepareContext(ctx, query)
}

func (c *floorConn) ResetSession(ctx context.Context) error {
	c.lazy, c.committed = false, false
	return c.floorDriverConn.ResetSession(ctx)
}

// floorTx is the transaction of a lazy BeginTx: it sends COMMIT or
// ROLLBACK unless the transaction never began or a statement committed it.
type floorTx floorConn

func (t *floorTx) Commit() error   { return t.end("COMMIT") }
func (t *floorTx) Rollback() error { return t.end("ROLLBACK") }

func (t *floorTx) end(stmt string) error {
	c := (*floorConn)(t)
	skip := c.lazy || c.committed
	c.lazy, c.committed = false, false
	if skip {
		return nil
	}
	_, err := c.floorDriverConn.ExecContext(context.Background(), stmt, nil)
	return err
}
