package mysql

import (
	"context"
	"database/sql"
	"errors"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/idemstore/idem"
)

var _ idem.TxPipeliner[*sql.Tx] = (*Dialect)(nil)

// BeginClaim implements idem.TxPipeliner: it begins a transaction as Begin
// does and claims the key in it, as Tx(tx).Claim does. On a pool opened
// with NewConnector, on MariaDB, START TRANSACTION and the claim's INSERT
// travel in one compound statement (see beginWith): one round trip. On any
// other pool the two are sent apart, as Store.Do would send them without
// this method.
//
// With an error the transaction, when it was begun, is returned open, for
// the caller to roll back; when it could not be begun, nil, whose Rollback
// fails harmlessly.
func (d *Dialect) BeginClaim(ctx context.Context, p *idem.ClaimParams) (*sql.Tx, *idem.ClaimResult, error) {
	bctx := ctx
	if d.isPiped() {
		bctx = context.WithValue(ctx, lazyBeginKey{}, true)
	}
	tx, err := d.db.BeginTx(bctx, nil)
	if err != nil {
		return nil, nil, interpretError(err)
	}
	res, err := d.Tx(tx).Claim(bctx, p)
	return tx, res, err
}

// CompleteCommit implements idem.TxPipeliner: Complete(p) in tx, then the
// commit of tx. On a pool opened with NewConnector, on MariaDB, both travel
// in one compound statement (completeCommit): one round trip, and a
// completion that matches no row raises an error instead of committing, so
// that nothing commits and ErrFenced is returned. On any other pool, and for
// a completion too large to send as text, the two are sent apart.
//
// The compound statement runs without ctx's cancellation, like Commit: a
// cancellation in flight would close the connection and leave the commit's
// outcome unknown.
func (d *Dialect) CompleteCommit(ctx context.Context, tx *sql.Tx, p *idem.CompleteParams) error {
	if tx == nil {
		return errNilTx
	}
	if srv := d.server.Load(); d.isPiped() && srv != nil && srv.mariaDB {
		args, err := completeArgs(p)
		if err != nil {
			return err
		}
		cctx := context.WithValue(context.WithoutCancel(ctx), commitsKey{}, true)
		_, err = tx.ExecContext(cctx, completeCommit, args...)
		switch {
		case err == nil:
			// Committed. Commit only ends tx on the client (pipeTx sends
			// nothing); if database/sql has ended it already, as after a
			// cancellation, its ROLLBACK after the COMMIT changed nothing.
			_ = tx.Commit()
			return nil
		case isCompleteFenced(err):
			return idem.ErrFenced
		case !errors.Is(err, errNoCompound):
			return interpretError(err)
		}
	}
	if err := d.Tx(tx).Complete(ctx, p); err != nil {
		return err
	}
	return d.Commit(ctx, tx)
}

// isPiped reports whether the pool was opened with NewConnector.
func (d *Dialect) isPiped() bool {
	d.pipedOnce.Do(func() { _, d.piped = d.db.Driver().(pipeDriver) })
	return d.piped
}

// isCompleteFenced reports whether err is completeCommit's own SIGNAL.
func isCompleteFenced(err error) bool {
	var myErr *gomysql.MySQLError
	return errors.As(err, &myErr) && myErr.Number == erSignalException && myErr.Message == completeFencedMessage
}
