//go:build faults

package faults

import (
	"fmt"
	"maps"
	"net/url"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemstore/idem/internal/testdb"
)

// fullScale reports whether the suite runs at the scale docs/reliability.md
// quotes (IDEM_FAULTS_SCALE=full) rather than the bounded scale of .ci/run.
var fullScale = os.Getenv("IDEM_FAULTS_SCALE") == "full"

// scaled returns ci under the bounded scale and full under the full one.
func scaled[T any](ci, full T) T {
	if fullScale {
		return full
	}
	return ci
}

// The dialects a scenario can run on; the names match IDEM_FAULTS_DIALECTS.
const (
	dialectSQLite   = "sqlite"
	dialectPostgres = "postgres"
	dialectMySQL    = "mysql"
)

// dialects returns the dialects selected by IDEM_FAULTS_DIALECTS, all three
// by default. An unknown name fails the test rather than silently running
// less than was asked for.
func dialects(t *testing.T) []string {
	t.Helper()
	all := []string{dialectSQLite, dialectPostgres, dialectMySQL}
	raw := strings.TrimSpace(os.Getenv("IDEM_FAULTS_DIALECTS"))
	if raw == "" {
		return all
	}
	var picked []string
	for name := range strings.SplitSeq(raw, ",") {
		name = strings.TrimSpace(name)
		if !slices.Contains(all, name) {
			t.Fatalf("IDEM_FAULTS_DIALECTS: unknown dialect %q (want a subset of %s)", name, strings.Join(all, ","))
		}
		picked = append(picked, name)
	}
	return picked
}

// outcome is one row of a docs/reliability.md table: what a scenario sent,
// what it injected and what it found.
type outcome struct {
	Scenario string
	Dialect  string
	// Requests is the number of HTTP requests (or store calls) sent,
	// retries included.
	Requests int
	// Faults is the number of faults injected (kills, restarts, terminated
	// connections), with what they were in FaultKind.
	Faults    int
	FaultKind string
	// Duplicates counts business effects that happened more than once for
	// one (tenant, key); Lost counts acknowledged orders missing from the
	// database. Both must be zero.
	Duplicates int
	Lost       int
	// Codes counts the answers by HTTP status and error code, for example
	// "201", "201 replayed", "409 idempotency_key_in_use", "503 idempotency_store_unavailable".
	Codes map[string]int
	// Notes is a short free-text remark (durations, sizes, latencies).
	Notes string
}

// report logs o as a markdown table row prefixed with "FAULTS|", which
// `make faults` collects into the tables of docs/reliability.md, and fails
// the test if it found a duplicate or a lost order.
func report(t *testing.T, o outcome) {
	t.Helper()
	var codes []string
	for _, k := range slices.Sorted(maps.Keys(o.Codes)) {
		codes = append(codes, fmt.Sprintf("%s: %d", k, o.Codes[k]))
	}
	scale := scaled("ci", "full")
	t.Logf("FAULTS| %s | %s | %s | %d | %d %s | %d | %d | %s | %s |",
		o.Scenario, o.Dialect, scale, o.Requests, o.Faults, o.FaultKind, o.Duplicates, o.Lost, strings.Join(codes, ", "), o.Notes)
	if o.Duplicates != 0 || o.Lost != 0 {
		t.Errorf("%s on %s: %d duplicate(s) and %d lost acknowledged order(s); both must be zero", o.Scenario, o.Dialect, o.Duplicates, o.Lost)
	}
}

// pgExecURL returns the PostgreSQL URL raw with pgx's
// default_query_exec_mode set, unless raw already sets it, to the first of
// testdb.PostgresExecModes: the statement cache by default, and through a
// transaction pooler (.ci/pgbouncer.sh) a mode that keeps no prepared
// statement across transactions, which the pooler would hand to another
// client's server connection. Every pgx connection and pool of the suite,
// and the orders processes' -db, are opened with it.
func pgExecURL(t testing.TB, raw string) string {
	t.Helper()
	return pgWithExecMode(t, raw, testdb.PostgresExecModes()[0], false)
}

// pgWithExecMode sets raw's default_query_exec_mode to mode; an exec mode
// raw already names is kept unless replace is set.
func pgWithExecMode(t testing.TB, raw, mode string, replace bool) string {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatalf("parse the PostgreSQL URL: %v", err)
	}
	q := u.Query()
	if replace || !q.Has("default_query_exec_mode") {
		q.Set("default_query_exec_mode", mode)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// pgTable returns table's name in schema as SQL text (quoted), or
// unqualified when schema is empty.
func pgTable(schema, table string) string {
	if schema == "" {
		return pgx.Identifier{table}.Sanitize()
	}
	return pgx.Identifier{schema, table}.Sanitize()
}
