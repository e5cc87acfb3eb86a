package postgres

import "regexp"

// Every statement takes its values as bind parameters, each with an explicit
// cast: under pgx's simple protocol (QueryExecModeSimpleProtocol, used behind
// PgBouncer) pgx inlines the parameters as untyped literals, and the casts
// give them the same types the extended protocol would infer.
//
// Times: a nullable pinned clock parameter, COALESCE($n::timestamptz,
// clock_timestamp()). clock_timestamp() and not now(): now() is the start of
// the transaction, which inside a long caller transaction would be stale.
// Statements that write several times compute the clock once, in a
// MATERIALIZED CTE, so created_at, updated_at and the deadlines derived from
// it agree to the microsecond. Durations arrive as whole microseconds
// (bigint) multiplied by interval '1 microsecond'.

// recordColumns is the column list every record read scans, in the order
// scanRecord expects.
const recordColumns = `scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at`

// recordColumnCount is the number of columns in recordColumns.
const recordColumnCount = 14

// The writes that may wait for another transaction holding the record (the
// claim's insert, a takeover, a lease renewal) run as one pgx batch: save
// the caller's lock_timeout and set ours (one statement), write, restore.
// The claim folds the first into its insert and the restore into its read
// of the record: two statements. set_config(..., is_local => true) lasts until the restore
// inside a caller's transaction, and is undone by a rollback.
//
// On the pool, the batch begins a transaction (pgx's Batch.BeginTx, no
// extra round trip) and the executor commits it in a second round trip,
// once it has read the results. A batch left to its implicit transaction
// would be committed by the server at the end of the batch, with or without
// the client: if the caller's context ends while the write waits, pgx
// closes the connection, but the server, which notices only when it next
// reads from it, finishes the write once the holder ends and commits it. A
// claim the caller was told was canceled would hold the key until its lease
// ran out. With the COMMIT still to come from the client, the server rolls
// the write back when it finds the connection closed.

// setLockTimeout stashes the caller's lock_timeout in a custom
// transaction-local setting (a batch cannot feed a result of one statement
// into a later one) and then bounds the write's wait: the claim's insert
// waits on an uncommitted holder's transaction lock, an UPDATE on the row
// lock of a transaction that changed the row, and lock_timeout applies to
// both waits (SQLSTATE 55P03 when it runs out). PostgreSQL evaluates a
// target list from left to right, so the save reads the caller's value
// before the set replaces it. $1 is a value such as '5000ms'.
const setLockTimeout = `SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true),
	set_config('lock_timeout', $1::text, true)`

// claimInsert inserts a processing record unless one exists for the key.
// ON CONFLICT DO NOTHING, not DO UPDATE: a replay takes no row lock and writes
// no WAL, and an existing record is never overwritten. It returns a row only
// when it inserted: the times it computed, from which, with the arguments,
// the executor builds the new record without scanning claimRead's row. Under
// REPEATABLE READ or SERIALIZABLE, a conflicting row the snapshot cannot see
// raises a serialization failure (40001).
//
// It also does setLockTimeout's work, so that the claim needs no statement
// of its own for it: the timeout CTE saves the caller's lock_timeout and
// sets ours ($8). The INSERT cannot check for a conflict, let alone wait on
// one, before its source row exists, and that row is read from clock, which
// reads from timeout: the setting is in place before any wait begins, and
// PostgreSQL reads lock_timeout when a wait starts.
//
// Only a claimer that holds the key's lock (keyLock1) may create a record,
// because Do's deferred claims hold that lock instead of a row. So the
// statement first looks for a committed record: when one is visible it
// inserts nothing, takes no lock (replays of a key do not queue behind
// each other) and leaves the decision to claimRead, whose newer snapshot
// may find the record gone, which the Store answers by claiming again.
// When none is visible it takes the key's lock, waiting for a transaction
// that holds it (another creator of the key) under our lock_timeout, and
// inserts; the conflict check then sees what that holder committed.
const claimInsert = `WITH timeout AS MATERIALIZED (
	SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true) AS saved,
		set_config('lock_timeout', $8::text, true) AS lock_timeout
), visible AS MATERIALIZED (
	SELECT EXISTS (
		SELECT 1 FROM idempotency_keys WHERE scope = $1::text AND idempotency_key = $2::text
	) AS found
	FROM timeout
), clock AS MATERIALIZED (
	SELECT ` + keyLock1 + ` AS locked, COALESCE($7::timestamptz, clock_timestamp()) AS ts
	FROM visible
	WHERE NOT visible.found
)
INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt,
	lease_expires_at, created_at, updated_at, expires_at
)
SELECT $1::text, $2::text, $3::bytea, 1, $4::bigint, 1,
	clock.ts + $5::bigint * interval '1 microsecond', clock.ts, clock.ts,
	clock.ts + $6::bigint * interval '1 microsecond'
FROM clock
ON CONFLICT (scope, idempotency_key) DO NOTHING
RETURNING lease_expires_at, created_at, expires_at`

