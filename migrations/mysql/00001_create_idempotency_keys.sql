-- idem schema for MySQL 8.0+ and MariaDB 10.6+ (InnoDB).
-- One statement: MySQL commits each DDL statement implicitly, so a file with
-- a single statement leaves a clean version boundary if it fails.
-- Keys and scopes are VARBINARY so that they compare byte for byte whatever
-- the server's default collation ("Key" and "key" are different keys).
-- Times are DATETIME(6) holding UTC. status: 1 processing, 2 succeeded, 3 failed.

-- +goose Up
CREATE TABLE idempotency_keys (
    scope            VARBINARY(255) NOT NULL,
    idempotency_key  VARBINARY(255) NOT NULL,
    fingerprint      BINARY(32)     NOT NULL,
    status           SMALLINT       NOT NULL,
    token            BIGINT         NOT NULL,
    attempt          INT            NOT NULL,
    lease_expires_at DATETIME(6)    NOT NULL,
    response_status  INT            NULL,
    response_headers MEDIUMBLOB     NULL,
    response_body    LONGBLOB       NULL,
    created_at       DATETIME(6)    NOT NULL,
    updated_at       DATETIME(6)    NOT NULL,
    completed_at     DATETIME(6)    NULL,
    expires_at       DATETIME(6)    NOT NULL,
    PRIMARY KEY (scope, idempotency_key),
    INDEX idempotency_keys_expires_at_idx (expires_at),
    INDEX idempotency_keys_stale_lease_idx (status, lease_expires_at)
) ENGINE = InnoDB;

-- +goose Down
DROP TABLE idempotency_keys;
