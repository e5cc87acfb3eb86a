package mysql

import (
	"context"
	"database/sql"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/replayrow"
)

// getCompleted reads what a replay answers from: six columns of a live
// record, by primary key, without a lock (a consistent read). A processing
// record is read too and refused in Go (replayrow.Decode).
//
// Arguments: scope, key, now.
const getCompleted = `SELECT ` + replayrow.Columns + `
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ? AND expires_at > ` + now

var _ idem.ReplayReader = (*executor)(nil)

// GetCompleted implements idem.ReplayReader.
func (e *executor) GetCompleted(ctx context.Context, p *idem.GetParams) (*idem.Record, error) {
	var (
		fingerprint, header, body []byte
		status                    idem.Status
		code                      sql.NullInt64
		expires                   dbTime
	)
	err := e.h.QueryRowContext(ctx, getCompleted, []byte(p.Scope), []byte(p.Key), pinned(p.Now)).
		Scan(&fingerprint, &status, &code, &header, &body, &expires)
	if err != nil {
		return nil, interpretError(err)
	}
	return replayrow.Decode(p.Scope, p.Key, fingerprint, status, int(code.Int64), header, body, expires.Time)
}
