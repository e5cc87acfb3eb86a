package postgres

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/codec"
	"github.com/idemstore/idem/internal/failexec"
)

// Dialect is the PostgreSQL dialect over a pgx connection pool. Create it
// with [New]; it is safe for concurrent use.
type Dialect struct {
	pool *pgxpool.Pool
	// exec is the pool's Executor, made once: DB is on every pool-level
	// call's path.
	exec *executor
	st   *statements
	// ops are the operators' statements (ops.go).
	ops *opsStatements
	// err is an invalid option's error, which every call returns.
	err error
}

var _ idem.Dialect[pgx.Tx] = (*Dialect)(nil)

// New returns a dialect that runs on pool; pool must not be nil. Without
// [WithSchema], the pool's search_path decides which schema's
// idempotency_keys table is used, statement by statement; with it, every
// statement names the table in that schema. An invalid option makes every
// call of the Dialect fail with an error matching [idem.ErrMisconfigured].
func New(pool *pgxpool.Pool, opts ...Option) *Dialect {
	o := applyOptions(opts)
	st := defaultStatements
	if o.err == nil && o.schema != "" {
		st = newStatements(o.table())
	}
	return &Dialect{pool: pool, exec: &executor{db: pool, st: st}, st: st, ops: newOpsStatements(o.schema), err: o.err}
}

// Name returns "postgres".
func (d *Dialect) Name() string { return "postgres" }

// DB returns an Executor that runs each statement on the pool, outside any
// caller transaction.
func (d *Dialect) DB() idem.Executor {
	if d.err != nil {
		return failexec.Executor{Err: d.err}
	}
	return d.exec
}

// errNilTx is returned for a nil pgx.Tx instead of a nil-pointer panic.
var errNilTx = errors.New("idem: postgres: nil pgx.Tx")

// Tx returns an Executor that runs inside tx. It never commits or rolls back
// tx. For a nil tx, every call of the Executor fails.
func (d *Dialect) Tx(tx pgx.Tx) idem.Executor {
	if d.err != nil {
		return failexec.Executor{Err: d.err}
	}
	if tx == nil {
		return failexec.Executor{Err: errNilTx}
	}
	return &executor{db: tx, inTx: true, st: d.st}
}

// Begin starts a transaction on the pool with the server's default isolation
// level (READ COMMITTED unless configured otherwise).
func (d *Dialect) Begin(ctx context.Context) (pgx.Tx, error) {
	if d.err != nil {
		return nil, d.err
	}
	tx, err := d.pool.Begin(ctx)
	if err != nil {
		return nil, interpretError(ctx, err)
	}
	return tx, nil
}

// Commit commits tx. A serialization failure at commit matches
// [idem.ErrRetryable]; a lost connection matches [idem.ErrStoreUnavailable].
func (d *Dialect) Commit(ctx context.Context, tx pgx.Tx) error {
	if tx == nil {
		return errNilTx
	}
	return interpretError(ctx, tx.Commit(ctx))
}

// Rollback rolls tx back; rolling back a committed or rolled back
// transaction returns nil.
func (d *Dialect) Rollback(ctx context.Context, tx pgx.Tx) error {
	if tx == nil {
		return errNilTx
	}
	if err := tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return interpretError(ctx, err)
	}
	return nil
}

// dbtx is what the executor needs from a pool, a transaction or a single
// connection.
type dbtx interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

var (
	_ dbtx = (*pgxpool.Pool)(nil)
	_ dbtx = (pgx.Tx)(nil)
	_ dbtx = (*pgx.Conn)(nil)
)

// executor implements idem.Executor on one dbtx.
type executor struct {
	db dbtx
	// inTx is true inside a caller's transaction, which a wait timeout
	// aborts. Outside one, each bounded batch runs in a transaction of its
	// own.
	inTx bool
	st   *statements
}

var _ idem.Executor = (*executor)(nil)

// Claim runs the claim batch: one round trip inside a caller's transaction,
// two on the pool (see queries.go).
func (e *executor) Claim(ctx context.Context, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	b := &pgx.Batch{}
	if !e.inTx {
		b.BeginTx(pgx.TxOptions{})
	}
	return e.sendClaim(ctx, b, e.st.claimBatch(b, p), p)
}

