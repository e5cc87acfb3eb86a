package mysql

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/codec"
)

// Option configures [New].
type Option func(*Dialect)

// WithOptimisticDo makes [idem.Store.Do] claim a free key without writing
// or locking anything: its transaction begins with a plain read of the
// key's record, fn runs, and the completion inserts the finished record and
// commits. One row version where the default claim writes two (the
// processing record's insert, then the completion's update of its indexed
// status and deadline), and no row lock: on MariaDB, through a pool of
// [NewConnector], Do's statements are those of the business transaction
// plus that read and that insert, in the same round trips.
//
// The price is paid when two calls of one key overlap: both run fn, and the
// one whose insert comes second waits for the first to end (at most
// Config.WaitTimeout, then an *[idem.InProgressError]), is rolled back, fn's
// writes with it, when the first commits, and replays the first's response
// (Do's next try; it counts against Config.MaxTxRetries). Without the
// option the second waits before fn instead. Exactly one execution of fn's
// writes commits either way: the primary key admits one record, and the
// record commits with the writes. fn must keep to what Do already asks of
// it (writes through its transaction only, safe to run again, since Do
// retries a deadlock), and gains nothing from the option when the same
// key is usually claimed by several calls at once.
//
// Only Do changes. [idem.Store.ClaimTx], whose caller may do more than
// write, [idem.Store.Claim] and the lease still write the processing
// record first; a Do that finds such a record (committed) answers from it
// as without the option, and one that races an uncommitted one loses to it
// as above.
func WithOptimisticDo() Option {
	return func(d *Dialect) { d.optimistic = true }
}

// optimisticRead is the claim of an optimistic Do: the key's record by
// primary key as a plain consistent read, which takes no lock (a locking
// read of an absent key would take a gap lock, which blocks the inserts of
// neighbouring keys), and the statement's clock. As the first read of the
// transaction it fixes the REPEATABLE READ snapshot, so nothing older is
// seen. The one-row derived table on the preserved side of the LEFT JOIN
// gives the clock when the key is free: a row of NULL record columns.
//
// Arguments: now, scope, key.
const optimisticRead = `SELECT ` + recordColumns + `, c.ts
FROM (SELECT ` + now + ` AS ts) c
LEFT JOIN idempotency_keys ON scope = ? AND idempotency_key = ?`

// optimisticReadLive is optimisticRead on the server's clock, for a Store
// without Config.Now: the same answer without the COALESCE and CAST of a
// NULL argument, which the text protocol of interpolateParams has the
// server parse and evaluate on every claim.
//
// Arguments: scope, key.
const optimisticReadLive = `SELECT ` + recordColumns + `, c.ts
FROM (SELECT UTC_TIMESTAMP(6) AS ts) c
LEFT JOIN idempotency_keys ON scope = ? AND idempotency_key = ?`

// completeInsert is the completion of an optimistic claim: the finished
// record, every column, in one row version. When the key's record exists,
// or another transaction has inserted it and then commits, it fails with
// 1062 (ER_DUP_ENTRY); while that transaction is open it waits, bounded by
// the lock wait prefix.
//
// Arguments: scope, key, fingerprint, status, token, lease expiry, response
// status, headers, body, created at, now, now, now, retention µs.
const completeInsert = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at)
VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ` + now + `, ` + now + `,
	DATE_ADD(` + now + `, INTERVAL ? MICROSECOND))`

// completeInsertLive is completeInsert on the server's clock (see
// optimisticReadLive), evaluated once for the three columns: MariaDB and
// MySQL evaluate UTC_TIMESTAMP once per statement.
//
// Arguments: those of completeInsert without the three nows.
const completeInsertLive = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at)
VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6),
	DATE_ADD(UTC_TIMESTAMP(6), INTERVAL ? MICROSECOND))`

// completeInsertCommit is completeInsert then COMMIT in one compound
// statement (MariaDB, through NewConnector): the server stops at the
// insert's error, so a duplicate commits nothing and leaves the
// transaction open for the Store to roll back.
func completeInsertCommit(prefix, insert string) string {
	return "BEGIN NOT ATOMIC\n" + prefix + insert + ";\nCOMMIT;\nEND"
}

// insertCommitText is a completeInsertCommit text and what it was built of.
type insertCommitText struct {
	prefix, insert, text string
}

// completeInsertCommitFor returns completeInsertCommit(prefix, insert),
// built once per lock wait bound and clock form rather than per call.
func (d *Dialect) completeInsertCommitFor(prefix, insert string) string {
	if c := d.insertCommitSQL.Load(); c != nil && c.prefix == prefix && c.insert == insert {
		return c.text
	}
	c := &insertCommitText{prefix: prefix, insert: insert, text: completeInsertCommit(prefix, insert)}
	d.insertCommitSQL.Store(c)
	return c.text
}

var _ idem.OptimisticClaimer[*sql.Tx] = (*Dialect)(nil)

