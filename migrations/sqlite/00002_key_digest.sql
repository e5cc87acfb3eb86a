-- Look-up by key digest (idem.Store.LookupDigest, `idem inspect --digest`):
-- log lines carry the first 8 bytes of SHA-256(scope NUL key); this column
-- holds it and 00003 indexes it, so a look-up reads one index entry instead
-- of the whole table.
--
-- SQLite has no SHA-256 function, so the column is written from Go by the
-- two statements that insert records (a claim, a deferred completion).
-- Rows that predate this migration, or were written by an older idem, have
-- NULL; sqlite.Migrate fills them in after the migrations, in batches, and
-- a look-up also reads the NULL rows (through the same index), so none is
-- missed before that.
--
-- Locks: the database's write lock, for a change of the schema only.

-- +goose Up
ALTER TABLE idempotency_keys ADD COLUMN key_digest BLOB;

-- +goose Down
ALTER TABLE idempotency_keys DROP COLUMN key_digest;