// sendClaim sends the claim batch b, whose claim statements r reads, and
// finishes the claim p.
func (e *executor) sendClaim(ctx context.Context, b *pgx.Batch, r claimReader, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	if err := e.sendBounded(ctx, b, p.WaitTimeout, 0, r.readFirst, func(br pgx.BatchResults) error {
		return r.readSecond(ctx, br)
	}); err != nil {
		return nil, err
	}
	return r.answer().finish(ctx, e.st, e.db, p)
}

var _ idem.DeferredClaimer[pgx.Tx] = (*Dialect)(nil)

// ClaimDeferred implements [idem.DeferredClaimer] with the key's advisory
// lock (keyLock1), which every claim that creates a record takes too: the
// batch [claimTryLock; claimReadLocked] in tx, one round trip, and when
// another transaction holds the lock a second one that waits for it
// (claimLock) under lock_timeout = WaitTimeout. Outside READ COMMITTED it
// returns [idem.ErrSkipDefer] (see claimLock), holding the lock.
func (d *Dialect) ClaimDeferred(ctx context.Context, tx pgx.Tx, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	if d.err != nil {
		return nil, d.err
	}
	if tx == nil {
		return nil, errNilTx
	}
	b := &pgx.Batch{}
	e := &executor{db: tx, inTx: true, st: d.st}
	return e.sendClaim(ctx, b, d.st.deferredClaimBatch(b, p), p)
}

// CompleteDeferred implements [idem.DeferredClaimer]: completeInsert in
// tx. A record that exists regardless is a unique violation, which aborts
// tx, reported as [idem.ErrFenced].
func (d *Dialect) CompleteDeferred(ctx context.Context, tx pgx.Tx, p *idem.CompleteDeferredParams) error {
	if d.err != nil {
		return d.err
	}
	if tx == nil {
		return errNilTx
	}
	args, err := completeInsertArgs(p)
	if err != nil {
		return err
	}
	_, err = tx.Exec(ctx, d.st.completeInsert, args...)
	if isPgCode(err, codeUniqueViolation) {
		return idem.ErrFenced
	}
	return interpretError(ctx, err)
}

// claimNext is what a claim batch, once read, leaves to do.
type claimNext int

const (
	// claimDone: the answer's res is the claim's result.
	claimDone claimNext = iota
	// claimWaitForLock: a deferred claim's claimTryLock found the key's
	// lock held; the claim waits for it (claimDeferredBounded).
	claimWaitForLock
	// claimSkipDefer: a deferred claim found no record in a snapshot that
	// may predate the lock (see claimLock); the claim answers
	// idem.ErrSkipDefer, and the Store claims with an insert after all.
	claimSkipDefer
)

// claimAnswer is what a claim batch's reader made of its results.
type claimAnswer struct {
	res  *idem.ClaimResult
	next claimNext
}

func (a *claimAnswer) answer() *claimAnswer { return a }

// finish completes the claim p whose batch answered a, in tx, the claim's
// transaction.
func (a *claimAnswer) finish(ctx context.Context, st *statements, tx dbtx, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	switch a.next {
	case claimWaitForLock:
		return st.claimDeferredBounded(ctx, tx, p)
	case claimSkipDefer:
		return nil, idem.ErrSkipDefer
	default:
		return a.res, nil
	}
}

// claimReader reads the two results of one shape of claim batch, in order.
type claimReader interface {
	readFirst(br pgx.BatchResults) error
	readSecond(ctx context.Context, br pgx.BatchResults) error
	answer() *claimAnswer
}

// claimDeferredBounded is a deferred claim that waits for the key's lock,
// bounded by p.WaitTimeout: the batch [claimLock; claimRead] in tx.
func (st *statements) claimDeferredBounded(ctx context.Context, tx dbtx, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	e := &executor{db: tx, inTx: true, st: st}
	b := &pgx.Batch{}
	b.Queue(st.claimLock, p.Scope, p.Key, lockTimeout(p.WaitTimeout))
	b.Queue(st.claimRead, p.Scope, p.Key, pinnedNow(p.Now))
	r := &lockReader{p: p}
	if err := e.sendBounded(ctx, b, p.WaitTimeout, 0, r.readFirst, func(br pgx.BatchResults) error {
		return r.readSecond(ctx, br)
	}); err != nil {
		return nil, err
	}
	return r.finish(ctx, st, tx, p)
}

