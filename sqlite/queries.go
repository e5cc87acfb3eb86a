package sqlite

// The statements of the executor. Every value is a bind parameter; times are
// INTEGER microseconds since the Unix epoch (UTC), computed in Go because
// SQLite's own clock only has millisecond resolution and runs in this
// process anyway.
const (
	// recordColumns is the column list every record read scans, in the
	// order of scanRecord.
	recordColumns = `scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at`

	// claimInsert inserts a processing record (status 1, attempt 1) unless
	// one exists for (scope, key). DO NOTHING never overwrites an existing
	// record, and RETURNING yields a row only when this statement inserted
	// one (SQLite 3.35+), so "no rows" means the key was taken. The caller
	// holds the database's write lock (BEGIN IMMEDIATE), so nothing changes
	// between this statement and claimSelect.
	claimInsert = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt,
	lease_expires_at, created_at, updated_at, expires_at
) VALUES (?, ?, ?, 1, ?, 1, ?, ?, ?, ?)
ON CONFLICT (scope, idempotency_key) DO NOTHING
RETURNING ` + recordColumns

	// claimSelect reads the record that made claimInsert do nothing. There
	// is no expiry filter: Claim returns what it found and the Store decides.
	claimSelect = `SELECT ` + recordColumns + `
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ?`

	// getSelect reads a live record: one whose retention deadline is after now.
	getSelect = `SELECT ` + recordColumns + `
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ? AND expires_at > ?`

	// takeoverUpdate turns the record into a new processing record for a new
	// holder. The token in the WHERE clause fences it: of several claimers
	// taking over the same expired record, only the first matches.
	takeoverUpdate = `UPDATE idempotency_keys SET
	token = ?, fingerprint = ?, status = 1, attempt = ?, lease_expires_at = ?,
	response_status = NULL, response_headers = NULL, response_body = NULL,
	created_at = ?, updated_at = ?, completed_at = NULL, expires_at = ?
WHERE scope = ? AND idempotency_key = ? AND token = ?`

	// completeUpdate stores the final status and response, only while the
	// record is processing (status 1) and still carries the holder's token.
	completeUpdate = `UPDATE idempotency_keys SET
	status = ?, response_status = ?, response_headers = ?, response_body = ?,
	completed_at = ?, updated_at = ?, expires_at = ?
WHERE scope = ? AND idempotency_key = ? AND token = ? AND status = 1`

	// releaseDelete removes the record, only while it is processing and
	// still carries the holder's token.
	releaseDelete = `DELETE FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ? AND token = ? AND status = 1`
)

// Statements of the pool-level Claim, run on a connection of its own.
// PRAGMA takes no bind parameters, so setBusyTimeout appends an integer it
// formats itself; no caller-supplied text ever reaches these statements.
const (
	// busyTimeoutGet reads the connection's busy timeout in milliseconds.
	busyTimeoutGet = `PRAGMA busy_timeout`
	// busyTimeoutSet is completed with a formatted integer.
	busyTimeoutSet = `PRAGMA busy_timeout = `

	// beginImmediate takes the database's write lock at once, waiting up to
	// the busy timeout. Issued directly rather than through BeginTx so that
	// it does not depend on the DSN's _txlock.
	beginImmediate = `BEGIN IMMEDIATE`
	commitTx       = `COMMIT`
	rollbackTx     = `ROLLBACK`
)
