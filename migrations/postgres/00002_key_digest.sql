-- Look-up by key digest (idem.Store.LookupDigest, `idem inspect --digest`):
-- log lines carry the first 8 bytes of SHA-256(scope NUL key); 00003
-- indexes this function of each row, so a look-up reads one index entry
-- instead of the whole table.
--
-- The digest is computed by the database, in an expression index, so the
-- claim statements write nothing more and rows written by an older idem
-- during a rolling deploy are indexed too. convert_to is only STABLE (it
-- depends on the database's encoding, which never changes for a database),
-- hence this IMMUTABLE wrapper, which an index expression needs.
--
-- Locks: none on idempotency_keys.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION idempotency_keys_digest(scope text, idempotency_key text) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$ SELECT substring(sha256(convert_to(scope, 'UTF8') || '\x00'::bytea || convert_to(idempotency_key, 'UTF8')) FROM 1 FOR 8) $$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION IF EXISTS idempotency_keys_digest(text, text);
