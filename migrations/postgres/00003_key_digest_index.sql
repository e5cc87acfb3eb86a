-- The index of the key digest (00002). It adds one entry per row version:
-- claims and completions each pay one more index insertion (completions
-- already cannot be HOT updates, expires_at being indexed).
--
-- Locks: CREATE INDEX takes a SHARE lock on idempotency_keys for the time
-- of the build: reads go on, claims and completions wait. On a large table,
-- migrate to version 2, build the index by hand without blocking writes:
--   CREATE INDEX CONCURRENTLY idempotency_keys_digest_idx
--     ON idempotency_keys (idempotency_keys_digest(scope, idempotency_key));
-- then migrate on: IF NOT EXISTS skips the build.

-- +goose Up
CREATE INDEX IF NOT EXISTS idempotency_keys_digest_idx
    ON idempotency_keys (idempotency_keys_digest(scope, idempotency_key));

-- +goose Down
DROP INDEX IF EXISTS idempotency_keys_digest_idx;
