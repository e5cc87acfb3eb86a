-- The table of response bodies kept in the database (postgres.NewTableBodyStore,
-- an idem.TxBodyStore): a body too large for its record is written as rows of
-- at most the store's ChunkSize bytes, inside the transaction that commits the
-- record, and named by the record's body reference (the :idem-body header of
-- response_headers). Row 0 of every object exists and marks it; written_at is
-- the app's clock, for the sweep's grace period. Without a table body store
-- the table stays empty.
--
-- Locks: none on idempotency_keys; a new, empty table is created.

-- +goose Up
CREATE TABLE idempotency_bodies (
    address    text        NOT NULL,
    seq        bigint      NOT NULL,
    data       bytea       NOT NULL,
    written_at timestamptz NOT NULL,
    CONSTRAINT idempotency_bodies_pkey PRIMARY KEY (address, seq),
    CONSTRAINT idempotency_bodies_seq_check CHECK (seq >= 0)
);

-- +goose Down
DROP TABLE idempotency_bodies;
