package mysql

// SQL statements, one constant per statement. Every value is a bind
// parameter; the only text ever added at run time is the integer lock wait
// timeout in the SET STATEMENT prefix of the statements whose wait is bounded
// (see executor.boundWait).
//
// The statements keep to SQL that both MySQL 8.0 and MariaDB 10.6 accept: no
// RETURNING (MySQL lacks it), no INSERT IGNORE (it turns more than duplicates
// into warnings, such as truncated values), LOCK IN SHARE MODE rather than
// FOR SHARE (MariaDB lacks it).

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

// claimInsert inserts a processing record. When a record for (scope, key)
// exists, it fails with error 1062 (ER_DUP_ENTRY), which Claim recognises by
// number and absorbs; the error's message quotes the key, so it never leaves
// the package. Neither INSERT IGNORE, which also turns errors other than
// duplicates into warnings (a truncated value, for one), nor INSERT ... ON
// DUPLICATE KEY UPDATE with a no-op assignment, which takes an exclusive lock
// on the existing row: a caller's transaction keeps that lock until it ends,
// so two transactions replaying the same completed key would queue behind
// each other. A duplicate key error rolls back the statement only (the
// transaction goes on) and leaves a shared record lock (no gap: the primary
// key is unique) on the existing row, which replays share.
//
// When an uncommitted transaction holds the key, InnoDB makes the statement
// wait: if the holder commits, the row is a duplicate; if it rolls back, the
// insert proceeds. The wait is bounded by innodb_lock_wait_timeout. When
// several statements wait and the holder rolls back, each of them holds a
// shared lock where the row was and needs an exclusive one to insert: InnoDB
// lets one insert and rolls the others back as deadlock victims (1213).
//
// Arguments: scope, key, fingerprint, status, token, now, lease µs, now, now,
// now, retention µs.
const claimInsert = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt,
	lease_expires_at, created_at, updated_at, expires_at)
VALUES (?, ?, ?, ?, ?, 1,
	DATE_ADD(` + now + `, INTERVAL ? MICROSECOND), ` + now + `, ` + now + `,
	DATE_ADD(` + now + `, INTERVAL ? MICROSECOND))`

// claimInsertReturning is claimInsert for MariaDB (10.5+), which returns the
// times it computed: with the arguments they are the whole new record, so
// the claim that acquires needs no second statement. When the key exists it
// fails with 1062 like claimInsert, and claimSelect follows. MySQL lacks
// RETURNING and runs claimInsert then claimSelect.
//
// Arguments: those of claimInsert.
const claimInsertReturning = claimInsert + `
RETURNING lease_expires_at, created_at, expires_at`

// claimSelect reads the record after claimInsert, with the server's time.
//
// LOCK IN SHARE MODE makes it a locking read, which sees the latest committed
// row. Under REPEATABLE READ a plain SELECT reads the transaction's snapshot,
// taken at its first read, which can predate the commit of the holder that
// claimInsert waited for: the record would look absent. A shared lock, not
// FOR UPDATE, so that claimers that only replay do not wait for each other;
// it is the lock claimInsert's duplicate check already took. (MySQL 8 also
// spells it FOR SHARE, which MariaDB lacks.)
//
// Arguments: scope, key.
const claimSelect = `SELECT ` + recordColumns + `, UTC_TIMESTAMP(6)
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ?
LOCK IN SHARE MODE`

// setLockWait and restoreLockWait bound a statement's wait on MySQL, which
// has no SET STATEMENT: the session value is saved in a user variable,
// replaced, and put back afterwards, on the same connection.
//
// Argument of setLockWait: timeout in seconds.
const (
	setLockWait     = `SET @idem_saved_lwt = @@SESSION.innodb_lock_wait_timeout, SESSION innodb_lock_wait_timeout = ?`
	restoreLockWait = `SET SESSION innodb_lock_wait_timeout = @idem_saved_lwt`
)

// takeover replaces the record with a new processing one while it still
// carries the expected token; takeoverRetentionExpired and
// takeoverLeaseExpired add the condition of idem.TakeoverCondition. MySQL
// applies SET assignments left to right, so no assignment may read a column
// assigned before it; none does.
//
// An UPDATE is a locking read: InnoDB evaluates the WHERE clause on the
// newest committed version of the row, after waiting for a transaction that
// holds it, never on the caller's snapshot. A holder that completed or
// renewed meanwhile (keeping its token) therefore no longer matches, and is
// not overwritten. Under READ COMMITTED, InnoDB first checks the newest
// committed version without waiting ("semi-consistent read") and skips a row
// that does not match; a row that matches is waited for and checked again.
//
// Arguments: new token, fingerprint, status, attempt, now, lease µs, now, now,
// now, retention µs, scope, key, token; then for takeoverRetentionExpired:
// now; for takeoverLeaseExpired: processing status, now.
const (
	takeover = `UPDATE idempotency_keys SET
	token = ?, fingerprint = ?, status = ?, attempt = ?,
	lease_expires_at = DATE_ADD(` + now + `, INTERVAL ? MICROSECOND),
	response_status = NULL, response_headers = NULL, response_body = NULL,
	created_at = ` + now + `, updated_at = ` + now + `, completed_at = NULL,
	expires_at = DATE_ADD(` + now + `, INTERVAL ? MICROSECOND)
