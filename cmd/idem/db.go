package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/migrations"
	idemmysql "github.com/idemstore/idem/mysql"
	idempg "github.com/idemstore/idem/postgres"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// ops is what every command needs of an *idem.Store, whatever its
// transaction type.
type ops interface {
	Check(ctx context.Context) error
	Lookup(ctx context.Context, scope, key string) (*idem.Record, error)
	LookupDigest(ctx context.Context, d string) ([]*idem.Record, error)
	Delete(ctx context.Context, scope, key string, opts *idem.DeleteOptions) error
	PurgeScope(ctx context.Context, scope string, opts *idem.DeleteOptions) (int, error)
	ReleaseLease(ctx context.Context, scope, key string, token int64) error
	Stats(ctx context.Context) (*idem.Stats, error)
}

// target is an open database: the store's operations, its reaper, and its
// migrations.
type target struct {
	dialect string
	store   ops
	reap    func(ctx context.Context) (idem.ReapReport, error)
	up      func(ctx context.Context) error
	// provider builds a goose Provider for down and status.
	provider func() (*goose.Provider, error)
	close    func()
}

// usageError marks bad input: exit code 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, a ...any) error { return &usageError{msg: fmt.Sprintf(format, a...)} }

// open opens the database named by dsn. The DSN's own text never appears
// in an error: it may hold a password. create allows a SQLite file that
// does not exist yet (migrate up only).
func open(ctx context.Context, dsn, schema string, create bool) (*target, error) {
	switch {
	case dsn == "":
		return nil, usagef("no database: pass --db or set IDEM_DB (postgres://…, mysql://…, a SQLite path or sqlite://…)")
	case strings.HasPrefix(dsn, "postgres://"), strings.HasPrefix(dsn, "postgresql://"):
		return openPostgres(ctx, dsn, schema)
	case schema != "":
		return nil, usagef("--schema is for PostgreSQL only")
	case strings.HasPrefix(dsn, "mysql://"):
		return openMySQL(strings.TrimPrefix(dsn, "mysql://"))
	case strings.HasPrefix(dsn, "sqlite://"):
		return openSQLite(strings.TrimPrefix(dsn, "sqlite://"), create)
	case strings.Contains(dsn, "://"):
		scheme := dsn[:strings.Index(dsn, "://")]
		if len(scheme) > 20 || strings.ContainsAny(scheme, "@:/?") {
			scheme = "(unreadable)"
		}
		return nil, usagef("unknown dialect %q: want postgres://, mysql://, sqlite:// or a SQLite path", scheme)
	default:
		return openSQLite(dsn, create)
	}
}

func openPostgres(ctx context.Context, dsn, schema string) (*target, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, usagef("invalid PostgreSQL URL (not shown: it may hold a password)")
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, usagef("invalid PostgreSQL URL (not shown: it may hold a password)")
	}
	var opts []idempg.Option
	if schema != "" {
		opts = append(opts, idempg.WithSchema(schema))
	}
	st, err := idem.New(idempg.New(pool, opts...), nil)
	if err != nil {
		pool.Close()
		return nil, err
	}
	r, err := idem.NewReaper(st, nil)
	if err != nil {
		pool.Close()
		return nil, err
	}
	return &target{
		dialect: migrations.Postgres, store: st, reap: r.RunOnce,
		up: func(ctx context.Context) error { return idempg.Migrate(ctx, pool, opts...) },
		provider: func() (*goose.Provider, error) {
			// A connection of its own whose search_path is the schema, so
			// the files' unqualified names and goose's version table are
			// the schema's, as postgres.Migrate makes them.
			c := cfg.ConnConfig.Copy()
			if schema != "" {
				c.RuntimeParams["search_path"] = pgx.Identifier{schema}.Sanitize()
			}
			return migrations.NewProvider(migrations.Postgres, stdlib.OpenDB(*c))
		},
		close: pool.Close,
	}, nil
}

func openMySQL(dsn string) (*target, error) {
	if _, err := gomysql.ParseDSN(dsn); err != nil {
		return nil, usagef("invalid MySQL DSN after mysql:// (not shown: it may hold a password); want user:pass@tcp(host:3306)/db?parseTime=true")
	}
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		return nil, usagef("invalid MySQL DSN after mysql://")
	}
	db.SetMaxOpenConns(4)
	return sqlTarget(migrations.MySQL, db, idemmysql.New(db), func(ctx context.Context) error { return idemmysql.Migrate(ctx, db) })
}

func openSQLite(path string, create bool) (*target, error) {
	if path == "" {
		return nil, usagef("empty SQLite path")
	}
	if _, err := os.Stat(path); err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("SQLite file: %w", err)
		}
		if !create {
			return nil, usagef("no SQLite database at that path (only `migrate up` creates one)")
		}
	}
	db, err := idemsqlite.Open(path)
	if err != nil {
		return nil, usagef("%v", err)
	}
	return sqlTarget(migrations.SQLite, db, idemsqlite.New(db), func(ctx context.Context) error { return idemsqlite.Migrate(ctx, db) })
}

func sqlTarget(dialect string, db *sql.DB, d idem.Dialect[*sql.Tx], up func(context.Context) error) (*target, error) {
	st, err := idem.New(d, nil)
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	r, err := idem.NewReaper(st, nil)
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	return &target{
		dialect: dialect, store: st, reap: r.RunOnce, up: up,
		provider: func() (*goose.Provider, error) { return migrations.NewProvider(dialect, db) },
		close:    func() { _ = db.Close() },
	}, nil
}