// claimBatch queues the claim's two statements on b, after what b already
// holds, and returns the reader of their results: set lock_timeout and
// insert, restore lock_timeout and read.
func (st *statements) claimBatch(b *pgx.Batch, p *idem.ClaimParams) claimReader {
	now := pinnedNow(p.Now)
	b.Queue(st.claimInsert, p.Scope, p.Key, p.Fingerprint[:], p.Token,
		p.LeaseDuration.Microseconds(), p.Retention.Microseconds(), now, lockTimeout(p.WaitTimeout))
	b.Queue(st.claimRead, p.Scope, p.Key, now)
	return &insertReader{p: p}
}

// deferredClaimBatch queues a deferred claim's two statements on b, after
// what b already holds, and returns the reader of their results: try the
// key's lock, and read.
func (st *statements) deferredClaimBatch(b *pgx.Batch, p *idem.ClaimParams) claimReader {
	b.Queue(st.claimTryLock, p.Scope, p.Key, pinnedNow(p.Now))
	b.Queue(st.claimReadLocked, p.Scope, p.Key)
	return &tryLockReader{p: p}
}

// insertReader reads [claimInsert; claimRead].
type insertReader struct {
	p        *idem.ClaimParams
	inserted bool
	// Set by the insert when it inserted.
	leaseExpiresAt, createdAt, expiresAt time.Time
	claimAnswer
}

func (r *insertReader) readFirst(br pgx.BatchResults) error {
	err := br.QueryRow().Scan(&r.leaseExpiresAt, &r.createdAt, &r.expiresAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil // a record exists: the read decides
	}
	r.inserted = err == nil
	return err
}

func (r *insertReader) readSecond(ctx context.Context, br pgx.BatchResults) error {
	if r.inserted {
		// The record is the one the insert wrote: every value is known.
		rows, err := openClaimRow(ctx, br)
		if err != nil {
			return err
		}
		if err := closeRows(ctx, rows); err != nil {
			return err
		}
		p := r.p
		created := r.createdAt.UTC()
		r.res = &idem.ClaimResult{Created: true, Now: created, Record: &idem.Record{
			Scope: p.Scope, Key: p.Key, Fingerprint: p.Fingerprint,
			Status: idem.StatusProcessing, Token: p.Token, Attempt: 1,
			LeaseExpiresAt: r.leaseExpiresAt.UTC(), CreatedAt: created, UpdatedAt: created,
			ExpiresAt: r.expiresAt.UTC(),
		}}
		return nil
	}
	rec, now, err := readClaimRow(ctx, br)
	if err != nil {
		return err
	}
	if rec == nil {
		return idem.ErrNotFound // the conflicting record vanished
	}
	r.res = &idem.ClaimResult{Record: rec, Now: now}
	return nil
}

// tryLockReader reads a deferred claim's [claimTryLock; claimReadLocked].
type tryLockReader struct {
	p *idem.ClaimParams
	// locked is nil when claimTryLock saw a committed record and took no
	// lock, else whether the lock was granted.
	locked    *bool
	isolation string
	now       time.Time
	claimAnswer
}

func (r *tryLockReader) readFirst(br pgx.BatchResults) error {
	return br.QueryRow().Scan(&r.locked, &r.isolation, &r.now)
}

// readSecond reads claimReadLocked's result: the record, or no row when
// the key is free.
func (r *tryLockReader) readSecond(ctx context.Context, br pgx.BatchResults) error {
	rows, err := br.Query()
	if err != nil {
		return interpretError(ctx, err)
	}
	defer rows.Close()
	if r.locked != nil && !*r.locked {
		// Another transaction holds the lock: the read proves nothing.
		r.next = claimWaitForLock
		return closeRows(ctx, rows)
	}
	if !rows.Next() {
		if err := closeRows(ctx, rows); err != nil {
			return err
		}
		if r.locked == nil {
			return idem.ErrNotFound // the record claimTryLock saw was deleted since
		}
		r.claimAnswer = acquireFree(r.p, r.isolation, r.now) // with the lock, no row: the key is free
		return nil
	}
	rec, err := scanRecord(ctx, rows)
	if err != nil {
		return err
	}
	if err := closeRows(ctx, rows); err != nil {
		return err
	}
	r.res = &idem.ClaimResult{Record: rec, Created: false, Now: r.now.UTC()}
	return nil
}