// keyLock1 takes the key's lock: a transaction-level advisory lock on a
// 64-bit hash of the table, the scope ($1) and the key ($2), so that every
// claimer of a key serialises on it whether or not a row exists yet. Held
// until the transaction ends; its wait is bounded by lock_timeout like a
// row lock's (SQLSTATE 55P03). The table's oid seeds the hash, so tables in
// different schemas do not share locks; a collision of two keys' hashes
// (about 2^-64) only makes one claimer wait for the other's transaction.
// The void result is cast to text so the column has a type a CTE accepts.
const keyLock1 = `pg_advisory_xact_lock(` + keyHash1 + `)::text`

// keyHash1 is the key's lock id: the hash of the key ($2) seeded with the
// hash of the scope ($1), itself seeded with the table's oid.
const keyHash1 = `hashtextextended($2::text,
		hashtextextended($1::text, 'idempotency_keys'::regclass::oid::bigint))`

// claimLock is the first statement of a deferred claim (ClaimDeferred,
// Do's): it saves the caller's lock_timeout, sets ours ($3), and takes the
// key's lock, which waits for any transaction that created a record for the
// key (or holds a deferred claim) and has not ended; no row is written. It
// locks even when the key turns out to be completed: Do's transaction is
// short, and a replay that waits for it waits microseconds. claimRead follows, with a snapshot taken
// after the lock was granted (under READ COMMITTED, each statement takes
// one), so it sees the commit of the holder it waited for. The statement
// returns the transaction's isolation level: under REPEATABLE READ or
// SERIALIZABLE the snapshot dates from the transaction's first statement,
// and an absent record proves nothing, so the claim answers
// idem.ErrSkipDefer and the Store claims with an insert. The target list runs left to right: the timeout is in
// place before the wait begins.
const claimLock = `SELECT current_setting('transaction_isolation')
FROM (
	SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true) AS saved,
		set_config('lock_timeout', $3::text, true) AS lock_timeout,
		` + keyLock1 + ` AS locked
) l`

// claimTryLock is the first statement of a deferred claim: it tries the
// key's lock without waiting, so the common case needs no lock_timeout
// juggling. When another transaction holds the lock, the executor runs
// claimLock and claimRead, which wait under our lock_timeout. As claimInsert
// does, it first looks for a committed record and, when one is visible,
// takes no lock and returns NULL (CASE evaluates only the branch it
// chooses): a replay in a long caller transaction must not make the key's
// other replays wait for it. claimReadLocked, with a newer snapshot, then
// reads the record, or finds it gone, which the Store answers by claiming
// again. It also returns the isolation level, for the reason given at
// claimLock, and the clock: the claim's time.
const claimTryLock = `SELECT CASE
		WHEN EXISTS (SELECT 1 FROM idempotency_keys WHERE scope = $1::text AND idempotency_key = $2::text) THEN NULL
		ELSE ` + keyTryLock1 + `
	END,
	current_setting('transaction_isolation'), COALESCE($3::timestamptz, clock_timestamp())`

// keyTryLock1 is keyLock1 without the wait: true when the lock was granted.
const keyTryLock1 = `pg_try_advisory_xact_lock(` + keyHash1 + `)`

// claimReadLocked reads the record after claimTryLock, in a statement of
// its own so that its snapshot, under READ COMMITTED, is taken after the
// lock was granted: a plain primary-key read, no row when the key is free.
const claimReadLocked = `SELECT ` + recordColumns + `
FROM idempotency_keys
WHERE scope = $1::text AND idempotency_key = $2::text`

