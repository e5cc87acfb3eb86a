package postgres

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemstore/idem"
)

var (
	_ idem.TxPipeliner[pgx.Tx]         = (*Dialect)(nil)
	_ idem.DeferredTxPipeliner[pgx.Tx] = (*Dialect)(nil)
)

// BeginClaim begins a transaction and claims p's key in it in one round
// trip: the claim batch of the Executor's Claim with BEGIN queued first. It
// implements [idem.TxPipeliner] for [idem.Store.Do]. The transaction it
// returns holds a connection of the pool until it ends (by Commit, Rollback
// or CompleteCommit); it is open even after an error once BEGIN ran; when
// the batch failed before, it is closed and its Rollback returns
// pgx.ErrTxClosed, which [Dialect.Rollback] ignores.
func (d *Dialect) BeginClaim(ctx context.Context, p *idem.ClaimParams) (pgx.Tx, *idem.ClaimResult, error) {
	return d.beginClaim(ctx, p, d.st.claimBatch)
}

// BeginClaimDeferred is [Dialect.BeginClaim] with the batch of
// [Dialect.ClaimDeferred]: BEGIN, the key's lock tried, the record read.
// It implements [idem.DeferredTxPipeliner]. With [idem.ErrSkipDefer] the
// transaction it returns is open and usable.
func (d *Dialect) BeginClaimDeferred(ctx context.Context, p *idem.ClaimParams) (pgx.Tx, *idem.ClaimResult, error) {
	return d.beginClaim(ctx, p, d.st.deferredClaimBatch)
}

// beginClaim sends BEGIN and the claim statements queue adds, in one batch
// on a connection of its own, and finishes the claim in the transaction.
func (d *Dialect) beginClaim(ctx context.Context, p *idem.ClaimParams, queue func(*pgx.Batch, *idem.ClaimParams) claimReader) (pgx.Tx, *idem.ClaimResult, error) {
	if d.err != nil {
		return closedTx{}, nil, d.err
	}
	conn, err := d.pool.Acquire(ctx)
	if err != nil {
		return closedTx{}, nil, interpretError(ctx, err)
	}
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	r := queue(b, p)
	br := conn.Conn().SendBatch(ctx, b)
	tx := &pipeTx{tx: br.Tx(), conn: conn}
	e := &executor{db: conn.Conn(), st: d.st} // inTx false: readBounded reads BEGIN first
	err = e.readBounded(ctx, br, p.WaitTimeout, 0, r.readFirst, func(br pgx.BatchResults) error {
		return r.readSecond(ctx, br)
	})
	if closeErr := br.Close(); err == nil && closeErr != nil {
		err = interpretError(ctx, closeErr)
	}
	var res *idem.ClaimResult
	if err == nil {
		// A held lock: one more round trip, on this transaction only.
		res, err = r.answer().finish(ctx, d.st, tx, p)
	}
	if err != nil {
		if inProgress, ok := errors.AsType[*idem.InProgressError](err); ok {
			inProgress.TxAborted = true // our transaction, left open and aborted
		}
		return tx, nil, err
	}
	return tx, res, nil
}

// CompleteCommit stores the response and commits tx in one round trip: the
// batch [completeOrFail; COMMIT]. A batch runs every statement it can, and
// COMMIT would commit even an UPDATE that matched no row, so completeOrFail
// raises an error instead (division_by_zero, 22012), which makes the server
// skip the COMMIT and leaves the transaction aborted; CompleteCommit then
// rolls it back, the caller's writes included, and returns [idem.ErrFenced].
// A tx not begun by BeginClaim is completed and committed in two round trips.
func (d *Dialect) CompleteCommit(ctx context.Context, tx pgx.Tx, p *idem.CompleteParams) error {
	if d.err != nil {
		return d.err
	}
	args, err := completeArgs(p)
	if err != nil {
		return err
	}
	return d.completeCommit(ctx, tx, d.st.completeOrFail, args, codeDivisionByZero, func() error {
		return d.Tx(tx).Complete(ctx, p)
	})
}

// CompleteDeferredCommit is [Dialect.CompleteCommit] for a deferred claim:
// the batch [completeInsert; COMMIT]. A record that exists regardless is a
// unique violation (23505), which aborts the transaction and skips the
// COMMIT; it returns [idem.ErrFenced], all rolled back. It implements
// [idem.DeferredTxPipeliner].
func (d *Dialect) CompleteDeferredCommit(ctx context.Context, tx pgx.Tx, p *idem.CompleteDeferredParams) error {
	if d.err != nil {
		return d.err
	}
	args, err := completeInsertArgs(p)
	if err != nil {
		return err
	}
	return d.completeCommit(ctx, tx, d.st.completeInsert, args, codeUniqueViolation, func() error {
		return d.CompleteDeferred(ctx, tx, p)
	})
}