// lockReader reads a bounded deferred claim's [claimLock; claimRead].
type lockReader struct {
	p         *idem.ClaimParams
	isolation string
	claimAnswer
}

func (r *lockReader) readFirst(br pgx.BatchResults) error {
	return br.QueryRow().Scan(&r.isolation)
}

func (r *lockReader) readSecond(ctx context.Context, br pgx.BatchResults) error {
	rec, now, err := readClaimRow(ctx, br)
	if err != nil {
		return err
	}
	if rec == nil {
		r.claimAnswer = acquireFree(r.p, r.isolation, now)
		return nil
	}
	r.res = &idem.ClaimResult{Record: rec, Created: false, Now: now}
	return nil
}

// openClaimRow runs claimRead's query and moves to its one row.
func openClaimRow(ctx context.Context, br pgx.BatchResults) (pgx.Rows, error) {
	rows, err := br.Query()
	if err != nil {
		return nil, interpretError(ctx, err)
	}
	if !rows.Next() {
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, interpretError(ctx, err)
		}
		return nil, fmt.Errorf("idem: postgres: claim read returned no row")
	}
	return rows, nil
}

// readClaimRow reads claimRead's one row: the record and the clock, or a
// nil record when its columns are NULL (no record for the key).
func readClaimRow(ctx context.Context, br pgx.BatchResults) (*idem.Record, time.Time, error) {
	rows, err := openClaimRow(ctx, br)
	if err != nil {
		return nil, time.Time{}, err
	}
	defer rows.Close()
	var now time.Time
	if rows.RawValues()[0] == nil {
		var dest [recordColumnCount + 1]any // nil destinations skip the NULL record columns
		dest[recordColumnCount] = &now
		if err := rows.Scan(dest[:]...); err != nil {
			return nil, time.Time{}, interpretError(ctx, err)
		}
		return nil, now, closeRows(ctx, rows)
	}
	rec, err := scanRecord(ctx, rows, &now)
	if err != nil {
		return nil, time.Time{}, err
	}
	return rec, now.UTC(), closeRows(ctx, rows)
}

// closeRows closes rows and reports the error that ended them.
func closeRows(ctx context.Context, rows pgx.Rows) error {
	rows.Close()
	if err := rows.Err(); err != nil {
		return interpretError(ctx, err)
	}
	return nil
}

// acquireFree acquires a deferred claim on a free key, at now: its lock is
// held, so nothing is written. Unless the snapshot may predate the lock
// (see claimLock): then the claim is skipped, and the Store inserts.
func acquireFree(p *idem.ClaimParams, isolation string, now time.Time) claimAnswer {
	if isolation != "read committed" {
		return claimAnswer{next: claimSkipDefer}
	}
	now = now.UTC().Truncate(time.Microsecond)
	return claimAnswer{res: &idem.ClaimResult{Created: true, Now: now, Record: &idem.Record{
		Scope: p.Scope, Key: p.Key, Fingerprint: p.Fingerprint,
		Status: idem.StatusProcessing, Token: p.Token, Attempt: 1,
		LeaseExpiresAt: now.Add(p.LeaseDuration.Truncate(time.Microsecond)), CreatedAt: now, UpdatedAt: now,
		ExpiresAt: now.Add(p.Retention.Truncate(time.Microsecond)),
	}}}
}

// Takeover replaces the record while it still carries p.Token and meets
// p.Condition, in one batch that bounds the wait for another transaction
// holding the record.
func (e *executor) Takeover(ctx context.Context, p *idem.TakeoverParams) error {
	if p.Attempt < 1 || p.Attempt > math.MaxInt32 {
		return fmt.Errorf("idem: postgres: attempt %d out of range", p.Attempt)
	}
	var retentionExpired, leaseExpired bool
	switch p.Condition {
	case idem.TakeoverRetentionExpired:
		retentionExpired = true
	case idem.TakeoverLeaseExpired:
		leaseExpired = true
	case idem.TakeoverReserved:
	default:
		return fmt.Errorf("idem: postgres: unknown takeover condition %d", p.Condition)
	}
	b := e.boundedBatch(p.WaitTimeout, e.st.takeover, p.Scope, p.Key, p.Token, p.NewToken, p.Fingerprint[:],
		int32(p.Attempt), p.LeaseDuration.Microseconds(), p.Retention.Microseconds(), pinnedNow(p.Now),
		retentionExpired, leaseExpired)
	var tag pgconn.CommandTag
	err := e.sendBounded(ctx, b, p.WaitTimeout, 1, func(br pgx.BatchResults) (err error) {
		tag, err = br.Exec()
		return err
	}, nil)
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrFenced
	}
	return nil
}

