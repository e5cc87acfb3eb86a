package sqlite

import (
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	_ "modernc.org/sqlite" // registers the "sqlite" database/sql driver
)

// dsnParams configures every connection Open makes; see the package
// documentation for why each is needed. busy_timeout is applied first by the
// driver, so the other PRAGMAs wait for a lock instead of failing.
const dsnParams = "_pragma=journal_mode(WAL)" +
	"&_pragma=busy_timeout(5000)" +
	"&_pragma=synchronous(FULL)" +
	"&_pragma=foreign_keys(1)" +
	"&_txlock=immediate"

// Open returns a database/sql handle on the SQLite database file at path
// (created if missing), configured for idem and for the caller's own
// transactions:
//
//	file:<path>?_pragma=journal_mode(WAL)&_pragma=busy_timeout(5000)&_pragma=synchronous(FULL)&_pragma=foreign_keys(1)&_txlock=immediate
//
// Every read-write transaction begun on it is BEGIN IMMEDIATE, so concurrent
// writers queue for up to 5s on the database lock instead of failing with
// SQLITE_BUSY. Transactions begun with sql.TxOptions{ReadOnly: true} are
// DEFERRED and never take the write lock.
//
// Like sql.Open, Open does not touch the file: an unopenable path fails on
// first use, with [idem.ErrStoreUnavailable] when used through a [Dialect].
// Call db.PingContext to check at start-up. Open rejects "" and ":memory:",
// which would give each pooled connection a private database, and "file:"
// URIs: pass a plain path, or call sql.Open with a DSN of your own.
// Characters with a meaning in URIs ('?', '#', '%') are escaped, so path is
// always taken literally.
//
// The caller owns the returned *sql.DB and must Close it.
func Open(path string) (*sql.DB, error) {
	dsn, err := dsnFor(path)
	if err != nil {
		return nil, err
	}
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("idem: sqlite: open: %w", err)
	}
	return db, nil
}

// dsnFor builds the SQLite URI for path. An absolute path gets an empty
// authority ("file:///abs"), so that a path starting with "//" cannot be
// read as a host name.
func dsnFor(path string) (string, error) {
	switch {
	case path == "" || path == ":memory:":
		return "", errors.New("idem: sqlite: Open needs a file path; an in-memory or temporary database is private to one connection")
	case strings.HasPrefix(path, "file:"):
		return "", errors.New("idem: sqlite: Open takes a file path, not a URI; use sql.Open with your own DSN")
	}
	p := uriEscaper.Replace(filepath.ToSlash(path))
	if filepath.IsAbs(path) {
		if !strings.HasPrefix(p, "/") {
			p = "/" + p // a Windows drive letter: file:///C:/dir/file.db
		}
		p = "//" + p
	}
	return "file:" + p + "?" + dsnParams, nil
}

// uriEscaper escapes the characters that end or escape a URI path; SQLite
// decodes %HH in "file:" URIs.
var uriEscaper = strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23")