WHERE scope = ? AND idempotency_key = ? AND token = ?`
	takeoverRetentionExpired = takeover + ` AND expires_at <= ` + now
	takeoverLeaseExpired     = takeover + ` AND status = ? AND lease_expires_at <= ` + now
)

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

// Statements of a pool opened with NewConnector, on MariaDB only (MySQL has
// no compound statements outside stored programs): START TRANSACTION and
// COMMIT each travel inside a statement of idem's instead of costing a round
// trip of their own. A compound statement (BEGIN NOT ATOMIC ... END) is one
// statement to the driver, so the DSN needs no multiStatements; the server
// cannot prepare it, so its parameters are interpolated (NewConnector turns
// interpolateParams on). The server stops a compound statement at its first
// error: the statements after it do not run.
const (
	pipeBegin = "BEGIN NOT ATOMIC\nSTART TRANSACTION;\n"
	pipeEnd   = ";\nEND"
)

// beginWith returns stmt preceded by START TRANSACTION in one compound
// statement. A duplicate key error of stmt leaves the transaction open, as
// after the two statements sent apart.
func beginWith(stmt string) string { return pipeBegin + stmt + pipeEnd }

// completeCommit is complete then COMMIT in one compound statement. COMMIT
// must not run when complete matched no row (the caller's writes would
// commit with a record left processing), so the statement raises
// completeFenced instead, and the transaction stays open for the caller to
// roll back. complete always changes status, so ROW_COUNT() is 1 when it
// matched, whatever clientFoundRows says.
//
// Arguments: those of complete.
const completeCommit = `BEGIN NOT ATOMIC
` + complete + `;
IF ROW_COUNT() <> 1 THEN
	SIGNAL SQLSTATE '45000' SET MYSQL_ERRNO = ` + erSignalFencedText + `, MESSAGE_TEXT = '` + completeFencedMessage + `';
