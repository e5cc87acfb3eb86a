-- Look-up by key digest (idem.Store.LookupDigest, `idem inspect --digest`):
-- log lines carry the first 8 bytes of SHA-256(scope NUL key); this column
-- holds it and 00003 indexes it, so a look-up reads one index entry instead
-- of the whole table.
--
-- A VIRTUAL generated column: the server computes it, the claim statements
-- write nothing more, and rows written by an older idem during a rolling
-- deploy are covered. Only the index (00003) stores it; an insert pays one
-- more index entry, a completion none (scope and key never change).
--
-- One statement per file, as in 00001 (MySQL commits each DDL statement).
-- Locks: ALGORITHM=INSTANT, a change of the table's metadata only, under a
-- brief exclusive metadata lock; a server that cannot do it instantly
-- refuses the statement rather than rebuilding the table.

-- +goose Up
ALTER TABLE idempotency_keys
    ADD COLUMN key_digest BINARY(8)
        AS (UNHEX(LEFT(SHA2(CONCAT(scope, 0x00, idempotency_key), 256), 16))) VIRTUAL,
    ALGORITHM = INSTANT;

-- +goose Down
ALTER TABLE idempotency_keys DROP COLUMN key_digest;
