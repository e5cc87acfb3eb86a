package idemchi_test

import (
	"context"
	"database/sql"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// newStore returns a store on a fresh SQLite file, and the database.
func newStore(t *testing.T) (*idem.Store[*sql.Tx], *sql.DB) {
	t.Helper()
	db, err := idemsqlite.Open(filepath.Join(t.TempDir(), "idem.db"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, idemsqlite.Migrate(context.Background(), db))
	store, err := idem.New(idemsqlite.New(db), nil)
	require.NoError(t, err)
	return store, db
}

// records counts the stored idempotency records.
func records(t *testing.T, db *sql.DB) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRowContext(context.Background(), `SELECT count(*) FROM idempotency_keys`).Scan(&n))
	return n
}

type answer struct {
	status   int
	body     string
	replayed bool
	code     string
}

// post sends a POST with key (none if empty) and body to srv.
func post(t *testing.T, srv *httptest.Server, path, key, body string) answer {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, srv.URL+path, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	a := answer{status: resp.StatusCode, body: string(b), replayed: resp.Header.Get("Idempotency-Replayed") == "true"}
	if resp.Header.Get("Content-Type") == "application/json" && strings.Contains(a.body, `"code"`) {
		a.code = codeOf(a.body)
	}
	return a
}

func codeOf(body string) string {
	const p = `"code":"`
	i := strings.Index(body, p)
	if i < 0 {
		return ""
	}
	rest := body[i+len(p):]
	return rest[:strings.IndexByte(rest, '"')]
}

func mustStore(t *testing.T) *idem.Store[*sql.Tx] {
	s, _ := newStore(t)
	return s
}