END IF;
COMMIT;
END`

// The error completeCommit raises when its completion matched no row.
const (
	erSignalFencedText    = "1644" // ER_SIGNAL_EXCEPTION, the number of a SIGNAL
	completeFencedMessage = "idem: completion fenced"
)

// release deletes a processing record that still carries the token;
// releaseLeaseExpired only while its lease has run out, so that a holder
// that renewed meanwhile keeps its key. Like an UPDATE, a DELETE evaluates
// its WHERE clause on the newest committed row version.
//
// Arguments: scope, key, token, processing status; then for
// releaseLeaseExpired: now.
const (
	release = `DELETE FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ? AND token = ? AND status = ?`
	releaseLeaseExpired = release + ` AND lease_expires_at <= ` + now
)

// clock reads the server's UTC clock. RenewLease and ListStaleLeases must
// return the time they used, and MySQL has no RETURNING, so when no clock is
// pinned they read it first and pass it to their statement as the pinned now.
const clock = `SELECT UTC_TIMESTAMP(6)`

// renewLease pushes out the lease of a processing record that still carries
// the token, gives it the new token, and moves its retention deadline to the
// new lease expiry if that is later, so that a processing record never
// passes its retention deadline (and gets taken over or reaped) while its
// lease is live. With the flag set (OnlyIfExpired) it also requires the
// lease to have run out. The caller passes a known now (never NULL) and
// computes the new lease_expires_at from it exactly as the statement does,
// which is how it returns the stored value without RETURNING. The lease
// expression is repeated in GREATEST rather than read back from the column:
// MariaDB's SIMULTANEOUS_ASSIGNMENT sql_mode would give the old value.
//
// It can change nothing: a renewal with the same token, now and duration as
// the previous one writes the values already stored, and with
// clientFoundRows=false RowsAffected is then 0, as for a fenced renewal.
// renewLeaseCheck tells the two apart.
//
// Arguments: new token, now, lease µs, now, now, lease µs, scope, key, token,
// processing status, flag, now.
const renewLease = `UPDATE idempotency_keys SET
	token = ?, lease_expires_at = DATE_ADD(` + now + `, INTERVAL ? MICROSECOND),
	updated_at = ` + now + `,
	expires_at = GREATEST(expires_at, DATE_ADD(` + now + `, INTERVAL ? MICROSECOND))
WHERE scope = ? AND idempotency_key = ? AND token = ? AND status = ?
	AND (? = 0 OR lease_expires_at <= ` + now + `)`

// renewLeaseCheck finds the record if renewLease's WHERE clause matches it
// and it already holds what renewLease would have written, after renewLease
// changed no row. Only called when the token is unchanged. A locking read:
// in a caller's REPEATABLE READ transaction a plain SELECT would read the
// transaction's snapshot, not the row version the UPDATE matched against
// (whose lock the UPDATE already holds there).
//
// Arguments: scope, key, token, processing status, lease expiry, now, lease
// expiry, flag, now.
const renewLeaseCheck = `SELECT 1
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ? AND token = ? AND status = ?
	AND lease_expires_at = CAST(? AS DATETIME(6)) AND updated_at = CAST(? AS DATETIME(6))
	AND expires_at >= CAST(? AS DATETIME(6))
	AND (? = 0 OR lease_expires_at <= CAST(? AS DATETIME(6)))
