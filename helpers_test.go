package idem_test

import (
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/sqlite"
)

// newSQLiteDialect returns a dialect on a fresh, migrated SQLite file.
func newSQLiteDialect(t *testing.T) *sqlite.Dialect {
	t.Helper()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, sqlite.Migrate(t.Context(), db))
	return sqlite.New(db)
}
