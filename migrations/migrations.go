// Package migrations embeds idem's schema for each dialect as goose SQL files
// and builds goose Providers over them.
//
// The files live in postgres/, mysql/ and sqlite/ with the same version
// numbers in every directory. They work unchanged from the goose command line
// (goose -dir migrations/postgres -table idem_goose_db_version postgres "$DSN"
// up) and can be copied into
// an application's own migration set; see docs/migrations.md.
//
// idem never creates tables at run time: call the dialect's Migrate helper
// ([github.com/idemstore/idem/postgres.Migrate] and its siblings) at start-up
// or from a deploy step, or apply the files with your own tool.
package migrations

import (
	"database/sql"
	"embed"
	"fmt"
	"io/fs"

	"github.com/pressly/goose/v3"
)

//go:embed postgres/*.sql mysql/*.sql sqlite/*.sql
var files embed.FS

// VersionTable is the goose version table idem uses, separate from the
// application's own goose_db_version so the two never collide.
const VersionTable = "idem_goose_db_version"

// SchemaVersion is the newest migration version in every dialect's
// directory: the schema this version of idem reads and writes. A Check
// (idem.Store.Check) reports a database whose version table is behind it.
const SchemaVersion int64 = 4

// Dialect names accepted by [FS] and [NewProvider].
const (
	Postgres = "postgres"
	MySQL    = "mysql"
	SQLite   = "sqlite"
)

// FS returns the migration files for dialect ("postgres", "mysql" or "sqlite").
func FS(dialect string) (fs.FS, error) {
	if _, err := gooseDialect(dialect); err != nil {
		return nil, err
	}
	sub, err := fs.Sub(files, dialect)
	if err != nil {
		return nil, fmt.Errorf("idem: migrations for %s: %w", dialect, err)
	}
	return sub, nil
}

// NewProvider returns a goose Provider over idem's migrations for dialect,
// recording versions in [VersionTable] and ignoring goose's global registry
// of Go migrations. Extra options are appended after idem's defaults.
//
// The Provider takes no lock by itself: pass a goose session locker in
// opts, or serialise concurrent migrations around it. The dialects' Migrate
// helpers do: PostgreSQL with goose's advisory-lock session locker, MySQL
// with GET_LOCK held around the whole of Up (goose checks for pending
// migrations before it takes a session lock, which MySQL's non-transactional
// DDL turns into a race). SQLite's Migrate takes no lock: run it from one
// process at a time.
func NewProvider(dialect string, db *sql.DB, opts ...goose.ProviderOption) (*goose.Provider, error) {
	gd, err := gooseDialect(dialect)
	if err != nil {
		return nil, err
	}
	fsys, err := FS(dialect)
	if err != nil {
		return nil, err
	}
	all := append([]goose.ProviderOption{
		goose.WithTableName(VersionTable),
		goose.WithDisableGlobalRegistry(true),
	}, opts...)
	p, err := goose.NewProvider(gd, db, fsys, all...)
	if err != nil {
		return nil, fmt.Errorf("idem: migrations provider for %s: %w", dialect, err)
	}
	return p, nil
}

func gooseDialect(dialect string) (goose.Dialect, error) {
	switch dialect {
	case Postgres:
		return goose.DialectPostgres, nil
	case MySQL:
		return goose.DialectMySQL, nil
	case SQLite:
		return goose.DialectSQLite3, nil
	default:
		return "", fmt.Errorf("idem: unknown migrations dialect %q (want postgres, mysql or sqlite)", dialect)
	}
}
