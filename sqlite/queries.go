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
	// record; the statement then changes no row, so RowsAffected 0 means
	// the key was taken. No RETURNING: every value of the new record is
	// computed in Go, so the claim builds it without reading it back. The
	// caller holds the database's write lock (BEGIN IMMEDIATE), so nothing
	// changes between this statement and claimSelect.
	//
	// key_digest (migration 00002) is written here because SQLite cannot
	// compute SHA-256; it is what the operators' look-up by digest uses.
	claimInsert = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt,
	lease_expires_at, created_at, updated_at, expires_at, key_digest
) VALUES (?, ?, ?, 1, ?, 1, ?, ?, ?, ?, ?)
ON CONFLICT (scope, idempotency_key) DO NOTHING`

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
	// taking over the same expired record, only the first matches. Run as
	// is for idem.TakeoverReserved (the caller installed its own token with
	// RenewLease); the two statements below add the other conditions.
	takeoverUpdate = `UPDATE idempotency_keys SET
	token = ?, fingerprint = ?, status = 1, attempt = ?, lease_expires_at = ?,
	response_status = NULL, response_headers = NULL, response_body = NULL,
	created_at = ?, updated_at = ?, completed_at = NULL, expires_at = ?
WHERE scope = ? AND idempotency_key = ? AND token = ?`

	// takeoverIfRetentionExpired (idem.TakeoverRetentionExpired) also
	// requires the record to be past its retention deadline: a holder that
	// completed after the claimer read the record keeps its token but moved
	// the deadline out, so its fresh result is never overwritten.
	takeoverIfRetentionExpired = takeoverUpdate + ` AND expires_at <= ?`

	// takeoverIfLeaseExpired (idem.TakeoverLeaseExpired) also requires a
	// processing record whose lease ran out: a holder that completed or
	// renewed meanwhile keeps its key.
	takeoverIfLeaseExpired = takeoverUpdate + ` AND status = 1 AND lease_expires_at <= ?`

	// completeUpdate stores the final status and response, only while the
	// record is processing (status 1) and still carries the holder's token.
	completeUpdate = `UPDATE idempotency_keys SET
	status = ?, response_status = ?, response_headers = ?, response_body = ?,
	completed_at = ?, updated_at = ?, expires_at = ?
WHERE scope = ? AND idempotency_key = ? AND token = ? AND status = 1`

	// completeInsert is the completion of a deferred claim (CompleteDeferred): it writes
	// the finished record in one statement. DO NOTHING leaves a record that
	// exists regardless alone; RowsAffected 0 then means fenced.
	completeInsert = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at, key_digest
) VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (scope, idempotency_key) DO NOTHING`

	// releaseDelete removes the record, only while it is processing and
	// still carries the holder's token.
	releaseDelete = `DELETE FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ? AND token = ? AND status = 1`

	// releaseIfLeaseExpired (ReleaseParams.OnlyIfLeaseExpired) also requires
	// the lease to have run out: a holder that renewed meanwhile keeps its
	// key.
	releaseIfLeaseExpired = releaseDelete + ` AND lease_expires_at <= ?`

	// renewLeaseUpdate moves the lease of a processing record and sets its
	// token (unchanged for a plain renewal), only while the record is
	// processing and still carries the holder's token. The retention
	// deadline moves out to the new lease expiry if that is later (SQLite's
	// two-argument max() is a scalar function), so that a record never
	// passes its retention deadline while its lease is live.
	renewLeaseUpdate = `UPDATE idempotency_keys SET
	token = ?, lease_expires_at = ?, expires_at = max(expires_at, ?), updated_at = ?
WHERE scope = ? AND idempotency_key = ? AND token = ? AND status = 1`

	// renewExpiredLeaseUpdate (RenewLeaseParams.OnlyIfExpired) also requires
	// the lease to have run out: the caller reserves a stale record, and a
	// holder that renewed meanwhile keeps its key. The WHERE clause reads
	// the row as it was before the SET.
	renewExpiredLeaseUpdate = renewLeaseUpdate + ` AND lease_expires_at <= ?`

	// staleLeasesSelect lists processing records whose lease ran out and
	// whose retention has not, oldest lease first. "status = 1" is a literal,
	// not a bind parameter, so that the planner can prove the WHERE clause
	// of the partial index idempotency_keys_stale_lease_idx and use it; the
	// index is walked in lease_expires_at order, so ORDER BY needs no sort
	// and LIMIT stops the walk. The unary + on expires_at takes that column
	// out of index selection, so that the planner never prefers
	// idempotency_keys_expires_at_idx (which holds every record) to the
	// small partial index, whatever ANALYZE statistics say.
	staleLeasesSelect = `SELECT ` + recordColumns + `
FROM idempotency_keys
WHERE status = 1 AND lease_expires_at <= ? AND +expires_at > ?
ORDER BY lease_expires_at
LIMIT ?`

	// expiredDelete deletes at most LIMIT records past their retention
	// deadline, earliest deadline first. DELETE ... LIMIT needs a
	// compile-time option that SQLite builds lack, so the subquery picks the
	// rowids by walking idempotency_keys_expires_at_idx (a covering read:
	// the index entries carry the rowid) and the DELETE removes them by
	// rowid. SQLite has no row locks: the statement holds the database's
	// write lock while it runs, so the LIMIT is what keeps that hold, and
	// the wait of every other writer, short.
	expiredDelete = `DELETE FROM idempotency_keys
WHERE rowid IN (
	SELECT rowid FROM idempotency_keys
	WHERE expires_at <= ?
	ORDER BY expires_at
	LIMIT ?
)`
)

// Statements of the pool-level Claim, run on a connection of its own (the
// busy-timeout PRAGMAs also bound the pool-level Takeover, RenewLease and
// DeleteExpired).
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
