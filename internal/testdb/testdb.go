// Package testdb locates the test database servers and names isolated
// namespaces on them. Tests that need a server call PostgresURL or MySQLDSN,
// which skip the test when the server is unreachable, unless CI or
// IDEM_TEST_REQUIRE_DB=1 is set, in which case they fail it: a skipped check
// must never pass as a green CI run.
package testdb

import (
	"crypto/rand"
	"encoding/hex"
	"net"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"
)

// Defaults match a developer machine with local servers: PostgreSQL with
// trust authentication and MariaDB with a password-less root.
const (
	DefaultPostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	DefaultMySQLDSN    = "root@tcp(127.0.0.1:3306)/test?parseTime=true"
)

// Required reports whether a missing server must fail the test instead of
// skipping it.
func Required() bool {
	return os.Getenv("CI") != "" || os.Getenv("IDEM_TEST_REQUIRE_DB") == "1"
}

// PostgresURL returns IDEM_TEST_POSTGRES_URL or the default, after checking
// that its host accepts connections.
func PostgresURL(t testing.TB) string {
	t.Helper()
	raw := os.Getenv("IDEM_TEST_POSTGRES_URL")
	if raw == "" {
		raw = DefaultPostgresURL
	}
	host := "127.0.0.1:5432"
	if u, err := url.Parse(raw); err == nil && u.Host != "" {
		host = u.Host
		if u.Port() == "" {
			host = net.JoinHostPort(u.Hostname(), "5432")
		}
	}
	requireReachable(t, "PostgreSQL", "IDEM_TEST_POSTGRES_URL", host)
	return raw
}

// PostgresExecModes returns the pgx exec modes the postgres tests run
// under, by their default_query_exec_mode names: IDEM_TEST_POSTGRES_EXEC_MODES
// (comma separated), or cache_statement and simple_protocol. Through a
// transaction pooler, cache_statement is not among the safe ones.
func PostgresExecModes() []string {
	raw := strings.TrimSpace(os.Getenv("IDEM_TEST_POSTGRES_EXEC_MODES"))
	if raw == "" {
		return []string{"cache_statement", "simple_protocol"}
	}
	var modes []string
	for m := range strings.SplitSeq(raw, ",") {
		if m = strings.TrimSpace(m); m != "" {
			modes = append(modes, m)
		}
	}
	return modes
}

// PostgresPooler reports whether IDEM_TEST_POSTGRES_URL leads through a
// transaction pooler (IDEM_TEST_POSTGRES_POOLER=transaction, set by
// .ci/pgbouncer.sh): session state then does not last past a transaction,
// and startup parameters such as search_path are refused.
func PostgresPooler() bool {
	return os.Getenv("IDEM_TEST_POSTGRES_POOLER") == "transaction"
}

// MySQLDSN returns IDEM_TEST_MYSQL_DSN or the default (a go-sql-driver DSN),
// after checking that the server at addr accepts connections. The caller
// parses the DSN; addr is passed separately to keep this package free of the
// MySQL driver.
func MySQLDSN(t testing.TB, addrOf func(dsn string) (string, error)) string {
	t.Helper()
	dsn := os.Getenv("IDEM_TEST_MYSQL_DSN")
	if dsn == "" {
		dsn = DefaultMySQLDSN
	}
	addr, err := addrOf(dsn)
	if err != nil {
		t.Fatalf("testdb: parse IDEM_TEST_MYSQL_DSN: %v", err)
	}
	requireReachable(t, "MySQL/MariaDB", "IDEM_TEST_MYSQL_DSN", addr)
	return dsn
}

func requireReachable(t testing.TB, what, env, addr string) {
	t.Helper()
	d := net.Dialer{Timeout: 2 * time.Second}
	conn, err := d.DialContext(t.Context(), "tcp", addr)
	if err == nil {
		_ = conn.Close()
		return
	}
	if Required() {
		t.Fatalf("testdb: %s at %s is unreachable and CI or IDEM_TEST_REQUIRE_DB=1 requires it: %v", what, addr, err)
	}
	t.Skipf("testdb: %s at %s is unreachable (%v); set %s to point at a server, or IDEM_TEST_REQUIRE_DB=1 to fail instead of skipping", what, addr, err, env)
}

// Name returns a fresh namespace name such as "idem_t_3f9a0c2b1d4e5f60",
// safe to use unquoted as a schema or database name.
func Name() string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand never fails on supported platforms
	}
	return "idem_t_" + hex.EncodeToString(b[:])
}
