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
)

// Dialect is the PostgreSQL dialect over a pgx connection pool. Create it
// with [New]; it is safe for concurrent use.
type Dialect struct {
	pool *pgxpool.Pool
}

var _ idem.Dialect[pgx.Tx] = (*Dialect)(nil)

// New returns a dialect that runs on pool. The pool's search_path decides
// which schema's idempotency_keys table is used; pool must not be nil.
func New(pool *pgxpool.Pool) *Dialect {
	return &Dialect{pool: pool}
}

// Name returns "postgres".
func (d *Dialect) Name() string { return "postgres" }

// DB returns an Executor that runs each statement on the pool, outside any
// transaction.
func (d *Dialect) DB() idem.Executor { return &executor{db: d.pool} }

// Tx returns an Executor that runs inside tx. It never commits or rolls back
// tx.
func (d *Dialect) Tx(tx pgx.Tx) idem.Executor { return &executor{db: tx, inTx: true} }

// Begin starts a transaction on the pool with the server's default isolation
// level (READ COMMITTED unless configured otherwise).
func (d *Dialect) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := d.pool.Begin(ctx)
	if err != nil {
		return nil, interpretError(err)
	}
	return tx, nil
}

// Commit commits tx. A serialization failure at commit matches
// [idem.ErrRetryable]; a lost connection matches [idem.ErrStoreUnavailable].
func (d *Dialect) Commit(ctx context.Context, tx pgx.Tx) error {
	return interpretError(tx.Commit(ctx))
}

// Rollback rolls tx back; rolling back a committed or rolled back
// transaction returns nil.
func (d *Dialect) Rollback(ctx context.Context, tx pgx.Tx) error {
	if err := tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return interpretError(err)
	}
	return nil
}

// dbtx is what the executor needs from a pool, a transaction or a single
// connection.
type dbtx interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
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
	// inTx is true inside a caller's transaction, which a claim wait timeout
	// aborts.
	inTx bool
}

var _ idem.Executor = (*executor)(nil)

// Claim runs the claim batch in one round trip; see queries.go.
func (e *executor) Claim(ctx context.Context, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	now := pinnedNow(p.Now)
	b := &pgx.Batch{}
	b.Queue(claimSaveLockTimeout)
	b.Queue(claimSetLockTimeout, lockTimeout(p.WaitTimeout))
	b.Queue(claimInsert, p.Scope, p.Key, p.Fingerprint[:], p.Token,
		p.LeaseDuration.Microseconds(), p.Retention.Microseconds(), now)
	b.Queue(claimRestoreLockTimeout)
	b.Queue(claimRead, p.Scope, p.Key, now)

	br := e.db.SendBatch(ctx, b)
	res, err := e.readClaim(br, p)
	if closeErr := br.Close(); err == nil && closeErr != nil {
		return nil, interpretError(closeErr)
	}
	return res, err
}

// readClaim reads the results of the claim batch in order.
func (e *executor) readClaim(br pgx.BatchResults, p *idem.ClaimParams) (*idem.ClaimResult, error) {
	for range 2 { // save and set lock_timeout
		if _, err := br.Exec(); err != nil {
			return nil, interpretError(err)
		}
	}

	created := true
	var token int64
	switch err := br.QueryRow().Scan(&token); {
	case errors.Is(err, pgx.ErrNoRows):
		created = false
	case isPgCode(err, codeLockNotAvailable):
		// The holder did not finish within WaitTimeout. Inside a caller's
		// transaction the error aborted it; outside one, the batch's
		// implicit transaction rolled back and nothing is left behind.
		return nil, &idem.InProgressError{RetryAfter: p.WaitTimeout, TxAborted: e.inTx}
	case err != nil:
		return nil, interpretError(err)
	}

	if _, err := br.Exec(); err != nil { // restore lock_timeout
		return nil, interpretError(err)
	}

	var now time.Time
	rec, err := scanRecord(br.QueryRow(), &now)
	if err != nil {
		return nil, err
	}
	return &idem.ClaimResult{Record: rec, Created: created, Now: now.UTC()}, nil
}

// Takeover replaces the record while it still carries p.Token.
func (e *executor) Takeover(ctx context.Context, p *idem.TakeoverParams) error {
	if p.Attempt < 1 || p.Attempt > math.MaxInt32 {
		return fmt.Errorf("idem: postgres: attempt %d out of range", p.Attempt)
	}
	tag, err := e.db.Exec(ctx, takeover, p.Scope, p.Key, p.Token, p.NewToken, p.Fingerprint[:],
		int32(p.Attempt), p.LeaseDuration.Microseconds(), p.Retention.Microseconds(), pinnedNow(p.Now))
	if err != nil {
		return interpretError(err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrFenced
	}
	return nil
}

// Get reads a live record without locking it.
func (e *executor) Get(ctx context.Context, p *idem.GetParams) (*idem.Record, error) {
	return scanRecord(e.db.QueryRow(ctx, get, p.Scope, p.Key, pinnedNow(p.Now)))
}

// Complete stores the response while the record is processing and carries
// p.Token.
func (e *executor) Complete(ctx context.Context, p *idem.CompleteParams) error {
	resp := p.Response
	if resp == nil {
		resp = &idem.Response{}
	}
	if resp.StatusCode < math.MinInt32 || resp.StatusCode > math.MaxInt32 {
		return fmt.Errorf("idem: postgres: response status code %d out of range", resp.StatusCode)
	}
	header, err := codec.EncodeHeader(resp.Header)
	if err != nil {
		return err
	}
	body := resp.Body
	if body == nil {
		body = []byte{} // pgx sends a nil slice as NULL; replay must give back an empty body
	}
	tag, err := e.db.Exec(ctx, complete, p.Scope, p.Key, p.Token, int16(p.Status),
		int32(resp.StatusCode), header, body, p.Retention.Microseconds(), pinnedNow(p.Now))
	if err != nil {
		return interpretError(err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrFenced
	}
	return nil
}

// Release deletes the record while it is processing and carries p.Token.
func (e *executor) Release(ctx context.Context, p *idem.ReleaseParams) error {
	tag, err := e.db.Exec(ctx, release, p.Scope, p.Key, p.Token)
	if err != nil {
		return interpretError(err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrFenced
	}
	return nil
}

// scanRecord scans one row of recordColumns followed by extra destinations.
func scanRecord(row pgx.Row, extra ...any) (*idem.Record, error) {
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
		return nil, interpretError(err)
	}
	if len(fingerprint) != len(rec.Fingerprint) {
		return nil, fmt.Errorf("idem: postgres: stored fingerprint has %d bytes, want %d", len(fingerprint), len(rec.Fingerprint))
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
			return nil, err
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
