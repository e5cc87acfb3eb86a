package postgres

import (
	"context"
	"fmt"
	"hash/fnv"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/idemstore/idem/migrations"
)

// Migrate applies idem's pending migrations to the schema the pool's
// search_path resolves to (its first existing schema), recording versions in
// [migrations.VersionTable] there. Running it again when the schema is up to
// date does nothing, so it is safe to call at every start-up.
//
// Concurrent calls on one schema (several replicas starting together)
// serialise on a session-level advisory lock, retried every second for up to
// five minutes; the lock ID is derived from the schema name, so migrations of
// other schemas, and the application's own goose migrations, never wait for
// it. Migrate holds one pool connection while it runs.
//
// It returns the error of the goose Provider's Up unchanged, so a
// *goose.PartialError stays reachable with errors.As.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	var schema string
	if err := pool.QueryRow(ctx, migrationLockSchema).Scan(&schema); err != nil {
		return fmt.Errorf("idem: postgres: migrate: %w", interpretError(ctx, err))
	}
	locker, err := lock.NewPostgresSessionLocker(
		lock.WithLockID(migrationLockID(schema)),
		lock.WithLockTimeout(1, 300),
	)
	if err != nil {
		return fmt.Errorf("idem: postgres: migration locker: %w", err)
	}
	db := stdlib.OpenDBFromPool(pool) // closing db leaves pool open
	defer db.Close()
	p, err := migrations.NewProvider(migrations.Postgres, db, goose.WithSessionLocker(locker))
	if err != nil {
		return err
	}
	_, err = p.Up(ctx)
	return err
}

// migrationLockID derives the advisory lock ID for schema. Advisory locks are
// per database, not per schema, so a fixed ID would make migrations of
// unrelated schemas queue behind each other.
func migrationLockID(schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("idem migrations\x00"))
	h.Write([]byte(schema))
	return int64(h.Sum64()) //nolint:gosec // any 64 bits will do for a lock ID
}
