package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/digest"
)

// sqliteFloorTable creates floorTable from the statements SQLite keeps for
// idempotency_keys and its indexes (the migrations' ALTERs included), with
// the table's name, and so its indexes', replaced.
func sqliteFloorTable(ctx context.Context, db *sql.DB) error {
	rows, err := db.QueryContext(ctx, `SELECT sql FROM sqlite_master
		WHERE tbl_name = 'idempotency_keys' AND sql IS NOT NULL ORDER BY type = 'table' DESC`)
	if err != nil {
		return err
	}
	var ddl []string
	for rows.Next() {
		var q string
		if err := rows.Scan(&q); err != nil {
			_ = rows.Close()
			return err
		}
		ddl = append(ddl, strings.ReplaceAll(q, "idempotency_keys", floorTable))
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return err
	}
	if len(ddl) < 2 {
		return fmt.Errorf("idempotency_keys: %d statements in sqlite_master, want the table and its indexes", len(ddl))
	}
	for _, q := range ddl {
		if _, err := db.ExecContext(ctx, q); err != nil {
			return err
		}
	}
	return nil
}

// The floor scenarios' statements on SQLite: times in microseconds, and
// key_digest written from Go, as idem's completion of a deferred claim
// writes them.
const (
	sqliteFloorRead = `SELECT ` + floorRecordColumns + `
FROM ` + floorTable + `
WHERE scope = ? AND idempotency_key = ?`
	sqliteFloorInsert = `INSERT INTO ` + floorTable + ` (` + floorRecordColumns + `, key_digest)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`
)

// sqliteFloor runs the floor scenarios on s, whose dialect writes through
// db: prepared statements, as Do's, in a transaction of s's dialect (BEGIN
// IMMEDIATE). SQLite has no round trips to save: floor and floortx run the
// same statements, floortx being what ClaimTx and CompleteTx could do in a
// caller's transaction at best.
func sqliteFloor(ctx context.Context, s *idem.Store[*sql.Tx], db *sql.DB) (*floorRunner[*sql.Tx], error) {
	read, err := db.PrepareContext(ctx, sqliteFloorRead)
	if err != nil {
		return nil, err
	}
	ins, err := db.PrepareContext(ctx, sqliteFloorInsert)
	if err != nil {
		_ = read.Close()
		return nil, err
	}
	op := floorTxOp(s,
		func(ctx context.Context, tx *sql.Tx, r *floorRow) error {
			return sqliteFloorScan(tx.StmtContext(ctx, read).QueryRowContext(ctx, r.scope, r.key))
		},
		func(ctx context.Context, tx *sql.Tx, r *floorRow) error {
			d := digest.Sum(r.scope, r.key)
			_, err := tx.StmtContext(ctx, ins).ExecContext(ctx, r.scope, r.key, fingerprint[:], int64(idem.StatusSucceeded), r.token, 1,
				r.leaseExpires.UnixMicro(), response.StatusCode, floorHeader, response.Body,
				r.now.UnixMicro(), r.now.UnixMicro(), r.now.UnixMicro(), r.expires.UnixMicro(), d[:])
			return err
		})
	return &floorRunner[*sql.Tx]{do: op, tx: op, close: func() { _ = read.Close(); _ = ins.Close() }}, nil
}

// sqliteFloorScan scans a row of sqliteFloorRead, for a fresh key none:
// nil then.
func sqliteFloorScan(row *sql.Row) error {
	var (
		scope, key                                  string
		fp, hdr, body                               []byte
		status, token, attempt, lease, created, upd int64
		expires                                     int64
		code, completed                             sql.NullInt64
	)
	err := row.Scan(&scope, &key, &fp, &status, &token, &attempt, &lease, &code, &hdr, &body, &created, &upd, &completed, &expires)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil
	case err == nil:
		return errFloorKeyFound
	}
	return fmt.Errorf("floor: read: %w", err)
}
