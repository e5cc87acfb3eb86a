package sqlite

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/idemstore/idem/migrations"
)

// Migrate applies idem's pending SQLite migrations to db with goose,
// recording versions in [migrations.VersionTable]. Running it again is a
// no-op. Each migration runs in a transaction; with a DB from [Open] it is
// BEGIN IMMEDIATE, so a concurrent writer waits for it.
//
// goose takes no lock on SQLite: run Migrate from one process at a time (at
// start-up of a single instance, or a deploy step). After the migrations it
// fills in the key digest (migration 00002) of rows that lack one, in
// transactions of 500 rows. Up's error is returned
// unchanged, so a *goose.PartialError stays reachable with errors.As.
func Migrate(ctx context.Context, db *sql.DB) error {
	// goose's errors do not say whether the database was reachable: a
	// closed *sql.DB or an unopenable file is found here first, and
	// classified as every other statement's error is.
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("idem: sqlite: migrate: %w", interpretError(err))
	}
	p, err := migrations.NewProvider(migrations.SQLite, db)
	if err != nil {
		return err
	}
	if _, err := p.Up(ctx); err != nil {
		return err
	}
	// Migration 00002 added key_digest, which SQLite cannot compute: rows
	// written before it (or since, by an older idem) get theirs here.
	if _, err := backfillDigests(ctx, db, 500); err != nil {
		return fmt.Errorf("idem: sqlite: migrate: back-fill key digests: %w", err)
	}
	return nil
}
