package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/digest"
	"github.com/idemstore/idem/migrations"
)

var _ idem.Operator = (*Dialect)(nil)

// The operators' statements (idem.Operator). They are not on any claim's
// path.
const (
	opsTables = `SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ('idempotency_keys', '` + migrations.VersionTable + `')`

	opsVersion = `SELECT COALESCE(MAX(version_id), 0) FROM ` + migrations.VersionTable + ` WHERE is_applied`

	// opsColumns names every column idem reads or writes: it fails on a
	// table that lacks one.
	opsColumns = `SELECT ` + recordColumns + `, key_digest FROM idempotency_keys LIMIT 0`

	// opsBodyColumns fails without the body table of migration 00004.
	opsBodyColumns = `SELECT address, seq, data, written_at FROM idempotency_bodies LIMIT 0`

	opsFindKey = `SELECT ` + recordColumns + `
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ?`

	// opsFindDigest walks idempotency_keys_digest_idx twice: the matching
	// digest, and the rows still without one (written before migration
	// 00002 or by an older idem), whose digests are computed in Go.
	opsFindDigest = `SELECT ` + recordColumns + `, key_digest
FROM idempotency_keys
WHERE key_digest = ?
UNION ALL
SELECT ` + recordColumns + `, key_digest
FROM idempotency_keys
WHERE key_digest IS NULL`

	opsDeleteKey = `DELETE FROM idempotency_keys WHERE scope = ? AND idempotency_key = ?`

	// opsDeleteScope deletes by rowid, as expiredDelete does, since SQLite
	// builds lack DELETE ... LIMIT; the subquery walks the primary key's
	// scope prefix.
	opsDeleteScopeHead = `DELETE FROM idempotency_keys WHERE rowid IN (
	SELECT rowid FROM idempotency_keys WHERE scope = ?`
	opsDeleteScopeTail = ` LIMIT ?)`

	opsTokenIs      = ` AND token = ?`
	opsNotLiveLease = ` AND (status <> 1 OR lease_expires_at <= ?)`

	opsStats = `SELECT count(*),
	COALESCE(SUM(status = 1), 0), COALESCE(SUM(status = 2), 0), COALESCE(SUM(status = 3), 0),
	COALESCE(SUM(status = 1 AND lease_expires_at > ?), 0),
	COALESCE(SUM(status = 1 AND lease_expires_at <= ? AND expires_at > ?), 0),
	COALESCE(SUM(expires_at <= ?), 0),
	MIN(CASE WHEN status = 1 THEN created_at END)
FROM idempotency_keys`

	opsMissingDigests = `SELECT rowid, scope, idempotency_key FROM idempotency_keys WHERE key_digest IS NULL LIMIT ?`
	opsSetDigest      = `UPDATE idempotency_keys SET key_digest = ? WHERE rowid = ? AND key_digest IS NULL`
)

// Check implements idem.Operator: the schema (table, columns, version), and
// the connection's journal mode (WAL) and busy timeout, read on one pooled
// connection (every connection of a DB opened with one DSN has the same).
// It cannot see the DSN's _txlock.
func (d *Dialect) Check(ctx context.Context) ([]idem.Problem, error) {
	conn, err := d.db.Conn(ctx)
	if err != nil {
		return nil, interpretError(err)
	}
	defer conn.Close()
	var problems []idem.Problem

	var mode string
	if err := conn.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&mode); err != nil {
		return nil, interpretError(err)
	}
	if !strings.EqualFold(mode, "wal") {
		problems = append(problems, idem.Problem{
			What: "journal_mode is " + mode + ", not WAL",
			Fix:  "open the database with sqlite.Open, or add _pragma=journal_mode(WAL) to the DSN",
		})
	}
	var busy int
	if err := conn.QueryRowContext(ctx, busyTimeoutGet).Scan(&busy); err != nil {
		return nil, interpretError(err)
	}
	if busy <= 0 {
		problems = append(problems, idem.Problem{
			What: "busy_timeout is 0: concurrent writers fail at once with SQLITE_BUSY",
			Fix:  "open the database with sqlite.Open, or add _pragma=busy_timeout(5000) to the DSN",
		})
	}

	tables := map[string]bool{}
	rows, err := conn.QueryContext(ctx, opsTables)
	if err != nil {
		return nil, interpretError(err)
	}
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			rows.Close()
			return nil, interpretError(err)
		}
		tables[name] = true
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError(err)
	}
	rows.Close()
	return append(problems, checkSchema(tables["idempotency_keys"], tables[migrations.VersionTable], func() (int64, error) {
		var v int64
		err := conn.QueryRowContext(ctx, opsVersion).Scan(&v)
		return v, interpretError(err)
	}, func() error {
		_, err := conn.ExecContext(ctx, opsColumns)
		return err
	}, func() error {
		_, err := conn.ExecContext(ctx, opsBodyColumns)
		return err
	})...), nil
}

