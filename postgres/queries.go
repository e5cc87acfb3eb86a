package postgres

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

// The claim runs as one pgx batch, one round trip: save the caller's
// lock_timeout, set ours, insert, restore, read. A batch runs in one implicit
// transaction when sent outside a transaction (a single Sync in the extended
// protocol, a single multi-statement Query in the simple protocol), so
// set_config(..., is_local => true) lasts exactly until the end of the batch
// there, and until the restore inside a caller's transaction.

// claimSaveLockTimeout stashes the caller's lock_timeout in a custom
// transaction-local setting, because a batch cannot feed a result of one
// statement into a later one.
const claimSaveLockTimeout = `SELECT set_config('idem.saved_lock_timeout', current_setting('lock_timeout'), true)`

// claimSetLockTimeout bounds the insert's wait on an uncommitted holder of
// the key: the insert waits on the holder's transaction lock, and
// lock_timeout applies to that wait (SQLSTATE 55P03 when it runs out). $1 is
// a value such as '5000ms'.
const claimSetLockTimeout = `SELECT set_config('lock_timeout', $1::text, true)`

// claimInsert inserts a processing record unless one exists for the key.
// ON CONFLICT DO NOTHING, not DO UPDATE: a replay takes no row lock and writes
// no WAL, and an existing record is never overwritten. It returns a row only
// when it inserted. Under REPEATABLE READ or SERIALIZABLE, a conflicting row
// the snapshot cannot see raises a serialization failure (40001).
const claimInsert = `WITH clock AS MATERIALIZED (
	SELECT COALESCE($7::timestamptz, clock_timestamp()) AS ts
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
RETURNING token`

// claimRestoreLockTimeout puts the caller's lock_timeout back before the read,
// so our bound covers the insert and nothing else.
const claimRestoreLockTimeout = `SELECT set_config('lock_timeout', current_setting('idem.saved_lock_timeout'), true)`

// claimRead reads the record as it is now. Under READ COMMITTED each
// statement takes a new snapshot, so it sees the commit of a holder the
// insert waited for. It is a plain read, not FOR SHARE, to keep replays free
// of row locks and WAL. No row means the conflicting record was deleted
// after the insert saw it.
const claimRead = `SELECT ` + recordColumns + `, COALESCE($3::timestamptz, clock_timestamp())
FROM idempotency_keys
WHERE scope = $1::text AND idempotency_key = $2::text`

// takeover replaces the record with a new processing one, fenced by the token
// the caller read. Under READ COMMITTED an UPDATE blocked on a concurrent
// writer re-checks the token on the row's newest version, so two takeovers
// racing on one token cannot both succeed.
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
WHERE scope = $1::text AND idempotency_key = $2::text AND token = $3::bigint`

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
UPDATE idempotency_keys SET
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
// caller's token.
const release = `DELETE FROM idempotency_keys
WHERE scope = $1::text AND idempotency_key = $2::text AND token = $3::bigint AND status = 1`

// migrationLockSchema names the schema Migrate creates its tables in: the
// first existing schema of the search_path.
const migrationLockSchema = `SELECT COALESCE(current_schema(), '')`
