package postgres

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"strings"
	"testing/fstest"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/idemstore/idem/migrations"
)

// migrationLockWait bounds Migrate's wait for another Migrate of the same
// schema, as lock_timeout.
const migrationLockWait = "300s"

// Migrate applies idem's pending migrations, recording versions in
// [migrations.VersionTable] next to the table. With [WithSchema] (pass the
// options given to [New]) the tables go into that schema whatever the
// search_path; without it, into the schema the pool's search_path resolves
// to (its first existing schema). Running it again when the schema is up to
// date does nothing, so it is safe to call at every start-up.
//
// Concurrent calls on one schema (several replicas starting together)
// serialise on a transaction-level advisory lock held, for the whole run,
// by a connection of Migrate's own (opened with the pool's connection
// settings, outside the pool), waiting up to five minutes for it. A
// transaction keeps its server connection through a transaction pooler,
// so the lock holds through PgBouncer in transaction pooling mode too;
// the lock ID is the one earlier versions took as a session lock, derived
// from the schema name, so migrations of other schemas, and the
// application's own goose migrations, never wait for it. The migrations
// themselves run on the pool.
//
// It returns the error of the goose Provider's Up unchanged, so a
// *goose.PartialError stays reachable with errors.As.
func Migrate(ctx context.Context, pool *pgxpool.Pool, opts ...Option) error {
	o := applyOptions(opts)
	if o.err != nil {
		return o.err
	}
	// Without a schema, the query naming it finds a closed or unreachable
	// pool; with one, Ping does: the migration lock takes a connection of
	// its own, outside the pool, and goose's error for a closed pool is
	// unclassified.
	schema := o.schema
	var err error
	if schema == "" {
		err = pool.QueryRow(ctx, migrationLockSchema).Scan(&schema)
	} else {
		err = pool.Ping(ctx)
	}
	if err != nil {
		return fmt.Errorf("idem: postgres: migrate: %w", interpretError(ctx, err))
	}
	fsys, err := migrations.FS(migrations.Postgres)
	if err != nil {
		return err
	}
	table := migrations.VersionTable
	if o.schema != "" {
		table = o.versionTable()
		if fsys, err = inSchema(fsys, o.schema); err != nil {
			return err
		}
	}
	unlock, err := migrationLock(ctx, pool, schema)
	if err != nil {
		return err
	}
	defer unlock()
	db := stdlib.OpenDBFromPool(pool) // closing db leaves pool open
	defer db.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, db, fsys,
		goose.WithTableName(table), goose.WithDisableGlobalRegistry(true))
	if err != nil {
		return fmt.Errorf("idem: postgres: migrations provider: %w", err)
	}
	_, err = p.Up(ctx)
	return err
}

// migrationLock takes schema's migration lock in a transaction on a
// connection of its own, and returns the function that ends it.
func migrationLock(ctx context.Context, pool *pgxpool.Pool, schema string) (func(), error) {
	pcfg := pool.Config()
	cc := pcfg.ConnConfig // a copy
	if pcfg.BeforeConnect != nil {
		if err := pcfg.BeforeConnect(ctx, cc); err != nil {
			return nil, fmt.Errorf("idem: postgres: migration lock: %w", err)
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return nil, fmt.Errorf("idem: postgres: migration lock: %w", interpretError(ctx, err))
	}
	closeConn := func() {
		// ROLLBACK first: a pooler then gets its server connection back
		// idle, rather than having to drop it.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
		defer cancel()
		_, _ = conn.Exec(cctx, "ROLLBACK")
		_ = conn.Close(cctx)
	}
	if pcfg.AfterConnect != nil {
		if err := pcfg.AfterConnect(ctx, conn); err != nil {
			closeConn()
			return nil, fmt.Errorf("idem: postgres: migration lock: %w", err)
		}
	}
	// If the process dies, the closed connection ends the transaction and
	// its lock, also through a pooler (which drops a server connection its
	// client left inside a transaction).
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue(`SELECT set_config('lock_timeout', $1::text, true)`, migrationLockWait)
	b.Queue(`SELECT pg_advisory_xact_lock($1::bigint)::text`, migrationLockID(schema))
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		closeConn()
		return nil, fmt.Errorf("idem: postgres: migration lock: %w", interpretError(ctx, err))
	}
	return closeConn, nil
}

// inSchema returns idem's migrations with each section (Up, Down) made to
// begin with SET LOCAL search_path to schema: the shipped files name their
// tables unqualified, and goose runs each migration in a transaction, to
// which SET LOCAL is confined (so a transaction pooler leaks it nowhere).
// A migration outside a transaction would lose that guarantee: refused.
func inSchema(src fs.FS, schema string) (fs.FS, error) {
	set := "SET LOCAL search_path TO " + pgx.Identifier{schema}.Sanitize() + ";"
	out := fstest.MapFS{}
	names, err := fs.Glob(src, "*.sql")
	if err != nil {
		return nil, err
	}
	for _, name := range names {
		data, err := fs.ReadFile(src, name)
		if err != nil {
			return nil, err
		}
		var sb strings.Builder
		sc := bufio.NewScanner(strings.NewReader(string(data)))
		sc.Buffer(nil, len(data)+1)
		for sc.Scan() {
			line := sc.Text()
			sb.WriteString(line)
			sb.WriteByte('\n')
			switch strings.Join(strings.Fields(line), " ") {
			case "-- +goose Up", "-- +goose Down":
				sb.WriteString(set)
				sb.WriteByte('\n')
			case "-- +goose NO TRANSACTION":
				return nil, errors.New("idem: postgres: migration " + name + " runs outside a transaction, which WithSchema cannot confine to the schema")
			}
		}
		if err := sc.Err(); err != nil {
			return nil, err
		}
		out[name] = &fstest.MapFile{Data: []byte(sb.String()), Mode: 0o444}
	}
	return out, nil
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