// Get reads a live record without locking it.
func (e *executor) Get(ctx context.Context, p *idem.GetParams) (*idem.Record, error) {
	return scanRecord(ctx, e.db.QueryRow(ctx, e.st.get, p.Scope, p.Key, pinnedNow(p.Now)))
}

// completeArgs returns the arguments of complete (and completeOrFail).
func completeArgs(p *idem.CompleteParams) ([]any, error) {
	code, header, body, err := responseArgs(p.Response)
	if err != nil {
		return nil, err
	}
	return []any{p.Scope, p.Key, p.Token, int16(p.Status),
		code, header, body, p.Retention.Microseconds(), pinnedNow(p.Now)}, nil
}

// responseArgs returns the stored forms of resp's status code, headers and
// body.
func responseArgs(resp *idem.Response) (code int32, header, body []byte, _ error) {
	if resp == nil {
		resp = &idem.Response{}
	}
	if resp.StatusCode < math.MinInt32 || resp.StatusCode > math.MaxInt32 {
		return 0, nil, nil, fmt.Errorf("idem: postgres: response status code %d out of range", resp.StatusCode)
	}
	header, err := codec.EncodeHeader(resp.Header)
	if err != nil {
		return 0, nil, nil, err
	}
	body = resp.Body
	if body == nil {
		body = []byte{} // pgx sends a nil slice as NULL; replay must give back an empty body
	}
	return int32(resp.StatusCode), header, body, nil
}

// completeInsertArgs returns the arguments of completeInsert.
func completeInsertArgs(p *idem.CompleteDeferredParams) ([]any, error) {
	code, header, body, err := responseArgs(p.Response)
	if err != nil {
		return nil, err
	}
	return []any{p.Scope, p.Key, p.Fingerprint[:], int16(p.Status), p.Token,
		p.LeaseExpiresAt.UTC().Truncate(time.Microsecond), code, header, body,
		p.CreatedAt.UTC().Truncate(time.Microsecond), p.Retention.Microseconds(), pinnedNow(p.Now)}, nil
}