// BeginClaimOptimistic implements [idem.OptimisticClaimer] for a Dialect
// made with [WithOptimisticDo]; without it, it answers [idem.ErrSkipDefer]
// and begins nothing. Through a pool of [NewConnector], on MariaDB, START
// TRANSACTION travels with the read: one round trip.
func (d *Dialect) BeginClaimOptimistic(ctx context.Context, p *idem.ClaimParams) (*sql.Tx, *idem.ClaimResult, error) {
	if !d.optimistic {
		return nil, nil, idem.ErrSkipDefer
	}
	srv, err := d.serverInfo(ctx, d.db)
	if err != nil {
		return nil, nil, interpretError(err)
	}
	read, args := optimisticReadLive, []any{[]byte(p.Scope), []byte(p.Key)}
	if p.Now != nil {
		read, args = optimisticRead, []any{pinned(p.Now), []byte(p.Scope), []byte(p.Key)}
	}
	bctx, qctx := ctx, ctx
	if d.isPiped() && srv.mariaDB {
		bctx = context.WithValue(ctx, lazyBeginKey{}, true)
		qctx = context.WithValue(bctx, firstStatementKey{}, beginWith(read))
	}
	tx, err := d.db.BeginTx(bctx, nil)
	if err != nil {
		return nil, nil, interpretError(err)
	}
	var clock dbTime
	rec, err := scanRecordOrNull(tx.QueryRowContext(qctx, read, args...), &clock)
	if err != nil {
		return tx, nil, interpretError(err)
	}
	at := clock.Time
	if p.Now != nil {
		at = truncate(*p.Now)
	}
	if rec != nil {
		return tx, &idem.ClaimResult{Record: rec, Now: at}, nil
	}
	// The record the completion will insert, with the times the insert
	// statements of Claim would compute from the same clock (DATE_ADD of
	// whole microseconds is exact).
	return tx, &idem.ClaimResult{
		Record: &idem.Record{
			Scope: p.Scope, Key: p.Key, Fingerprint: p.Fingerprint,
			Status: idem.StatusProcessing, Token: p.Token, Attempt: 1,
			LeaseExpiresAt: at.Add(p.LeaseDuration.Truncate(time.Microsecond)),
			CreatedAt:      at, UpdatedAt: at,
			ExpiresAt: at.Add(p.Retention.Truncate(time.Microsecond)),
		},
		Created: true,
		Now:     at,
	}, nil
}

// CompleteOptimisticCommit implements [idem.OptimisticClaimer]: the
// finished record's insert and the commit, in one compound statement on
// MariaDB through a pool of [NewConnector] (without ctx's cancellation, as
// CompleteCommit), apart otherwise. A duplicate key is [idem.ErrFenced]; a
// wait past p.WaitTimeout for the transaction that holds the key is an
// *[idem.InProgressError]. Neither commits anything.
func (d *Dialect) CompleteOptimisticCommit(ctx context.Context, tx *sql.Tx, p *idem.CompleteDeferredParams) error {
	if tx == nil {
		return errNilTx
	}
	stmt, args, err := completeInsertArgs(p)
	if err != nil {
		return err
	}
	srv, err := d.serverInfo(ctx, d.db)
	if err != nil {
		return interpretError(err)
	}
	secs := lockWaitSeconds(p.WaitTimeout)
	if srv.mariaDB && d.isPiped() {
		cctx := context.WithValue(context.WithoutCancel(ctx), commitsKey{}, true)
		_, err = tx.ExecContext(cctx, d.completeInsertCommitFor(d.waitPrefixFor(secs), stmt), args...)
		if err == nil {
			_ = tx.Commit() // ends tx on the client only: the statement committed
			return nil
		}
		if !errors.Is(err, errNoCompound) {
			return optimisticInsertError(err, p.WaitTimeout)
		}
	}
	insert := func(h dbtx, prefix string) error {
		_, err := h.ExecContext(ctx, prefix+stmt, args...)
		return err
	}
	if srv.mariaDB {
		err = insert(tx, d.waitPrefixFor(secs))
	} else {
		err = withSessionLockWait(ctx, tx, nil, secs, insert)
	}
	if err != nil {
		return optimisticInsertError(err, p.WaitTimeout)
	}
	return d.Commit(ctx, tx)
}

// optimisticInsertError classifies the error of completeInsert: a
// duplicate is a concurrent claimer's committed record, a lock wait
// timeout one still being written. The duplicate's message quotes the key
// and is dropped.
func optimisticInsertError(err error, wait time.Duration) error {
	switch {
	case isDupEntry(err):
		return idem.ErrFenced
	case isLockWaitTimeout(err):
		return &idem.InProgressError{RetryAfter: max(wait, 0), Cause: err}
	}
	return interpretError(err)
}

// completeInsertArgs returns the completion's statement for p,
// completeInsert or completeInsertLive, and its arguments. An empty body
// is stored as an empty value, not NULL, as by Complete.
func completeInsertArgs(p *idem.CompleteDeferredParams) (string, []any, error) {
	resp := p.Response
	if resp == nil {
		resp = &idem.Response{}
	}
	header, err := codec.EncodeHeader(resp.Header)
	if err != nil {
		return "", nil, err
	}
	body := resp.Body
	if body == nil {
		body = []byte{}
	}
	if p.Now == nil {
		return completeInsertLive, []any{
			[]byte(p.Scope), []byte(p.Key), p.Fingerprint[:], p.Status, p.Token, p.LeaseExpiresAt.UTC(),
			resp.StatusCode, header, body, p.CreatedAt.UTC(), p.Retention.Microseconds(),
		}, nil
	}
	now := pinned(p.Now)
	return completeInsert, []any{
		[]byte(p.Scope), []byte(p.Key), p.Fingerprint[:], p.Status, p.Token, p.LeaseExpiresAt.UTC(),
		resp.StatusCode, header, body, p.CreatedAt.UTC(), now, now, now, p.Retention.Microseconds(),
	}, nil
}