// completeInsert completes a deferred claim: it inserts the finished
// record, one row version, with the claim's token ($5), lease ($6) and
// creation time ($10). A plain INSERT: the key's lock keeps every other
// creator out, so a record that exists regardless was written by a claimer
// that does not take the lock (an older idem); the unique violation
// (23505) aborts the transaction, so that in the batch [completeInsert;
// COMMIT] the COMMIT rolls back, and the executor reports it as fenced.
// The clock is a one-row subquery, evaluated once.
const completeInsert = `INSERT INTO idempotency_keys (
	scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at
)
SELECT $1::text, $2::text, $3::bytea, $4::smallint, $5::bigint, 1, $6::timestamptz,
	$7::integer, $8::bytea, $9::bytea, $10::timestamptz, clock.ts, clock.ts,
	clock.ts + $11::bigint * interval '1 microsecond'
FROM (SELECT COALESCE($12::timestamptz, clock_timestamp()) AS ts) clock`

// restoreLockTimeout puts the caller's lock_timeout back right after the
// write, so our bound covers the write and nothing else (not the caller's
// later statements).
const restoreLockTimeout = `SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true)`

// claimRead restores the caller's lock_timeout, as restoreLockTimeout does,
// and reads the record as it is now, in one statement. Under READ COMMITTED
// each statement takes a new snapshot, so it sees the commit of a holder the
// insert waited for. It is a plain read, not FOR SHARE, to keep replays free
// of row locks and WAL.
//
// The restore sits in a one-row derived table on the preserved side of a
// LEFT JOIN, so it runs whether or not the record exists (a derived table
// with a volatile function is not flattened, and the preserved side is
// always read). Its column is not returned. No record gives one row whose
// record columns are NULL: the conflicting record was deleted after the
// insert saw it.
const claimRead = `SELECT ` + recordColumns + `, r.ts
FROM (
	SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true) AS restored,
		COALESCE($3::timestamptz, clock_timestamp()) AS ts
) r
LEFT JOIN idempotency_keys ON scope = $1::text AND idempotency_key = $2::text`

// takeover replaces the record with a new processing one, fenced by the token
// the caller read and by the condition that let the caller take it over:
// with $10, its retention ran out; with $11, it is processing and its lease
// ran out; with neither, the token alone (the caller reserved the record
// with a token of its own). Under READ COMMITTED an UPDATE blocked on a
// concurrent writer re-checks the whole WHERE on the row's newest version,
// with the same clock (the CTE row is fixed), so two takeovers racing on one
// token cannot both succeed, and a holder that completed or renewed in the
// meantime (keeping its token) is not overwritten. Under REPEATABLE READ
// and SERIALIZABLE a concurrent change is a serialization failure instead.
const takeover = `WITH clock AS MATERIALIZED (
	SELECT COALESCE($9::timestamptz, clock_timestamp()) AS ts
)
UPDATE idempotency_keys SET
	token = $4::bigint,
	fingerprint = $5::bytea,
	status = 1,
	attempt = $6::integer,
	lease_expires_at = clock.ts + $7::bigint * interval '1 microsecond',
	response_status = NULL,
	response_headers = NULL,
	response_body = NULL,
	created_at = clock.ts,
	updated_at = clock.ts,
	completed_at = NULL,
	expires_at = clock.ts + $8::bigint * interval '1 microsecond'
FROM clock
WHERE scope = $1::text AND idempotency_key = $2::text AND token = $3::bigint
	AND (NOT $10::boolean OR expires_at <= clock.ts)
	AND (NOT $11::boolean OR (status = 1 AND lease_expires_at <= clock.ts))`

// get reads a live record without locking it.
const get = `SELECT ` + recordColumns + `
FROM idempotency_keys
WHERE scope = $1::text AND idempotency_key = $2::text
	AND expires_at > COALESCE($3::timestamptz, clock_timestamp())`

// complete stores the final status and response, only while the record is
// processing and carries the caller's token.
const complete = `WITH clock AS MATERIALIZED (
	SELECT COALESCE($9::timestamptz, clock_timestamp()) AS ts
)
` + completeUpdate

