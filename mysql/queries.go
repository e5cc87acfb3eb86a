package mysql

// SQL statements, one constant per statement. Every value is a bind
// parameter; the only text ever added at run time is the integer lock wait
// timeout in Executor.Claim's SET STATEMENT prefix (see claimMariaDB).
//
// The statements keep to SQL that both MySQL 8.0 and MariaDB 10.6 accept: no
// RETURNING (MySQL lacks it), no INSERT IGNORE (it turns more than duplicates
// into warnings, such as truncated values), nothing from the inserted row in
// ON DUPLICATE KEY UPDATE (VALUES() is deprecated in MySQL, row aliases are
// absent from MariaDB).

// now is the statement's clock: the pinned time when the ? is not NULL, the
// server's UTC clock otherwise. UTC_TIMESTAMP(6) is used, never NOW(), which
// depends on the session time_zone; the columns are DATETIME(6) holding UTC.
// Both servers evaluate UTC_TIMESTAMP once per statement, so every use within
// one statement agrees. CAST gives the expression the DATETIME(6) type whether
// the driver sends the pinned time as a literal or as a string parameter.
const now = "COALESCE(CAST(? AS DATETIME(6)), UTC_TIMESTAMP(6))"

// recordColumns are scanned by scanRecord, in this order.
const recordColumns = `scope, idempotency_key, fingerprint, status, token, attempt,
	lease_expires_at, response_status, response_headers, response_body,
	created_at, updated_at, completed_at, expires_at`

// detectServer reads what the executor needs to know about the server once
// per Dialect: whether it is MariaDB (VERSION() contains "MariaDB"), whether
// a lock wait timeout rolls back the whole transaction, and the clock, whose
// scan type shows whether the DSN has parseTime=true and loc=UTC.
const detectServer = `SELECT VERSION(), @@GLOBAL.innodb_rollback_on_timeout, UTC_TIMESTAMP(6)`

// claimInsert inserts a processing record unless one exists for (scope, key).
//
// ON DUPLICATE KEY UPDATE with a no-op assignment instead of INSERT IGNORE:
// only a duplicate key is absorbed, every other error still fails the
// statement. With the driver's default clientFoundRows=false, RowsAffected
// is 1 for an insert and 0 for an existing row (an assignment that changes
// nothing counts no rows). The no-op update takes an exclusive lock on the
// existing row until the transaction ends, like the insert would have.
//
// When an uncommitted transaction holds the key, InnoDB makes the statement
// wait: if the holder commits, the row is a duplicate; if it rolls back, the
// insert proceeds. The wait is bounded by innodb_lock_wait_timeout.
//
// Arguments: scope, key, fingerprint, status, token, now, lease µs, now, now,
// now, retention µs.
const claimInsert = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt,
	lease_expires_at, created_at, updated_at, expires_at)
VALUES (?, ?, ?, ?, ?, 1,
	DATE_ADD(` + now + `, INTERVAL ? MICROSECOND), ` + now + `, ` + now + `,
	DATE_ADD(` + now + `, INTERVAL ? MICROSECOND))
ON DUPLICATE KEY UPDATE idempotency_key = idempotency_key`

// claimSelect reads the record after claimInsert, with the server's time.
//
// FOR UPDATE makes it a locking read, which sees the latest committed row.
// Under REPEATABLE READ a plain SELECT reads the transaction's snapshot,
// taken at its first read, which can predate the commit of the holder that
// claimInsert waited for: the record would look absent.
//
// Arguments: scope, key.
const claimSelect = `SELECT ` + recordColumns + `, UTC_TIMESTAMP(6)
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ?
FOR UPDATE`

// setLockWait and restoreLockWait bound Claim's wait on MySQL, which has no
// SET STATEMENT: the session value is saved in a user variable, replaced, and
// put back after the claim, on the same connection.
//
// Argument of setLockWait: timeout in seconds.
const (
	setLockWait     = `SET @idem_saved_lwt = @@SESSION.innodb_lock_wait_timeout, SESSION innodb_lock_wait_timeout = ?`
	restoreLockWait = `SET SESSION innodb_lock_wait_timeout = @idem_saved_lwt`
)

// takeover replaces the record with a new processing one while it still
// carries the expected token. MySQL applies SET assignments left to right,
// so no assignment may read a column assigned before it; none does.
//
// Arguments: new token, fingerprint, status, attempt, now, lease µs, now, now,
// now, retention µs, scope, key, token.
const takeover = `UPDATE idempotency_keys SET
	token = ?, fingerprint = ?, status = ?, attempt = ?,
	lease_expires_at = DATE_ADD(` + now + `, INTERVAL ? MICROSECOND),
	response_status = NULL, response_headers = NULL, response_body = NULL,
	created_at = ` + now + `, updated_at = ` + now + `, completed_at = NULL,
	expires_at = DATE_ADD(` + now + `, INTERVAL ? MICROSECOND)
WHERE scope = ? AND idempotency_key = ? AND token = ?`

// get is a non-locking read of a live record.
//
// Arguments: scope, key, now.
const get = `SELECT ` + recordColumns + `
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ? AND expires_at > ` + now

// complete stores the response of a processing record that still carries the
// token. It always changes status, so RowsAffected is 1 when it matched.
//
// Arguments: status, response status, headers, body, now, now, now,
// retention µs, scope, key, token, processing status.
const complete = `UPDATE idempotency_keys SET
	status = ?, response_status = ?, response_headers = ?, response_body = ?,
	completed_at = ` + now + `, updated_at = ` + now + `,
	expires_at = DATE_ADD(` + now + `, INTERVAL ? MICROSECOND)
WHERE scope = ? AND idempotency_key = ? AND token = ? AND status = ?`

// release deletes a processing record that still carries the token.
//
// Arguments: scope, key, token, processing status.
const release = `DELETE FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ? AND token = ? AND status = ?`

// Migration lock. GET_LOCK names are server-wide, so concurrent Migrate
// calls against any database on the server take turns; each holds the lock
// for one short DDL statement per pending migration.
//
// Arguments of getMigrateLock: lock name, timeout in seconds. Of
// releaseMigrateLock: lock name.
const (
	getMigrateLock     = `SELECT GET_LOCK(?, ?)`
	releaseMigrateLock = `SELECT RELEASE_LOCK(?)`
)