FOR UPDATE`

// listStaleLeases reads processing records whose lease has run out and whose
// retention has not, oldest lease first. status = ? and lease_expires_at <= ?
// make it a range scan of idempotency_keys_stale_lease_idx (status,
// lease_expires_at), already in ORDER BY order, so no sort; expires_at is
// checked on the rows the range yields. A consistent (non-locking) read: it
// waits for no claim and blocks none. The caller passes a known now.
//
// Arguments: processing status, now, now, limit.
const listStaleLeases = `SELECT ` + recordColumns + `
FROM idempotency_keys
WHERE status = ? AND lease_expires_at <= ` + now + ` AND expires_at > ` + now + `
ORDER BY lease_expires_at
LIMIT ?`

// deleteExpired deletes up to limit records past their retention deadline,
// oldest first, in one statement that never waits for a row lock.
//
// The plain form, DELETE ... WHERE expires_at <= ? ORDER BY expires_at
// LIMIT ?, is not used. It locks every row it scans, and on a row that
// another transaction holds (a claim taking over an expired key holds it
// until its caller commits) it waits up to innodb_lock_wait_timeout, 50 s
// by default, keeping the locks it already took: claims of those keys queue
// behind it, and so does a second reaper. READ COMMITTED would only drop the
// gap locks; the wait for a held row that matches stays.
//
// Here the derived table picks the keys with FOR UPDATE SKIP LOCKED (MySQL
// 8.0+, MariaDB 10.6+): a range scan of idempotency_keys_expires_at_idx in
// index order that locks each row it returns and passes over, without
// waiting, each row another transaction holds. Two reapers therefore split
// the expired rows between them. STRAIGHT_JOIN makes those keys drive the
// delete through the primary key, so no other row is read or locked. The
// LIMIT keeps the derived table materialised rather than merged, which is
// also what allows a DELETE to read its own table (error 1093 otherwise).
//
// What it locks under REPEATABLE READ, InnoDB's default: for each deleted
// row, a next-key lock on its expires_at index entry (the entry and the gap
// below it, inside the expired range, where no write lands: records are
// written with an expires_at in the future) and a record lock on its primary
// key row. When fewer than limit rows are expired, InnoDB also locks the
// first live index entry past the range, and its row, before it sees that
// the range has ended (seen on MariaDB 10.11, and the plain form does the
// same); if another transaction holds that row, it is skipped, not waited
// for. Under READ COMMITTED the same, without the gaps. On the pool the
// statement is its own transaction, so the locks last one statement; in a
// caller's transaction, until it ends.
//
// Neither the locks nor the statement's form is what costs, so the
// alternatives were measured and not taken (MariaDB 10.11, two shared cores,
// the CPU time of the server thread that runs each form, the forms taking
// turns batch by batch on one table of expired rows). During an idembench
// reaper run under claim load InnoDB counted no row lock wait at all, so
// the claims' longer tail there comes from the CPU the delete and its purge
// take, not from locks. This statement costs about 14 µs of that thread per
// deleted row. The plain form costs about 0.95× as much, but waits for held
// rows. Reading the keys first (SELECT ... FOR UPDATE SKIP LOCKED in a
// transaction, then DELETE ... WHERE (scope, idempotency_key) IN (...) AND
// expires_at <= ?) costs 1.4×: two statements, and the keys travel both
// ways. Run at READ COMMITTED, this statement costs 1.3×, and it would only
// drop the gap locks, which no claim waits for. Batches of 4 000 rows cost
// about what batches of 1 000 do per row.
//
// Arguments: now, limit.
const deleteExpired = `DELETE k
FROM (
	SELECT scope, idempotency_key
	FROM idempotency_keys
	WHERE expires_at <= ` + now + `
	ORDER BY expires_at
	LIMIT ?
	FOR UPDATE SKIP LOCKED
) AS d
STRAIGHT_JOIN idempotency_keys AS k
	ON k.scope = d.scope AND k.idempotency_key = d.idempotency_key`

// Migration lock. GET_LOCK names are server-wide, so concurrent Migrate
// calls against any database on the server take turns; each holds the lock
// for the whole of goose's Up.
//
// Arguments of getMigrateLock: lock name, timeout in seconds. Of
// releaseMigrateLock: lock name.
const (
	getMigrateLock     = `SELECT GET_LOCK(?, ?)`
	releaseMigrateLock = `SELECT RELEASE_LOCK(?)`
)

// Cluster-wide migration lease: one row in migrateLeaseTable, inserted by
// the migrator that holds it and deleted when it is done. GET_LOCK is local
// to one server; on a Galera cluster two nodes grant it at once, while a
// row with one primary key can be committed by one of them only (the other
// meets the row, or fails certification). The holder renews the lease while
// goose runs; a lease whose holder died runs out and is deleted by the next
// migrator.
//
// Arguments of insertMigrateLease: holder, lease seconds. Of
// renewMigrateLease: lease seconds, holder. Of releaseMigrateLease: holder.
// deleteStaleMigrateLease takes none.
const (
	migrateLeaseTable = "idem_migrate_lock"

	createMigrateLeaseTable = `CREATE TABLE IF NOT EXISTS ` + migrateLeaseTable + ` (
	id         TINYINT     NOT NULL PRIMARY KEY,
	holder     VARBINARY(64) NOT NULL,
	expires_at DATETIME(6) NOT NULL
) ENGINE = InnoDB`
	insertMigrateLease = `INSERT INTO ` + migrateLeaseTable + ` (id, holder, expires_at)
VALUES (1, ?, UTC_TIMESTAMP(6) + INTERVAL ? SECOND)`
	renewMigrateLease = `UPDATE ` + migrateLeaseTable + `
SET expires_at = UTC_TIMESTAMP(6) + INTERVAL ? SECOND WHERE id = 1 AND holder = ?`
	releaseMigrateLease     = `DELETE FROM ` + migrateLeaseTable + ` WHERE id = 1 AND holder = ?`
	deleteStaleMigrateLease = `DELETE FROM ` + migrateLeaseTable + ` WHERE id = 1 AND expires_at < UTC_TIMESTAMP(6)`
)