// checkSchema turns what the catalog said into problems. version and
// columns are called only when the tables exist; a columns error is a
// problem (the table is not idem's), a version error an error.
func checkSchema(table, versions bool, version func() (int64, error), columns, bodyColumns func() error) []idem.Problem {
	migrate := "run `idem migrate up` or sqlite.Migrate"
	if !table {
		return []idem.Problem{{What: "table idempotency_keys does not exist", Fix: migrate}}
	}
	if !versions {
		return []idem.Problem{{What: "version table " + migrations.VersionTable + " does not exist: the schema was not made by idem's migrations", Fix: migrate}}
	}
	v, err := version()
	if err != nil {
		return []idem.Problem{{What: "cannot read " + migrations.VersionTable + ": " + err.Error(), Fix: migrate}}
	}
	if v < migrations.SchemaVersion {
		return []idem.Problem{{What: fmt.Sprintf("schema version is %d, this idem needs %d", v, migrations.SchemaVersion), Fix: migrate}}
	}
	if err := columns(); err != nil {
		return []idem.Problem{{What: "table idempotency_keys lacks columns idem uses", Fix: "restore the table from idem's migrations"}}
	}
	if err := bodyColumns(); err != nil {
		return []idem.Problem{bodyTableProblem}
	}
	return nil
}

// bodyTableProblem is Check's problem for a body table (migration 00004)
// gone or altered after the migration: a table body store would fail.
var bodyTableProblem = idem.Problem{
	What: "table idempotency_bodies (migration 00004) is missing or lacks columns: a table body store (sqlite.NewTableBodyStore) would fail",
	Fix:  "restore the table from idem's migrations",
}

// Find implements idem.Operator.
func (d *Dialect) Find(ctx context.Context, p *idem.FindParams) ([]*idem.Record, time.Time, error) {
	now := clock(p.Now)
	if !p.ByDigest {
		rec, err := scanRecord(d.db.QueryRowContext(ctx, opsFindKey, p.Scope, p.Key))
		if errors.Is(err, idem.ErrNotFound) {
			return nil, now, nil
		}
		if err != nil {
			return nil, now, err
		}
		return []*idem.Record{rec}, now, nil
	}
	rows, err := d.db.QueryContext(ctx, opsFindDigest, p.Digest[:])
	if err != nil {
		return nil, now, interpretError(err)
	}
	defer rows.Close()
	var out []*idem.Record
	for rows.Next() {
		var stored []byte
		rec, err := scanRecord(extraScanner{rows, &stored})
		if err != nil {
			return nil, now, err
		}
		if stored == nil && digest.Sum(rec.Scope, rec.Key) != p.Digest {
			continue
		}
		out = append(out, rec)
	}
	if err := rows.Err(); err != nil {
		return nil, now, interpretError(err)
	}
	return out, now, nil
}

// extraScanner scans one more column after scanRecord's.
type extraScanner struct {
	rows  *sql.Rows
	extra any
}

func (s extraScanner) Scan(dest ...any) error { return s.rows.Scan(append(dest, s.extra)...) }

// Delete implements idem.Operator.
func (d *Dialect) Delete(ctx context.Context, p *idem.DeleteParams) (int, error) {
	if err := checkLimit(p.Limit); err != nil {
		return 0, err
	}
	var (
		q    strings.Builder
		args []any
	)
	if p.WholeScope {
		q.WriteString(opsDeleteScopeHead)
		args = append(args, p.Scope)
	} else {
		q.WriteString(opsDeleteKey)
		args = append(args, p.Scope, p.Key)
	}
	if p.Token != 0 {
		q.WriteString(opsTokenIs)
		args = append(args, p.Token)
	}
	if !p.Force {
		q.WriteString(opsNotLiveLease)
		args = append(args, micros(clock(p.Now)))
	}
	if p.WholeScope {
		q.WriteString(opsDeleteScopeTail)
		args = append(args, p.Limit)
	}
	res, err := d.db.ExecContext(ctx, q.String(), args...)
	if err != nil {
		return 0, interpretError(err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, interpretError(err)
	}
	return int(n), nil
}

// Stats implements idem.Operator.
func (d *Dialect) Stats(ctx context.Context, p *idem.StatsParams) (*idem.Stats, error) {
	now := clock(p.Now)
	n := micros(now)
	st := &idem.Stats{Now: now}
	var oldest sql.NullInt64
	err := d.db.QueryRowContext(ctx, opsStats, n, n, n, n).Scan(&st.Total, &st.Processing, &st.Succeeded, &st.Failed,
		&st.LiveLeases, &st.StaleLeases, &st.Expired, &oldest)
	if err != nil {
		return nil, interpretError(err)
	}
	if oldest.Valid {
		st.OldestProcessing = fromMicros(oldest.Int64)
	}
	return st, nil
}

// backfillDigests writes key_digest on rows that lack it (written before
// migration 00002 or by an older idem), in short transactions of batch rows
// each, and returns how many it wrote.
func backfillDigests(ctx context.Context, db *sql.DB, batch int) (int, error) {
	total := 0
	for {
		type row struct {
			id         int64
			scope, key string
		}
		var todo []row
		rows, err := db.QueryContext(ctx, opsMissingDigests, batch)
		if err != nil {
			return total, interpretError(err)
		}
		for rows.Next() {
			var r row
			if err := rows.Scan(&r.id, &r.scope, &r.key); err != nil {
				rows.Close()
				return total, interpretError(err)
			}
			todo = append(todo, r)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return total, interpretError(err)
		}
		if len(todo) == 0 {
			return total, nil
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return total, interpretError(err)
		}
		for _, r := range todo {
			if _, err := tx.ExecContext(ctx, opsSetDigest, keyDigest(r.scope, r.key), r.id); err != nil {
				_ = tx.Rollback()
				return total, interpretError(err)
			}
		}
		if err := tx.Commit(); err != nil {
			return total, interpretError(err)
		}
		total += len(todo)
	}
}
