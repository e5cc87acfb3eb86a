package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/migrations"
)

var _ idem.Operator = (*Dialect)(nil)

// The operators' statements (idem.Operator). They are not on any claim's
// path.
const (
	opsDatabase = `SELECT DATABASE()`

	opsTables = `SELECT table_name FROM information_schema.tables
WHERE table_schema = DATABASE() AND table_name IN ('idempotency_keys', '` + migrations.VersionTable + `')`

	opsVersion = `SELECT COALESCE(MAX(version_id), 0) FROM ` + migrations.VersionTable + ` WHERE is_applied`

	// opsColumns names every column idem reads, key_digest (migration
	// 00002) included: it fails on a table that lacks one.
	opsColumns = `SELECT ` + recordColumns + `, key_digest FROM idempotency_keys LIMIT 0`

	// opsBodyColumns fails without the body table of migration 00004.
	opsBodyColumns = `SELECT address, seq, data, written_at FROM idempotency_bodies LIMIT 0`

	opsFindKey = `SELECT ` + recordColumns + `
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ?`

	// opsFindDigest uses idempotency_keys_digest_idx on the virtual column.
	opsFindDigest = `SELECT ` + recordColumns + `
FROM idempotency_keys
WHERE key_digest = ?`

	opsDeleteKey   = `DELETE FROM idempotency_keys WHERE scope = ? AND idempotency_key = ?`
	opsDeleteScope = `DELETE FROM idempotency_keys WHERE scope = ?`
	// ORDER BY the primary key makes the LIMIT deterministic (safe for
	// statement-based replication) and walks the scope prefix in order.
	opsDeleteScopeTail = ` ORDER BY idempotency_key LIMIT ?`

	opsTokenIs      = ` AND token = ?`
	opsNotLiveLease = ` AND (status <> 1 OR lease_expires_at <= ` + now + `)`

	opsStats = `SELECT COUNT(*),
	COALESCE(SUM(status = 1), 0), COALESCE(SUM(status = 2), 0), COALESCE(SUM(status = 3), 0),
	COALESCE(SUM(status = 1 AND lease_expires_at > ?), 0),
	COALESCE(SUM(status = 1 AND lease_expires_at <= ? AND expires_at > ?), 0),
	COALESCE(SUM(expires_at <= ?), 0),
	MIN(CASE WHEN status = 1 THEN created_at END)
FROM idempotency_keys`
)

