package sqlite

import (
	"context"
	"database/sql"

	"github.com/idemstore/idem/migrations"
)

// Migrate applies idem's pending SQLite migrations to db with goose,
// recording versions in [migrations.VersionTable]. Running it again is a
// no-op. Each migration runs in a transaction; with a DB from [Open] it is
// BEGIN IMMEDIATE, so a concurrent writer waits for it.
//
// goose takes no lock on SQLite: run Migrate from one process at a time (at
// start-up of a single instance, or a deploy step). Up's error is returned
// unchanged, so a *goose.PartialError stays reachable with errors.As.
func Migrate(ctx context.Context, db *sql.DB) error {
	p, err := migrations.NewProvider(migrations.SQLite, db)
	if err != nil {
		return err
	}
	_, err = p.Up(ctx)
	return err
}
