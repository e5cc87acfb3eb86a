package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/codec"
	"github.com/idemstore/idem/internal/digest"
	"github.com/idemstore/idem/internal/testdb"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// floorRecord is a row of floorTable, every column nullable so that a
// missing value shows.
type floorRecord struct {
	scope, key, fp, hdr, body []byte
	status, token, attempt    sql.NullInt64
	code                      sql.NullInt64
	lease, created, updated   sql.NullTime
	completed, expires        sql.NullTime
	digest                    []byte // MySQL and SQLite
}

// TestFloorWritesFinishedRecords runs floor and floortx briefly on each
// dialect, keeping the namespace, and reads what they wrote: every row of
// the floor table must be a finished record, as a completion of a fresh key
// writes it (succeeded, the stored response, every column filled), one per
// order.
func TestFloorWritesFinishedRecords(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, db string
	}{
		{name: "postgres", db: testdb.PostgresURL(t)},
		{name: "mysql", db: "mysql://" + testdb.MySQLDSN(t, func(dsn string) (string, error) {
			cfg, err := gomysql.ParseDSN(dsn)
			if err != nil {
				return "", err
			}
			return cfg.Addr, nil
		})},
		{name: "sqlite", db: "sqlite:" + t.TempDir()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			for _, sc := range []string{"floor", "floortx"} {
				records, orders := runFloor(t, tc.name, tc.db, sc)
				require.Positive(t, orders, sc)
				require.Len(t, records, int(orders), sc)
				checkFloorRecords(t, tc.name, records)
			}
		})
	}
}

// runFloor runs scenario sc (floor or floortx) of the order shape on db,
// keeping the namespace, and returns the rows of its floor table and the
// orders it holds, which the reset before the measurement emptied (the
// floor table's seeded rows left out).
func runFloor(t *testing.T, dialect, db, sc string) ([]floorRecord, int64) {
	t.Helper()
	jsonPath := filepath.Join(t.TempDir(), "out.json")
	var stdout, stderr bytes.Buffer
	err := run(t.Context(), []string{
		"-db", db, "-scenarios", sc, "-shape", "order", "-workers", "2", "-warmup", "100ms", "-duration", "300ms", "-reps", "1",
		"-seeds", "10", "-keep", "-json", jsonPath,
	}, &stdout, &stderr)
	require.NoError(t, err, "stderr:\n%s", stderr.String())
	raw, err := os.ReadFile(jsonPath)
	require.NoError(t, err)
	var rep report
	require.NoError(t, json.Unmarshal(raw, &rep))
	require.Len(t, rep.Dialects, 1)
	require.Len(t, rep.Dialects[0].Rows, 1)
	return readFloor(t, dialect, db, rep.Dialects[0].Namespaces[0])
}

// checkFloorRecords checks that every record is finished as a completion of
// a fresh key writes it.
func checkFloorRecords(t *testing.T, dialect string, records []floorRecord) {
	t.Helper()
	wantHdr, err := codec.EncodeHeader(response.Header)
	require.NoError(t, err)
	for _, r := range records {
		require.Regexp(t, `^tenant-\d\d$`, string(r.scope))
		require.Len(t, r.key, 32)
		require.Equal(t, fingerprint[:], r.fp)
		require.Equal(t, sql.NullInt64{Int64: int64(idem.StatusSucceeded), Valid: true}, r.status)
		require.True(t, r.token.Valid)
		require.Equal(t, sql.NullInt64{Int64: 1, Valid: true}, r.attempt)
		require.Equal(t, sql.NullInt64{Int64: int64(response.StatusCode), Valid: true}, r.code)
		require.Equal(t, wantHdr, r.hdr)
		require.Equal(t, response.Body, r.body)
		for _, ts := range []sql.NullTime{r.lease, r.created, r.updated, r.completed, r.expires} {
			require.True(t, ts.Valid)
		}
		require.Equal(t, r.created.Time, r.updated.Time)
		require.Equal(t, r.created.Time, r.completed.Time)
		require.Equal(t, floorLease, r.lease.Time.Sub(r.created.Time))
		require.Equal(t, floorRetention, r.expires.Time.Sub(r.created.Time))
		require.WithinDuration(t, time.Now(), r.created.Time, time.Minute)
		if dialect != "postgres" {
			d := digest.Sum(string(r.scope), string(r.key))
			require.Equal(t, d[:], r.digest)
		}
	}
}

const floorSelectAll = `SELECT scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at`

