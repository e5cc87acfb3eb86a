-- idem schema for SQLite. Times are INTEGER microseconds since the Unix epoch
-- (UTC): exact, cheap to compare, and free of text-format ambiguity.
-- status: 1 processing, 2 succeeded, 3 failed (idem.Status).

-- +goose Up
CREATE TABLE idempotency_keys (
    scope            TEXT    NOT NULL,
    idempotency_key  TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    status           INTEGER NOT NULL CHECK (status IN (1, 2, 3)),
    token            INTEGER NOT NULL,
    attempt          INTEGER NOT NULL,
    lease_expires_at INTEGER NOT NULL,
    response_status  INTEGER,
    response_headers BLOB,
    response_body    BLOB,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    completed_at     INTEGER,
    expires_at       INTEGER NOT NULL,
    PRIMARY KEY (scope, idempotency_key)
);

-- The reaper deletes by retention deadline in small batches.
CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);

-- The reaper looks for processing rows whose lease ran out.
CREATE INDEX idempotency_keys_stale_lease_idx ON idempotency_keys (lease_expires_at) WHERE status = 1;

-- +goose Down
DROP TABLE idempotency_keys;
