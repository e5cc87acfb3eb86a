package migrations_test

import (
	"database/sql"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"
	_ "modernc.org/sqlite" // the "sqlite" driver, for running the SQLite files

	"github.com/idemstore/idem/migrations"
)

var dialects = []string{migrations.Postgres, migrations.MySQL, migrations.SQLite}

// openSQLite returns a handle on a new database file owned by t. sql.Open
// is lazy, so the handle also serves to build Providers for the server
// dialects, which never touch it.
func openSQLite(t *testing.T) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+filepath.Join(t.TempDir(), "m.db")+"?_pragma=busy_timeout(5000)&_txlock=immediate")
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// Every dialect directory holds the same versions, and goose sees every
// file in it (none is skipped for a bad name).
func TestVersionsMatchAcrossDialects(t *testing.T) {
	t.Parallel()
	db := openSQLite(t)

	versionsOf := func(dialect string) []int64 {
		t.Helper()
		fsys, err := migrations.FS(dialect)
		require.NoError(t, err)
		files, err := fs.Glob(fsys, "*")
		require.NoError(t, err)
		var fromFiles []int64
		for _, name := range files {
			require.True(t, strings.HasSuffix(name, ".sql"), "%s/%s is not a .sql file", dialect, name)
			v, err := goose.NumericComponent(name)
			require.NoError(t, err, "%s/%s", dialect, name)
			fromFiles = append(fromFiles, v)
		}

		p, err := migrations.NewProvider(dialect, db)
		require.NoError(t, err)
		var fromGoose []int64
		for _, src := range p.ListSources() {
			require.Equal(t, goose.TypeSQL, src.Type)
			fromGoose = append(fromGoose, src.Version)
		}
		require.Equal(t, fromFiles, fromGoose, "goose must see every file of %s", dialect)
		require.NotEmpty(t, fromGoose)
		return fromGoose
	}

	want := versionsOf(migrations.Postgres)
	for _, d := range dialects[1:] {
		require.Equal(t, want, versionsOf(d), "versions of %s differ from postgres", d)
	}
}

// Every file has exactly one Up and one Down section, so each can be rolled
// back. The server dialects' files are executed by their packages' tests.
func TestEveryFileHasUpAndDown(t *testing.T) {
	t.Parallel()
	for _, d := range dialects {
		fsys, err := migrations.FS(d)
		require.NoError(t, err)
		files, err := fs.Glob(fsys, "*.sql")
		require.NoError(t, err)
		for _, name := range files {
			b, err := fs.ReadFile(fsys, name)
			require.NoError(t, err)
			text := string(b)
			require.Equal(t, 1, strings.Count(text, "-- +goose Up"), "%s/%s", d, name)
			require.Equal(t, 1, strings.Count(text, "-- +goose Down"), "%s/%s", d, name)
			require.Less(t, strings.Index(text, "-- +goose Up"), strings.Index(text, "-- +goose Down"), "%s/%s", d, name)
		}
	}
}

// The SQLite files parse and apply, up and all the way down, leaving
// nothing of idem's schema behind but goose's version table.
func TestSQLiteUpAndDown(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db := openSQLite(t)

	p, err := migrations.NewProvider(migrations.SQLite, db)
	require.NoError(t, err)
	n := len(p.ListSources())

	up, err := p.Up(ctx)
	require.NoError(t, err)
	require.Len(t, up, n)
	current, err := p.GetDBVersion(ctx)
	require.NoError(t, err)
	require.Equal(t, p.ListSources()[n-1].Version, current)

	var tables int
	require.NoError(t, db.QueryRowContext(ctx,
		`SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN ('idempotency_keys', 'idempotency_bodies')`).Scan(&tables))
	require.Equal(t, 2, tables, "the records' table and the body table (00004)")

	// One version down removes the body table only.
	_, err = p.Down(ctx)
	require.NoError(t, err)
	require.NoError(t, db.QueryRowContext(ctx,
		`SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN ('idempotency_keys', 'idempotency_bodies')`).Scan(&tables))
	require.Equal(t, 1, tables)
	_, err = p.Up(ctx)
	require.NoError(t, err)

	down, err := p.DownTo(ctx, 0)
	require.NoError(t, err)
	require.Len(t, down, n)
	current, err = p.GetDBVersion(ctx)
	require.NoError(t, err)
	require.Zero(t, current)

	var left []string
	rows, err := db.QueryContext(ctx,
		`SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' AND tbl_name <> ?`, migrations.VersionTable)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var name string
		require.NoError(t, rows.Scan(&name))
		left = append(left, name)
	}
	require.NoError(t, rows.Err())
	require.Empty(t, left)
}

// Versions are recorded in idem's own table, not goose's default one.
func TestVersionTable(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db := openSQLite(t)
	p, err := migrations.NewProvider(migrations.SQLite, db)
	require.NoError(t, err)
	_, err = p.Up(ctx)
	require.NoError(t, err)

	var names []string
	rows, err := db.QueryContext(ctx, `SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE '%goose%'`)
	require.NoError(t, err)
	defer rows.Close()
	for rows.Next() {
		var name string
		require.NoError(t, rows.Scan(&name))
		names = append(names, name)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{migrations.VersionTable}, names)
}

func TestUnknownDialect(t *testing.T) {
	t.Parallel()
	db := openSQLite(t)
	for _, name := range []string{"", "sqlite3", "Postgres", "mariadb", ".", "../migrations", "postgres/"} {
		_, err := migrations.FS(name)
		require.Error(t, err, "FS(%q)", name)
		_, err = migrations.NewProvider(name, db)
		require.Error(t, err, "NewProvider(%q)", name)
	}
}

// SchemaVersion, which Check compares the database with, is the newest file.
func TestSchemaVersionIsNewest(t *testing.T) {
	for _, d := range []string{migrations.Postgres, migrations.MySQL, migrations.SQLite} {
		db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "v.db"))
		require.NoError(t, err)
		p, err := migrations.NewProvider(d, db)
		require.NoError(t, err)
		src := p.ListSources()
		require.Equal(t, migrations.SchemaVersion, src[len(src)-1].Version, d)
		require.NoError(t, db.Close())
	}
}
