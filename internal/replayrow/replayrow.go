// Package replayrow decodes the row of a dialect's idem.ReplayReader: the
// six columns a replay answers from, in one place for every dialect.
package replayrow

import (
	"fmt"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/codec"
)

// Query's column list, in the order Decode takes them.
const Columns = `fingerprint, status, response_status, response_headers, response_body, expires_at`

// Decode returns the record of (scope, key) read from the six columns:
// idem.ErrNotFound when it is processing (GetCompleted answers only
// completed records), an *idem.CorruptRecordError when a value cannot be
// decoded. code is the response status, 0 for NULL (left for the Store's
// validation to refuse, as on Get). fingerprint and header are only read
// (they may be a driver's buffer); body is kept.
func Decode(scope, key string, fingerprint []byte, status idem.Status, code int, header, body []byte, expiresAt time.Time) (*idem.Record, error) {
	if !status.Final() {
		return nil, idem.ErrNotFound
	}
	// One allocation for both: every replay makes them.
	both := &struct {
		rec  idem.Record
		resp idem.Response
	}{rec: idem.Record{Scope: scope, Key: key, Status: status, ExpiresAt: expiresAt.UTC()}}
	rec := &both.rec
	if len(fingerprint) != len(rec.Fingerprint) {
		return nil, &idem.CorruptRecordError{Reason: fmt.Sprintf("its fingerprint has %d bytes, want %d", len(fingerprint), len(rec.Fingerprint))}
	}
	copy(rec.Fingerprint[:], fingerprint)
	h, err := codec.DecodeHeader(header)
	if err != nil {
		// The decoder's message may quote stored bytes: kept as the cause only.
		return nil, &idem.CorruptRecordError{Reason: "its response headers do not decode", Cause: err}
	}
	if body == nil {
		body = []byte{} // drivers read an empty value as nil; a replay gives back an empty body
	}
	both.resp = idem.Response{StatusCode: code, Header: h, Body: body}
	rec.Response = &both.resp
	return rec, nil
}