// completeUpdate is the UPDATE of complete and completeOrFail, which
// precede it with the clock CTE.
const completeUpdate = `UPDATE idempotency_keys SET
	status = $4::smallint,
	response_status = $5::integer,
	response_headers = $6::bytea,
	response_body = $7::bytea,
	completed_at = clock.ts,
	updated_at = clock.ts,
	expires_at = clock.ts + $8::bigint * interval '1 microsecond'
FROM clock
WHERE scope = $1::text AND idempotency_key = $2::text AND token = $3::bigint AND status = 1`

// release deletes the record, only while it is processing and carries the
// caller's token and, with $4, its lease has run out (the reaper's hand-over
// of a stale lease: a holder that renewed meanwhile keeps its key; a DELETE
// blocked on that renewal re-checks the lease on the renewed row).
const release = `DELETE FROM idempotency_keys
WHERE scope = $1::text AND idempotency_key = $2::text AND token = $3::bigint AND status = 1
	AND (NOT $4::boolean OR lease_expires_at <= COALESCE($5::timestamptz, clock_timestamp()))`

// renewLease pushes the lease out and installs the new token, only while the
// record is processing and carries the caller's token and, with $7, its
// lease has run out (a reservation of a stale record must not take a lease
// its holder renewed meanwhile; an UPDATE blocked on that renewal re-checks
// the lease on the renewed row). The retention deadline moves out to the new
// lease expiry if it would come first, so a record whose lease is live is
// never past retention (a claim would take it over, the reaper delete it).
// RETURNING gives back the expiry exactly as stored, computed from the same
// clock reading as updated_at. No row means fenced.
const renewLease = `WITH clock AS MATERIALIZED (
	SELECT COALESCE($6::timestamptz, clock_timestamp()) AS ts
)
UPDATE idempotency_keys SET
	token = $4::bigint,
	lease_expires_at = clock.ts + $5::bigint * interval '1 microsecond',
	expires_at = GREATEST(expires_at, clock.ts + $5::bigint * interval '1 microsecond'),
	updated_at = clock.ts
FROM clock
WHERE scope = $1::text AND idempotency_key = $2::text AND token = $3::bigint AND status = 1
	AND (NOT $7::boolean OR lease_expires_at <= clock.ts)
RETURNING lease_expires_at`

// listStaleLeases reads the processing records whose lease ran out and whose
// retention has not, oldest lease first, without locking them. The literal
// status = 1 matches the predicate of idempotency_keys_stale_lease_idx, and
// the clock arrives from the LATERAL join as a value fixed for the scan, so
// lease_expires_at <= clock.ts can be that index's condition and its order
// can serve the ORDER BY (a volatile clock_timestamp() in the WHERE could be
// neither). The LEFT JOIN keeps the clock row when no lease is stale, so
// the caller always learns the time used: one row with NULL record columns.
// The outer ORDER BY keeps the inner order, which SQL does not promise
// through a join by itself.
const listStaleLeases = `WITH clock AS MATERIALIZED (
	SELECT COALESCE($1::timestamptz, clock_timestamp()) AS ts
)
SELECT stale.*, clock.ts
FROM clock
LEFT JOIN LATERAL (
	SELECT ` + recordColumns + `
	FROM idempotency_keys
	WHERE status = 1 AND lease_expires_at <= clock.ts AND expires_at > clock.ts
	ORDER BY lease_expires_at
	LIMIT $2::bigint
) stale ON true
ORDER BY stale.lease_expires_at`

