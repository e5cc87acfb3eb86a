-- Look-up by key digest (idem.Store.LookupDigest, `idem inspect --digest`):
-- log lines carry the first 8 bytes of SHA-256(scope NUL key), and this
-- index finds the record behind one without reading the whole table.
--
-- SQLite has no SHA-256 function, so the column is written from Go by the
-- two statements that insert records (a claim, a deferred completion).
-- Rows that predate this migration, or were written by an older idem, have
-- NULL; sqlite.Migrate fills them in after this file, in batches, and a
-- look-up also reads the NULL rows (through the same index), so none is
-- missed before that.
--
-- Locks: the database's write lock for the ALTER (a schema change only) and
-- the index build, which reads every row once.

-- +goose Up
ALTER TABLE idempotency_keys ADD COLUMN key_digest BLOB;
CREATE INDEX idempotency_keys_digest_idx ON idempotency_keys (key_digest);

-- +goose Down
DROP INDEX idempotency_keys_digest_idx;
ALTER TABLE idempotency_keys DROP COLUMN key_digest;
