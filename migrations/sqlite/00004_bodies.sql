-- The table of response bodies kept in the database (sqlite.NewTableBodyStore,
-- an idem.TxBodyStore): a body too large for its record is written as rows of
-- at most the store's ChunkSize bytes, inside the transaction that commits the
-- record, and named by the record's body reference (the :idem-body header of
-- response_headers). Row 0 of every object exists and marks it; written_at is
-- the app's clock in microseconds since the Unix epoch, for the sweep's grace
-- period. Without a table body store the table stays empty.
--
-- Locks: the database's write lock, for an instant; nothing on idempotency_keys
-- is read or rewritten (a new, empty table is created).

-- +goose Up
CREATE TABLE idempotency_bodies (
    address    TEXT    NOT NULL,
    seq        INTEGER NOT NULL CHECK (seq >= 0),
    data       BLOB    NOT NULL,
    written_at INTEGER NOT NULL,
    PRIMARY KEY (address, seq)
);

-- +goose Down
DROP TABLE idempotency_bodies;
