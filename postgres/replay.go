package postgres

import (
	"context"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/replayrow"
)

// getCompleted reads what a replay answers from: six columns of a live
// record, by primary key, without a lock. A processing record is read too
// and refused in Go (replayrow.Decode), which keeps the WHERE clause get's.
const getCompleted = `SELECT ` + replayrow.Columns + `
FROM idempotency_keys
WHERE scope = $1::text AND idempotency_key = $2::text
	AND expires_at > COALESCE($3::timestamptz, clock_timestamp())`

var _ idem.ReplayReader = (*executor)(nil)

// GetCompleted implements idem.ReplayReader.
func (e *executor) GetCompleted(ctx context.Context, p *idem.GetParams) (*idem.Record, error) {
	var (
		fingerprint, header, body []byte
		status                    int16
		code                      *int32
		expiresAt                 time.Time
	)
	err := e.db.QueryRow(ctx, e.st.getCompleted, p.Scope, p.Key, pinnedNow(p.Now)).
		Scan(&fingerprint, &status, &code, &header, &body, &expiresAt)
	if err != nil {
		return nil, interpretError(ctx, err)
	}
	var c int
	if code != nil {
		c = int(*code)
	}
	return replayrow.Decode(p.Scope, p.Key, fingerprint, idem.Status(status), c, header, body, expiresAt)
}