// deleteExpired deletes at most $2 records past their retention deadline.
//
// The batch is chosen in a MATERIALIZED CTE, not in the IN subquery itself:
// a subquery with LIMIT and FOR UPDATE SKIP LOCKED may be planned on the
// inner side of a nested loop semi join and run again for each outer row,
// each run locking and returning further rows, so the statement would lock
// and delete more than $2 rows. A materialized CTE runs once; rescanning it
// rereads its stored rows.
//
// The batch walks idempotency_keys_expires_at_idx: the clock is an InitPlan
// ((SELECT ts FROM clock)), a value fixed for the statement and so usable as
// the index condition. FOR UPDATE SKIP LOCKED locks each row as the scan
// reaches it and passes over rows another transaction holds (a takeover or
// completion in an open claim transaction), so the reaper never waits on a
// claim and two reapers take disjoint batches; LIMIT stops the scan, so no
// row is locked that is not deleted. Under READ COMMITTED, a row updated
// and committed after the statement's snapshot is re-checked against
// expires_at on its newest version before it is locked.
//
// The DELETE finds each locked row by its ctid, the row version's physical
// address: a TID scan of ctid = ANY(ARRAY(...)) fetches each tuple directly,
// where finding it by primary key walked the key index once per row (on
// the load tool's 2-core machine the batch ran 3 to 5 times faster). The
// ctid the locking scan returns is that of the version it locked (the
// newest, after a concurrent update and the re-check); while this
// transaction holds the row lock no other writer can update or delete the
// row, so the ctid still names it when the DELETE runs, and no other row.
// One difference from a delete by key: a row whose newer version committed
// after the statement's snapshot (and is still expired) is locked through
// that version, which the DELETE's snapshot does not see; it is left, and
// its lock released, when the statement ends, for the next batch. No write
// of idem leaves a record expired, so this is a race with a hand-made
// update, not with claims.
// ARRAY(SELECT ...) is an InitPlan, computed once, so the plan stays a TID
// scan under a generic plan too.
const deleteExpired = `WITH clock AS MATERIALIZED (
	SELECT COALESCE($1::timestamptz, clock_timestamp()) AS ts
), batch AS MATERIALIZED (
	SELECT ctid
	FROM idempotency_keys
	WHERE expires_at <= (SELECT ts FROM clock)
	ORDER BY expires_at
	LIMIT $2::bigint
	FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_keys
WHERE ctid = ANY (ARRAY(SELECT ctid FROM batch))`

// migrationLockSchema names the schema Migrate creates its tables in
// without [WithSchema]: the first existing schema of the search_path.
const migrationLockSchema = `SELECT COALESCE(current_schema(), '')`

// completeOrFail is complete for the batch [completeOrFail; COMMIT] of
// CompleteCommit. A batch cannot skip its COMMIT on a result, only on an
// error: when the UPDATE matches no row (the claim was fenced), the SELECT
// divides by zero (SQLSTATE 22012, codeDivisionByZero), the server skips the
// rest of the batch and the transaction stays aborted until rolled back. A
// data-modifying CTE runs exactly once whether or not it is read; the count
// is read here so the error follows from its result. No other expression
// of the statement divides, so 22012 from it always means fenced.
const completeOrFail = `WITH clock AS MATERIALIZED (
	SELECT COALESCE($9::timestamptz, clock_timestamp()) AS ts
), completed AS (
` + completeUpdate + `
	RETURNING 1
)
SELECT 1 / (SELECT count(*)::integer FROM completed)`

// statements holds a Dialect's statements, with the table named as [New]
// was told: the constants above unchanged by default (the table found
// through search_path), or with [WithSchema] every reference to the table
// qualified, the key lock's regclass literal included, so the lock ids
// stay those of the same table reached through search_path.
type statements struct {
	claimInsert, claimLock, claimTryLock, claimReadLocked, claimRead, completeInsert,
	takeover, get, complete, completeOrFail, release, renewLease, listStaleLeases, deleteExpired string
	getCompleted string // replay.go
}

// tableRef matches the table's name in the constants above, not the longer
// names of its indexes and constraints, nor the idempotency_key column.
var tableRef = regexp.MustCompile(`\bidempotency_keys\b`)

// defaultStatements are the statements of a Dialect without [WithSchema].
var defaultStatements = newStatements("")

// newStatements returns the statements on table, a quoted qualified name,
// or on the unqualified idempotency_keys for "".
func newStatements(table string) *statements {
	q := func(sql string) string {
		if table == "" {
			return sql
		}
		return tableRef.ReplaceAllLiteralString(sql, table)
	}
	return &statements{
		claimInsert: q(claimInsert), claimLock: q(claimLock), claimTryLock: q(claimTryLock),
		claimReadLocked: q(claimReadLocked), claimRead: q(claimRead), completeInsert: q(completeInsert),
		takeover: q(takeover), get: q(get), complete: q(complete), completeOrFail: q(completeOrFail),
		release: q(release), renewLease: q(renewLease), listStaleLeases: q(listStaleLeases),
		deleteExpired: q(deleteExpired), getCompleted: q(getCompleted),
	}
}
