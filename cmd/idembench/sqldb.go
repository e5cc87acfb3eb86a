package main

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/idemstore/idem/internal/workload"
)

// sqlAdmin runs the tool's statements on a database/sql pool.
type sqlAdmin struct{ db *sql.DB }

func (a sqlAdmin) exec(ctx context.Context, q string, args ...any) error {
	_, err := a.db.ExecContext(ctx, q, args...)
	return err
}

func (a sqlAdmin) counts(ctx context.Context, q string) (c workload.Counts, err error) {
	err = a.db.QueryRowContext(ctx, q).Scan(&c.Orders, &c.Lines, &c.Stock, &c.Completed, &c.Pending)
	return c, err
}

func (a sqlAdmin) queryInt(ctx context.Context, q string, args ...any) (int64, error) {
	var n int64
	err := a.db.QueryRowContext(ctx, q, args...).Scan(&n)
	return n, err
}

// sqlSelect is the replay baseline on MySQL and SQLite: the six columns a
// replay reads (replayrow.Columns).
const sqlSelect = `SELECT status, fingerprint, response_status, response_headers, response_body, expires_at
FROM idempotency_keys WHERE scope = ? AND idempotency_key = ?`

// sqlPKSelect returns the replay baseline on db.
func sqlPKSelect(db *sql.DB) func(ctx context.Context, scope, key string) error {
	return func(ctx context.Context, scope, key string) error {
		var (
			status       int16
			fp, hdr, bdy []byte
			code         int32
			expires      any
		)
		return db.QueryRowContext(ctx, sqlSelect, scope, key).Scan(&status, &fp, &code, &hdr, &bdy, &expires)
	}
}

// warm opens conns connections of db before a measurement needs them.
func warm(ctx context.Context, db *sql.DB, conns int) error {
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	held := make([]*sql.Conn, 0, conns)
	defer func() {
		for _, c := range held {
			_ = c.Close()
		}
	}()
	for range conns {
		c, err := db.Conn(ctx)
		if err != nil {
			return fmt.Errorf("connect: %w", err)
		}
		if err := c.PingContext(ctx); err != nil {
			return fmt.Errorf("connect: %w", err)
		}
		held = append(held, c)
	}
	return nil
}
