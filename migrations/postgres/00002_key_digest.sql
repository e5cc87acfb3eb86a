-- Look-up by key digest (idem.Store.LookupDigest, `idem inspect --digest`):
-- log lines carry the first 8 bytes of SHA-256(scope NUL key), and this
-- index finds the record behind one without reading the whole table.
--
-- The digest is computed by the database, in an expression index, so the
-- claim statements write nothing more and rows written by an older idem
-- during a rolling deploy are indexed too. convert_to is only STABLE (it
-- depends on the database's encoding, which never changes for a database),
-- hence the IMMUTABLE wrapper an index expression needs. The index adds one
-- entry per row version: claims and completions each pay one more index
-- insertion (completions already cannot be HOT updates, expires_at being
-- indexed).
--
-- Locks: CREATE INDEX takes a SHARE lock on idempotency_keys for the time
-- of the build: reads go on, claims and completions wait. On a large table
-- build it first, by hand, without blocking writes, then migrate (IF NOT
-- EXISTS then skips the build):
--   the CREATE FUNCTION below, then
--   CREATE INDEX CONCURRENTLY idempotency_keys_digest_idx
--     ON idempotency_keys (idempotency_keys_digest(scope, idempotency_key));

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idempotency_keys_digest(scope text, idempotency_key text) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT substring(sha256(convert_to(scope, 'UTF8') || '\x00'::bytea || convert_to(idempotency_key, 'UTF8')) FROM 1 FOR 8) $$;
-- +goose StatementEnd

CREATE INDEX IF NOT EXISTS idempotency_keys_digest_idx
    ON idempotency_keys (idempotency_keys_digest(scope, idempotency_key));

-- +goose Down
DROP INDEX IF EXISTS idempotency_keys_digest_idx;
DROP FUNCTION IF EXISTS idempotency_keys_digest(text, text);
