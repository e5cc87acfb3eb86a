package benchkit

import (
	"context"
	"database/sql"
	"errors"
)

// SQLFloor is Pools.Floor for a database/sql dialect: BEGIN on db, the
// primary-key read of the key (readQuery, prepared as read when
// not nil), insertOrder (the business shape), the insert of the finished record (insertQuery,
// prepared as insert when not nil) and COMMIT, one round trip each.
// insertArgs returns the insert's arguments after scope, key, fingerprint
// and token; nil gives the response's status code, headers and body.
func SQLFloor(ctx context.Context, db *sql.DB,
	insertOrder func(context.Context, *sql.Tx, string) error, header []byte,
	read, insert *sql.Stmt, readQuery, insertQuery, scope, key string, insertArgs func() []any,
) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	var row *sql.Row
	if read != nil {
		row = tx.StmtContext(ctx, read).QueryRowContext(ctx, scope, key) //nolint:sqlclosecheck // a transaction's statement closes with the transaction
	} else {
		row = tx.QueryRowContext(ctx, readQuery, scope, key)
	}
	var (
		status       int16
		fp, hdr, bdy []byte
		code         sql.NullInt32
	)
	err = row.Scan(&status, &fp, &code, &hdr, &bdy)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		err = nil
	case err == nil:
		err = errors.New("floor: fresh key exists")
	}
	if err == nil {
		err = insertOrder(ctx, tx, scope)
	}
	if err == nil {
		args := []any{scope, key, Fingerprint[:], int64(1)}
		if insertArgs != nil {
			args = append(args, insertArgs()...)
		} else {
			args = append(args, Response.StatusCode, header, Response.Body)
		}
		if insert != nil {
			_, err = tx.StmtContext(ctx, insert).ExecContext(ctx, args...) //nolint:sqlclosecheck // a transaction's statement closes with the transaction
		} else {
			_, err = tx.ExecContext(ctx, insertQuery, args...)
		}
	}
	if err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}