// readFloor reads the floor table and counts the orders of namespace ns,
// then drops it.
func readFloor(t *testing.T, dialect, db, ns string) ([]floorRecord, int64) {
	t.Helper()
	ctx := context.Background()
	var (
		out    []floorRecord
		orders int64
	)
	switch dialect {
	case "postgres":
		conn, err := pgx.Connect(ctx, db)
		require.NoError(t, err)
		defer conn.Close(ctx)
		defer func() { _, _ = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+ns+" CASCADE") }()
		rows, err := conn.Query(ctx, floorSelectAll+` FROM `+ns+`.`+floorTable+` f WHERE`+strings.ReplaceAll(floorNotSeeded, "idembench_seed", ns+".idembench_seed"))
		require.NoError(t, err)
		for rows.Next() {
			var (
				r                        floorRecord
				status                   *int16
				att                      *int32
				code                     *int32
				token                    *int64
				lease, cr, up, done, exp *time.Time
			)
			require.NoError(t, rows.Scan(&r.scope, &r.key, &r.fp, &status, &token, &att, &lease, &code, &r.hdr, &r.body, &cr, &up, &done, &exp))
			if status != nil {
				r.status = sql.NullInt64{Int64: int64(*status), Valid: true}
			}
			if token != nil {
				r.token = sql.NullInt64{Int64: *token, Valid: true}
			}
			if att != nil {
				r.attempt = sql.NullInt64{Int64: int64(*att), Valid: true}
			}
			if code != nil {
				r.code = sql.NullInt64{Int64: int64(*code), Valid: true}
			}
			for _, p := range []struct {
				dst *sql.NullTime
				src *time.Time
			}{{&r.lease, lease}, {&r.created, cr}, {&r.updated, up}, {&r.completed, done}, {&r.expires, exp}} {
				if p.src != nil {
					*p.dst = sql.NullTime{Time: *p.src, Valid: true}
				}
			}
			out = append(out, r)
		}
		require.NoError(t, rows.Err())
		require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM `+ns+`.orders`).Scan(&orders))
		return out, orders
	case "mysql":
		cfg, err := gomysql.ParseDSN(db[len("mysql://"):])
		require.NoError(t, err)
		cfg.ParseTime, cfg.Loc = true, time.UTC
		sdb, err := sql.Open("mysql", cfg.FormatDSN())
		require.NoError(t, err)
		defer sdb.Close()
		defer func() { _, _ = sdb.ExecContext(ctx, "DROP DATABASE IF EXISTS "+ns) }()
		out = scanFloor(t, sdb, floorSelectAll+`, key_digest FROM `+ns+`.`+floorTable+` f WHERE`+strings.ReplaceAll(floorNotSeeded, "idembench_seed", ns+".idembench_seed"), false)
		require.NoError(t, sdb.QueryRowContext(ctx, `SELECT COUNT(*) FROM `+ns+`.orders`).Scan(&orders))
		return out, orders
	default:
		path := filepath.Join(db[len("sqlite:"):], ns+".db")
		sdb, err := idemsqlite.Open(path)
		require.NoError(t, err)
		defer sdb.Close()
		out = scanFloor(t, sdb, floorSelectAll+`, key_digest FROM `+floorTable+` f WHERE`+floorNotSeeded, true)
		require.NoError(t, sdb.QueryRowContext(ctx, `SELECT COUNT(*) FROM orders`).Scan(&orders))
		return out, orders
	}
}

// scanFloor reads the rows of query (floorSelectAll and key_digest);
// micros: times are SQLite's microseconds.
func scanFloor(t *testing.T, db *sql.DB, query string, micros bool) []floorRecord {
	t.Helper()
	rows, err := db.QueryContext(context.Background(), query)
	require.NoError(t, err)
	defer rows.Close()
	var out []floorRecord
	for rows.Next() {
		var r floorRecord
		if micros {
			var ts [5]sql.NullInt64
			require.NoError(t, rows.Scan(&r.scope, &r.key, &r.fp, &r.status, &r.token, &r.attempt, &ts[0], &r.code, &r.hdr, &r.body,
				&ts[1], &ts[2], &ts[3], &ts[4], &r.digest))
			for i, dst := range []*sql.NullTime{&r.lease, &r.created, &r.updated, &r.completed, &r.expires} {
				if ts[i].Valid {
					*dst = sql.NullTime{Time: time.UnixMicro(ts[i].Int64).UTC(), Valid: true}
				}
			}
		} else {
			require.NoError(t, rows.Scan(&r.scope, &r.key, &r.fp, &r.status, &r.token, &r.attempt, &r.lease, &r.code, &r.hdr, &r.body,
				&r.created, &r.updated, &r.completed, &r.expires, &r.digest))
		}
		out = append(out, r)
	}
	require.NoError(t, rows.Err())
	return out
}
