package sqlite

import (
	"context"
	"database/sql"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/replayrow"
)

// getCompletedSelect reads what a replay answers from: six columns of a
// live record, by primary key. A processing record is read too and refused
// in Go (replayrow.Decode).
const getCompletedSelect = `SELECT ` + replayrow.Columns + `
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ? AND expires_at > ?`

var _ idem.ReplayReader = (*executor)(nil)

// GetCompleted implements idem.ReplayReader, on the pool with a statement
// prepared once, like Get.
func (e *executor) GetCompleted(ctx context.Context, p *idem.GetParams) (*idem.Record, error) {
	var (
		fingerprint, header, body []byte
		status                    int64
		code                      sql.NullInt64
		expires                   int64
	)
	args := []any{p.Scope, p.Key, micros(clock(p.Now))}
	var row *sql.Row
	if st := e.preparedGetCompleted(ctx); st != nil {
		row = st.QueryRowContext(ctx, args...)
	} else {
		row = e.h.QueryRowContext(ctx, getCompletedSelect, args...)
	}
	if err := row.Scan(&fingerprint, &status, &code, &header, &body, &expires); err != nil {
		return nil, interpretError(err)
	}
	//nolint:gosec // the schema's CHECK (status IN (1, 2, 3)) keeps it in range
	return replayrow.Decode(p.Scope, p.Key, fingerprint, idem.Status(status), int(code.Int64), header, body, fromMicros(expires))
}

// preparedGetCompleted returns the pool's prepared statement, or nil in a
// transaction or when preparing failed.
func (e *executor) preparedGetCompleted(ctx context.Context) *sql.Stmt {
	if e.getCompleted == nil {
		return nil
	}
	return e.getCompleted.stmt(ctx) //nolint:sqlclosecheck // cached for the life of the *sql.DB, which closes it
}
