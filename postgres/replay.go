package postgres

import (
	"context"
	"encoding/binary"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

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
//
// It reads the row's raw values instead of scanning them: a replay is meant
// to cost what a bare primary-key read costs, and Scan plans every column
// anew for each query and allocates for each target (a *int32 for the
// nullable status costs three allocations and reflection). Values in any
// other shape than the binary ones expected (the simple protocol's text, a
// NULL where the schema forbids one) go through Scan, which decodes or
// refuses them as before.
func (e *executor) GetCompleted(ctx context.Context, p *idem.GetParams) (*idem.Record, error) {
	rows, err := e.db.Query(ctx, e.st.getCompleted, p.Scope, p.Key, pinnedNow(p.Now))
	if err != nil {
		return nil, interpretError(ctx, err)
	}
	defer rows.Close()
	if !rows.Next() {
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, interpretError(ctx, err)
		}
		return nil, idem.ErrNotFound
	}
	rec, err := decodeReplayRow(p, rows)
	// Close reads the rest of the answer: an error there (the server's,
	// the connection's) wins over the decoded row.
	rows.Close()
	if rerr := rows.Err(); rerr != nil {
		return nil, interpretError(ctx, rerr)
	}
	if err != nil {
		return nil, interpretError(ctx, err)
	}
	return rec, nil
}

// pgEpochOffset is the origin of PostgreSQL's binary timestamps,
// 2000-01-01 UTC, after Unix's.
const pgEpochOffset = 946684800 * time.Second

// replayOIDs are the types of getCompleted's columns, in order.
var replayOIDs = [...]uint32{pgtype.ByteaOID, pgtype.Int2OID, pgtype.Int4OID, pgtype.ByteaOID, pgtype.ByteaOID, pgtype.TimestamptzOID}

// decodeReplayRow decodes the current row of rows, a getCompleted answer.
// The raw values are valid only until rows moves on: the header is decoded
// from them (DecodeHeader copies what it keeps) and the body copied.
func decodeReplayRow(p *idem.GetParams, rows pgx.Rows) (*idem.Record, error) {
	if rec, ok, err := decodeReplayRaw(p, rows.FieldDescriptions(), rows.RawValues()); ok {
		return rec, err
	}
	var (
		fingerprint, header, body []byte
		status                    int16
		code                      pgtype.Int4
		expiresAt                 time.Time
	)
	if err := rows.Scan(&fingerprint, &status, &code, &header, &body, &expiresAt); err != nil {
		return nil, err
	}
	return replayrow.Decode(p.Scope, p.Key, fingerprint, idem.Status(status), int(code.Int32), header, body, expiresAt)
}

// decodeReplayRaw decodes a row of binary values; ok is false for anything
// else, left to Scan.
func decodeReplayRaw(p *idem.GetParams, fds []pgconn.FieldDescription, vals [][]byte) (_ *idem.Record, ok bool, _ error) {
	if len(fds) != len(replayOIDs) || len(vals) != len(replayOIDs) {
		return nil, false, nil
	}
	for i, fd := range fds {
		if fd.Format != pgx.BinaryFormatCode || fd.DataTypeOID != replayOIDs[i] {
			return nil, false, nil
		}
	}
	fingerprint, st, cd, header, body, exp := vals[0], vals[1], vals[2], vals[3], vals[4], vals[5]
	if fingerprint == nil || len(st) != 2 || (cd != nil && len(cd) != 4) || len(exp) != 8 {
		return nil, false, nil
	}
	// timestamptz on the wire: microseconds since 2000-01-01 UTC; the
	// infinities (the extreme int64s) are left to Scan, which refuses them.
	us := int64(binary.BigEndian.Uint64(exp)) //nolint:gosec // a signed int8, as the server sent it
	if us == math.MaxInt64 || us == math.MinInt64 {
		return nil, false, nil
	}
	expiresAt := time.UnixMicro(us).Add(pgEpochOffset).UTC()
	var code int
	if cd != nil {
		code = int(int32(binary.BigEndian.Uint32(cd))) //nolint:gosec // a signed int4, as the server sent it
	}
	if body != nil {
		body = append(make([]byte, 0, len(body)), body...)
	}
	//nolint:gosec // a signed int2, as the server sent it; Decode refuses what is not a status
	rec, err := replayrow.Decode(p.Scope, p.Key, fingerprint, idem.Status(int16(binary.BigEndian.Uint16(st))), code, header, body, expiresAt)
	return rec, true, err
}
