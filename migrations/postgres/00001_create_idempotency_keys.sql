-- idem schema for PostgreSQL. Times are timestamptz (microseconds, UTC).
-- status: 1 processing, 2 succeeded, 3 failed (idem.Status).

-- +goose Up
CREATE TABLE idempotency_keys (
    scope            text        NOT NULL,
    idempotency_key  text        NOT NULL,
    fingerprint      bytea       NOT NULL,
    status           smallint    NOT NULL,
    token            bigint      NOT NULL,
    attempt          integer     NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    response_status  integer,
    response_headers bytea,
    response_body    bytea,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    completed_at     timestamptz,
    expires_at       timestamptz NOT NULL,
    CONSTRAINT idempotency_keys_pkey PRIMARY KEY (scope, idempotency_key),
    CONSTRAINT idempotency_keys_status_check CHECK (status IN (1, 2, 3)),
    CONSTRAINT idempotency_keys_fingerprint_check CHECK (octet_length(fingerprint) = 32)
);

-- The reaper deletes by retention deadline in small batches.
CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);

-- The reaper looks for processing rows whose lease ran out; completed rows,
-- the vast majority, stay out of this index.
CREATE INDEX idempotency_keys_stale_lease_idx ON idempotency_keys (lease_expires_at) WHERE status = 1;

-- +goose Down
DROP TABLE idempotency_keys;