// Check implements idem.Operator: the DSN's parseTime and loc (read from
// the scan type of the server's clock), the selected database, and the
// schema (table, columns, version).
func (d *Dialect) Check(ctx context.Context) ([]idem.Problem, error) {
	problems, err := d.checkClock(ctx)
	if err != nil {
		return nil, err
	}
	var name sql.NullString
	if err := d.db.QueryRowContext(ctx, opsDatabase).Scan(&name); err != nil {
		return nil, interpretError(err)
	}
	if !name.Valid {
		return append(problems, idem.Problem{
			What: "the DSN selects no database",
			Fix:  "name the database in the DSN: user@tcp(host:3306)/dbname?parseTime=true",
		}), nil
	}
	tables, err := d.tables(ctx)
	if err != nil {
		return nil, err
	}
	schema, err := checkSchema(tables["idempotency_keys"], tables[migrations.VersionTable], func() (int64, error) {
		var v int64
		err := d.db.QueryRowContext(ctx, opsVersion).Scan(&v)
		return v, interpretError(err)
	}, func() error {
		rows, err := d.db.QueryContext(ctx, opsColumns)
		if err == nil {
			rows.Close()
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(schema) == 0 {
		rows, err := d.db.QueryContext(ctx, opsBodyColumns)
		if err == nil {
			rows.Close()
		} else if errors.Is(interpretError(err), idem.ErrStoreUnavailable) {
			return nil, interpretError(err)
		} else {
			schema = append(schema, idem.Problem{
				What: "table idempotency_bodies (migration 00004) is missing or lacks columns: a table body store (mysql.NewTableBodyStore) would fail",
				Fix:  "restore the table from idem's migrations",
			})
		}
	}
	return append(problems, schema...), nil
}

// checkClock reads the server's clock and turns a scan that shows a DSN
// without parseTime=true, or with a loc other than UTC, into a problem.
func (d *Dialect) checkClock(ctx context.Context) ([]idem.Problem, error) {
	var t dbTime
	err := d.db.QueryRowContext(ctx, clock).Scan(&t)
	switch {
	case err == nil:
		return nil, nil
	case errors.Is(err, errParseTime):
		return []idem.Problem{{
			What: "the DSN lacks parseTime=true: DATETIME values arrive as text",
			Fix:  "add parseTime=true to the DSN",
		}}, nil
	case errors.Is(err, errNotUTC):
		return []idem.Problem{{
			What: "the DSN sets loc to a zone other than UTC: times would be read in the wrong zone",
			Fix:  "remove loc from the DSN or set loc=UTC",
		}}, nil
	default:
		return nil, interpretError(err)
	}
}

// tables returns which of idem's tables exist in the selected database.
func (d *Dialect) tables(ctx context.Context) (map[string]bool, error) {
	rows, err := d.db.QueryContext(ctx, opsTables)
	if err != nil {
		return nil, interpretError(err)
	}
	defer rows.Close()
	tables := map[string]bool{}
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			return nil, interpretError(err)
		}
		tables[n] = true
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError(err)
	}
	return tables, nil
}

// checkSchema turns what the catalog said into problems. version and
// columns are called only when the tables exist; a columns error is a
// problem (the table is not idem's), a version error an error.
func checkSchema(table, versions bool, version func() (int64, error), columns func() error) ([]idem.Problem, error) {
	const migrate = "run `idem migrate up` or mysql.Migrate"
	if !table {
		return []idem.Problem{{What: "table idempotency_keys does not exist", Fix: migrate}}, nil
	}
	if !versions {
		return []idem.Problem{{What: "version table " + migrations.VersionTable + " does not exist: the schema was not made by idem's migrations", Fix: migrate}}, nil
	}
	v, err := version()
	if err != nil {
		return nil, err
	}
	if v < migrations.SchemaVersion {
		return []idem.Problem{{What: fmt.Sprintf("schema version is %d, this idem needs %d", v, migrations.SchemaVersion), Fix: migrate}}, nil
	}
	if err := columns(); err != nil {
		return []idem.Problem{{What: "table idempotency_keys lacks columns idem uses", Fix: "restore the table from idem's migrations"}}, nil
	}
	return nil, nil
}

// Find implements idem.Operator.
func (d *Dialect) Find(ctx context.Context, p *idem.FindParams) ([]*idem.Record, time.Time, error) {
	at, err := d.pool.statementNow(ctx, p.Now)
	if err != nil {
		return nil, time.Time{}, err
	}
	query, args := opsFindKey, []any{p.Scope, p.Key}
	if p.ByDigest {
		query, args = opsFindDigest, []any{p.Digest[:]}
	}
	rows, err := d.db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, at, interpretError(err)
	}
	defer rows.Close()
	var out []*idem.Record
	for rows.Next() {
		rec, err := scanRecord(rows)
		if err != nil {
			return nil, at, interpretError(err)
		}
		out = append(out, rec)
	}
	if err := rows.Err(); err != nil {
		return nil, at, interpretError(err)
	}
	return out, at, nil
}

// Delete implements idem.Operator. Each DELETE commits on its own.
func (d *Dialect) Delete(ctx context.Context, p *idem.DeleteParams) (int, error) {
	if p.Limit < 1 {
		return 0, fmt.Errorf("idem: mysql: limit %d must be at least 1", p.Limit)
	}
	var (
		q    strings.Builder
		args []any
	)
	if p.WholeScope {
		q.WriteString(opsDeleteScope)
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
		args = append(args, pinned(p.Now))
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
	at, err := d.pool.statementNow(ctx, p.Now)
	if err != nil {
		return nil, err
	}
	st := &idem.Stats{Now: at}
	var oldest dbTime
	err = d.db.QueryRowContext(ctx, opsStats, at, at, at, at).Scan(&st.Total, &st.Processing, &st.Succeeded, &st.Failed,
		&st.LiveLeases, &st.StaleLeases, &st.Expired, &oldest)
	if err != nil {
		return nil, interpretError(err)
	}
	st.OldestProcessing = oldest.Time
	return st, nil
}