// Complete stores the response while the record is processing and carries
// p.Token.
func (e *executor) Complete(ctx context.Context, p *idem.CompleteParams) error {
	args, err := completeArgs(p)
	if err != nil {
		return err
	}
	tag, err := e.db.Exec(ctx, e.st.complete, args...)
	if err != nil {
		return interpretError(ctx, err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrFenced
	}
	return nil
}

// Release deletes the record while it is processing and carries p.Token
// (and, with p.OnlyIfLeaseExpired, its lease has run out).
func (e *executor) Release(ctx context.Context, p *idem.ReleaseParams) error {
	tag, err := e.db.Exec(ctx, e.st.release, p.Scope, p.Key, p.Token, p.OnlyIfLeaseExpired, pinnedNow(p.Now))
	if err != nil {
		return interpretError(ctx, err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrFenced
	}
	return nil
}

// RenewLease pushes the lease out and sets the new token while the record is
// processing and carries p.Token (and, with p.OnlyIfExpired, its lease has
// run out), in one batch that bounds the wait for another transaction
// holding the record. The expiry it returns is the one stored, read back
// with RETURNING.
func (e *executor) RenewLease(ctx context.Context, p *idem.RenewLeaseParams) (time.Time, error) {
	b := e.boundedBatch(p.WaitTimeout, e.st.renewLease, p.Scope, p.Key, p.Token, p.NewToken,
		p.Duration.Microseconds(), pinnedNow(p.Now), p.OnlyIfExpired)
	var (
		leaseExpiresAt time.Time
		fenced         bool
	)
	err := e.sendBounded(ctx, b, p.WaitTimeout, 1, func(br pgx.BatchResults) error {
		err := br.QueryRow().Scan(&leaseExpiresAt)
		if errors.Is(err, pgx.ErrNoRows) {
			fenced = true
			return nil
		}
		return err
	}, nil)
	if err != nil {
		return time.Time{}, err
	}
	if fenced {
		return time.Time{}, idem.ErrFenced
	}
	return leaseExpiresAt.UTC(), nil
}

// ListStaleLeases reads up to p.Limit processing records whose lease ran out,
// oldest lease first, without locking them.
func (e *executor) ListStaleLeases(ctx context.Context, p *idem.ListStaleLeasesParams) ([]*idem.Record, time.Time, error) {
	if p.Limit < 1 {
		return nil, time.Time{}, fmt.Errorf("idem: postgres: limit %d must be at least 1", p.Limit)
	}
	rows, err := e.db.Query(ctx, e.st.listStaleLeases, pinnedNow(p.Now), int64(p.Limit))
	if err != nil {
		return nil, time.Time{}, interpretError(ctx, err)
	}
	defer rows.Close()
	var (
		recs []*idem.Record
		now  time.Time
	)
	for rows.Next() {
		if rows.RawValues()[0] == nil {
			// No stale lease: the one row holds NULL record columns and
			// the clock (see listStaleLeases). A nil destination skips a
			// column.
			dest := make([]any, len(rows.FieldDescriptions()))
			dest[len(dest)-1] = &now
			if err := rows.Scan(dest...); err != nil {
				return nil, time.Time{}, interpretError(ctx, err)
			}
			continue
		}
		rec, err := scanRecord(ctx, rows, &now)
		if err != nil {
			return nil, time.Time{}, err
		}
		recs = append(recs, rec)
	}
	if err := rows.Err(); err != nil {
		return nil, time.Time{}, interpretError(ctx, err)
	}
	return recs, now.UTC(), nil
}

// DeleteExpired deletes up to p.Limit records past their retention deadline,
// skipping rows other transactions hold locked.
func (e *executor) DeleteExpired(ctx context.Context, p *idem.DeleteExpiredParams) (int, error) {
	if p.Limit < 1 {
		return 0, fmt.Errorf("idem: postgres: limit %d must be at least 1", p.Limit)
	}
	tag, err := e.db.Exec(ctx, e.st.deleteExpired, pinnedNow(p.Now), int64(p.Limit))
	if err != nil {
		return 0, interpretError(ctx, err)
	}
	return int(tag.RowsAffected()), nil
}

// rollbackTimeout bounds the rollback of the transaction a bounded batch
// begins on the pool, after an error.
const rollbackTimeout = 5 * time.Second

// boundedBatch returns a batch that runs sql with its lock waits bounded by
// wait: save the caller's lock_timeout and set ours, sql, restore. On the
// pool, the batch begins a transaction, which sendBounded commits in a
// second round trip (see queries.go).
func (e *executor) boundedBatch(wait time.Duration, sql string, args ...any) *pgx.Batch {
	b := &pgx.Batch{}
	if !e.inTx {
		b.BeginTx(pgx.TxOptions{})
	}
	b.Queue(setLockTimeout, lockTimeout(wait))
	b.Queue(sql, args...)
	b.Queue(restoreLockTimeout)
	return b
}

// execRestore reads the result of restoreLockTimeout.
func execRestore(ctx context.Context, br pgx.BatchResults) error {
	_, err := br.Exec()
	return interpretError(ctx, err)
}

// sendBounded sends b, made by boundedBatch with wait (after nil, sets 1)
// or by claimBatch (sets 0), and reads its results: read reads the
// bounded statement's and returns the driver's error; after reads those of
// every statement queued after it, the restore first, and returns its
// errors already interpreted; nil means the restore of boundedBatch alone.
// A lock timeout of the bounded statement is returned as an
// *idem.InProgressError. On the pool, it commits the batch's transaction,
// or rolls it back after an error.
func (e *executor) sendBounded(ctx context.Context, b *pgx.Batch, wait time.Duration, sets int, read, after func(pgx.BatchResults) error) error {
	br := e.db.SendBatch(ctx, b)
	err := e.readBounded(ctx, br, wait, sets, read, after)
	if closeErr := br.Close(); err == nil && closeErr != nil {
		err = interpretError(ctx, closeErr)
	}
	if e.inTx {
		return err
	}
	tx := br.Tx()
	if err != nil {
		// Not bound to ctx: after a lock timeout the connection is sound
		// and goes back to the pool. If the rollback fails, pgx closes the
		// connection (as it already has if ctx ended), which ends the
		// transaction just as well.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
		defer cancel()
		_ = tx.Rollback(rctx)
		return err
	}
	return interpretError(ctx, tx.Commit(ctx))
}

// readBounded reads the results of a bounded batch in order: BEGIN on the
// pool, then sets statements before the bounded one (1 for setLockTimeout,
// 0 for the claim, whose insert sets lock_timeout itself); after is as for
// sendBounded.
func (e *executor) readBounded(ctx context.Context, br pgx.BatchResults, wait time.Duration, sets int, read, after func(pgx.BatchResults) error) error {
	n := sets
	if !e.inTx {
		n++ // begin
	}
	for range n {
		if _, err := br.Exec(); err != nil {
			return interpretError(ctx, err)
		}
	}
	if err := read(br); err != nil {
		if isPgCode(err, codeLockNotAvailable) {
			// Another transaction held the record past wait. Inside a
			// caller's transaction the error aborted it; outside one,
			// the batch's own transaction is rolled back and nothing is
			// left behind.
			return &idem.InProgressError{RetryAfter: wait, TxAborted: e.inTx, Cause: err}
		}
		return interpretError(ctx, err)
	}
	if after == nil {
		return execRestore(ctx, br)
	}
	return after(br)
}

// scanRecord scans one row of recordColumns followed by extra destinations;
// ctx is the context the row was queried with.
func scanRecord(ctx context.Context, row pgx.Row, extra ...any) (*idem.Record, error) {
	var (
		rec            idem.Record
		fingerprint    []byte
		status         int16
		attempt        int32
		responseStatus *int32
		header, body   []byte
		completedAt    *time.Time
	)
	dest := append([]any{
		&rec.Scope, &rec.Key, &fingerprint, &status, &rec.Token, &attempt, &rec.LeaseExpiresAt,
		&responseStatus, &header, &body, &rec.CreatedAt, &rec.UpdatedAt, &completedAt, &rec.ExpiresAt,
	}, extra...)
	if err := row.Scan(dest...); err != nil {
		return nil, interpretError(ctx, err)
	}
	if len(fingerprint) != len(rec.Fingerprint) {
		return nil, &idem.CorruptRecordError{Reason: fmt.Sprintf("its fingerprint has %d bytes, want %d", len(fingerprint), len(rec.Fingerprint))}
	}
	copy(rec.Fingerprint[:], fingerprint)
	rec.Status = idem.Status(status)
	rec.Attempt = int(attempt)
	rec.LeaseExpiresAt = rec.LeaseExpiresAt.UTC()
	rec.CreatedAt = rec.CreatedAt.UTC()
	rec.UpdatedAt = rec.UpdatedAt.UTC()
	rec.ExpiresAt = rec.ExpiresAt.UTC()
	if completedAt != nil {
		rec.CompletedAt = completedAt.UTC()
	}
	if rec.Status.Final() {
		h, err := codec.DecodeHeader(header)
		if err != nil {
			// The decoder's message may quote stored bytes: kept as the cause only.
			return nil, &idem.CorruptRecordError{Reason: "its response headers do not decode", Cause: err}
		}
		if body == nil {
			body = []byte{}
		}
		rec.Response = &idem.Response{Body: body, Header: h}
		if responseStatus != nil {
			rec.Response.StatusCode = int(*responseStatus)
		}
	}
	return &rec, nil
}

// pinnedNow returns the pinned clock as a parameter: NULL for the database's
// clock, otherwise the time in UTC truncated to the microseconds PostgreSQL
// stores. Truncating here keeps both protocols alike: the binary encoding
// truncates while the server, parsing the simple protocol's text, rounds.
func pinnedNow(now *time.Time) any {
	if now == nil {
		return nil
	}
	return now.UTC().Truncate(time.Microsecond)
}

// lockTimeout renders d as a lock_timeout value in whole milliseconds,
// rounded up and at least 1ms: lock_timeout = 0 would wait forever.
func lockTimeout(d time.Duration) string {
	ms := (d + time.Millisecond - 1) / time.Millisecond
	ms = min(max(ms, 1), math.MaxInt32)
	return strconv.FormatInt(int64(ms), 10) + "ms"
}
