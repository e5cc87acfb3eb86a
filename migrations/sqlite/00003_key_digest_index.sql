-- The index of the key digest column (00002).
--
-- Locks: the database's write lock for the build, which reads every row once.

-- +goose Up
CREATE INDEX idempotency_keys_digest_idx ON idempotency_keys (key_digest);

-- +goose Down
DROP INDEX idempotency_keys_digest_idx;