// completeCommit sends the batch [query; COMMIT] on tx, a transaction of
// beginClaim, and reports fenced when query fails with SQLSTATE fencedCode;
// on another tx it runs unpiped (then Commit), in two round trips.
func (d *Dialect) completeCommit(ctx context.Context, tx pgx.Tx, query string, args []any, fencedCode string, unpiped func() error) error {
	pt, ok := tx.(*pipeTx)
	if !ok {
		if err := unpiped(); err != nil {
			return err
		}
		return d.Commit(ctx, tx)
	}
	if pt.done {
		return interpretError(ctx, pgx.ErrTxClosed)
	}
	b := &pgx.Batch{}
	b.Queue(query, args...)
	b.Queue("COMMIT")
	br := pt.tx.SendBatch(ctx, b)
	_, err := br.Exec()
	fenced := err != nil && isPgCode(err, fencedCode)
	var tag pgconn.CommandTag
	if err == nil {
		tag, err = br.Exec()
	}
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	if err == nil && tag.String() == "ROLLBACK" {
		err = pgx.ErrTxCommitRollback
	}
	if err != nil {
		_ = d.Rollback(context.WithoutCancel(ctx), pt) // also releases the connection
		if fenced {
			return idem.ErrFenced
		}
		return interpretError(ctx, err)
	}
	// COMMIT ran on the server; pgx's transaction does not know, so it is
	// never used again, and the connection, idle now, goes back to the pool.
	pt.finish()
	return nil
}

// pipeTx is the transaction BeginClaim returns: pgx's transaction on a
// connection BeginClaim acquired, which it releases when the transaction
// ends, by Commit, Rollback or CompleteCommit. After CompleteCommit every
// method returns pgx.ErrTxClosed, like a committed pgx transaction.
type pipeTx struct {
	tx   pgx.Tx
	conn *pgxpool.Conn
	done bool // committed by CompleteCommit, or ended and released
}

var _ pgx.Tx = (*pipeTx)(nil)

func (t *pipeTx) finish() {
	t.done = true
	if t.conn != nil {
		t.conn.Release()
		t.conn = nil
	}
}

func (t *pipeTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.done {
		return nil, pgx.ErrTxClosed
	}
	return t.tx.Begin(ctx)
}

func (t *pipeTx) Commit(ctx context.Context) error {
	if t.done {
		return pgx.ErrTxClosed
	}
	defer t.finish()
	return t.tx.Commit(ctx)
}

func (t *pipeTx) Rollback(ctx context.Context) error {
	if t.done {
		return pgx.ErrTxClosed
	}
	defer t.finish()
	return t.tx.Rollback(ctx)
}

func (t *pipeTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if t.done {
		return 0, pgx.ErrTxClosed
	}
	return t.tx.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (t *pipeTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.done {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return t.tx.SendBatch(ctx, b)
}

func (t *pipeTx) LargeObjects() pgx.LargeObjects {
	if t.done {
		return closedTx{}.LargeObjects()
	}
	return t.tx.LargeObjects()
}

func (t *pipeTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.done {
		return nil, pgx.ErrTxClosed
	}
	return t.tx.Prepare(ctx, name, sql)
}

func (t *pipeTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.done {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return t.tx.Exec(ctx, sql, args...)
}

func (t *pipeTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.done {
		return nil, pgx.ErrTxClosed
	}
	return t.tx.Query(ctx, sql, args...)
}

func (t *pipeTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.done {
		return errRow{pgx.ErrTxClosed}
	}
	return t.tx.QueryRow(ctx, sql, args...)
}

func (t *pipeTx) Conn() *pgx.Conn {
	if t.done {
		return nil
	}
	return t.tx.Conn()
}

// closedTx is a transaction that never began: BeginClaim's answer when it
// could not acquire a connection.
type closedTx struct{}

func (closedTx) Begin(context.Context) (pgx.Tx, error) { return nil, pgx.ErrTxClosed }
func (closedTx) Commit(context.Context) error          { return pgx.ErrTxClosed }
func (closedTx) Rollback(context.Context) error        { return pgx.ErrTxClosed }
func (closedTx) CopyFrom(context.Context, pgx.Identifier, []string, pgx.CopyFromSource) (int64, error) {
	return 0, pgx.ErrTxClosed
}

func (closedTx) SendBatch(_ context.Context, b *pgx.Batch) pgx.BatchResults {
	return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
}
func (closedTx) LargeObjects() pgx.LargeObjects { return pgx.LargeObjects{} }
func (closedTx) Prepare(context.Context, string, string) (*pgconn.StatementDescription, error) {
	return nil, pgx.ErrTxClosed
}

func (closedTx) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	return pgconn.CommandTag{}, pgx.ErrTxClosed
}
func (closedTx) Query(context.Context, string, ...any) (pgx.Rows, error) { return nil, pgx.ErrTxClosed }
func (closedTx) QueryRow(context.Context, string, ...any) pgx.Row        { return errRow{pgx.ErrTxClosed} }
func (closedTx) Conn() *pgx.Conn                                         { return nil }

// errRow is a pgx.Row whose Scan returns err.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }
