-- The index of the key digest column (00002).
--
-- Locks: ALGORITHM=INPLACE, LOCK=NONE: the index is built while claims and
-- completions go on (an exclusive metadata lock is taken briefly at the
-- start and the end). A server that cannot build it online refuses the
-- statement rather than blocking writes.

-- +goose Up
ALTER TABLE idempotency_keys ADD INDEX idempotency_keys_digest_idx (key_digest), ALGORITHM = INPLACE, LOCK = NONE;

-- +goose Down
ALTER TABLE idempotency_keys DROP INDEX idempotency_keys_digest_idx;
