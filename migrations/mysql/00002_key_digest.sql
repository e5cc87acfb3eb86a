-- Look-up by key digest (idem.Store.LookupDigest, `idem inspect --digest`):
-- log lines carry the first 8 bytes of SHA-256(scope NUL key), and this
-- index finds the record behind one without reading the whole table.
--
-- A VIRTUAL generated column: the server computes it, the claim statements
-- write nothing more, and rows written by an older idem during a rolling
-- deploy are covered. Only the index stores it; an insert pays one more
-- index entry, a completion none (scope and key never change).
--
-- One statement, as in 00001. Locks: ALGORITHM=INPLACE, LOCK=NONE: the
-- index is built while claims and completions go on (a metadata lock is
-- taken briefly at the start and the end). A server that cannot build it
-- online refuses the statement rather than blocking writes.

-- +goose Up
ALTER TABLE idempotency_keys
    ADD COLUMN key_digest BINARY(8)
        AS (UNHEX(LEFT(SHA2(CONCAT(scope, 0x00, idempotency_key), 256), 16))) VIRTUAL,
    ADD INDEX idempotency_keys_digest_idx (key_digest),
    ALGORITHM = INPLACE, LOCK = NONE;

-- +goose Down
ALTER TABLE idempotency_keys DROP INDEX idempotency_keys_digest_idx, DROP COLUMN key_digest;
