-- The table of response bodies kept in the database (mysql.NewTableBodyStore,
-- an idem.TxBodyStore): a body too large for its record is written as rows of
-- at most the store's ChunkSize bytes (each must fit max_allowed_packet),
-- inside the transaction that commits the record, and named by the record's
-- body reference (the :idem-body header of response_headers). Row 0 of every
-- object exists and marks it; written_at is the app's clock (UTC), for the
-- sweep's grace period. Without a table body store the table stays empty.
-- One statement, as in 00001.
--
-- Locks: none on idempotency_keys; a new, empty table is created.

-- +goose Up
CREATE TABLE idempotency_bodies (
    address    VARBINARY(96) NOT NULL,
    seq        BIGINT        NOT NULL,
    data       MEDIUMBLOB    NOT NULL,
    written_at DATETIME(6)   NOT NULL,
    PRIMARY KEY (address, seq)
) ENGINE = InnoDB;

-- +goose Down
DROP TABLE idempotency_bodies;
