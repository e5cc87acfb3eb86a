package postgres

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/migrations"
)

var _ idem.Operator = (*Dialect)(nil)

// digestFunc is migration 00002's function; 00003 indexes it.
const digestFunc = "idempotency_keys_digest"

// opsStatements are the operators' statements (idem.Operator), on the
// table and function named as [New] was told. They are not on any claim's
// path.
type opsStatements struct {
	// tableName and versionTable are what to_regclass resolves.
	tableName, versionTable                                                                                string
	version, columns, bodyColumns, findKey, findDigest, deleteKey, deleteScopeHead, deleteScopeTail, stats string
}

func newOpsStatements(schema string) *opsStatements {
	table, fn, vt, bodyTable := "idempotency_keys", digestFunc, migrations.VersionTable, "idempotency_bodies"
	if schema != "" {
		o := options{schema: schema}
		table, fn, vt = o.table(), pgx.Identifier{schema, digestFunc}.Sanitize(), o.versionTable()
		bodyTable = pgx.Identifier{schema, bodyTable}.Sanitize()
	}
	cols := strings.ReplaceAll(recordColumns, "\n", " ")
	return &opsStatements{
		tableName:    table,
		versionTable: vt,
		version:      `SELECT COALESCE(MAX(version_id), 0)::bigint FROM ` + vt + ` WHERE is_applied`,
		// columns fails on a table that lacks a column idem reads, or
		// without the digest function.
		columns: `SELECT ` + cols + `, ` + fn + `(scope, idempotency_key) FROM ` + table + ` LIMIT 0`,
		// bodyColumns fails without the body table of migration 00004.
		bodyColumns: `SELECT address, seq, data, written_at FROM ` + bodyTable + ` LIMIT 0`,
		findKey:     `SELECT ` + cols + ` FROM ` + table + ` WHERE scope = $1::text AND idempotency_key = $2::text`,
		// The expression is the index's (00003), so the planner uses it.
		findDigest:      `SELECT ` + cols + ` FROM ` + table + ` WHERE ` + fn + `(scope, idempotency_key) = $1::bytea`,
		deleteKey:       `DELETE FROM ` + table + ` WHERE scope = $1::text AND idempotency_key = $2::text`,
		deleteScopeHead: `DELETE FROM ` + table + ` WHERE (scope, idempotency_key) IN (SELECT scope, idempotency_key FROM ` + table + ` WHERE scope = $1::text`,
		deleteScopeTail: ` ORDER BY idempotency_key LIMIT $%d::bigint)`,
		stats: `WITH clock AS MATERIALIZED (SELECT COALESCE($1::timestamptz, clock_timestamp()) AS ts)
SELECT count(*),
	count(*) FILTER (WHERE status = 1), count(*) FILTER (WHERE status = 2), count(*) FILTER (WHERE status = 3),
	count(*) FILTER (WHERE status = 1 AND lease_expires_at > (SELECT ts FROM clock)),
	count(*) FILTER (WHERE status = 1 AND lease_expires_at <= (SELECT ts FROM clock) AND expires_at > (SELECT ts FROM clock)),
	count(*) FILTER (WHERE expires_at <= (SELECT ts FROM clock)),
	min(created_at) FILTER (WHERE status = 1),
	(SELECT ts FROM clock)
FROM ` + table,
	}
}

const (
	opsProbe = `SELECT to_regclass($1::text) IS NOT NULL, to_regclass($2::text) IS NOT NULL,
	clock_timestamp(), current_setting('transaction_read_only')`
	opsClock = `SELECT COALESCE($1::timestamptz, clock_timestamp())`
)

func (d *Dialect) opsSt() *opsStatements {
	if d.ops == nil {
		return newOpsStatements("")
	}
	return d.ops
}

// Check implements idem.Operator: the schema (table, digest function,
// version) through search_path or WithSchema's schema, the clock, and
// whether the server takes writes (a hot standby does not).
func (d *Dialect) Check(ctx context.Context) ([]idem.Problem, error) {
	if d.err != nil {
		return nil, d.err
	}
	st := d.opsSt()
	var (
		table, versions bool
		clock           time.Time
		readOnly        string
		problems        []idem.Problem
	)
	if err := d.pool.QueryRow(ctx, opsProbe, st.tableName, st.versionTable).Scan(&table, &versions, &clock, &readOnly); err != nil {
		return nil, interpretError(ctx, err)
	}
	if readOnly == "on" {
		problems = append(problems, idem.Problem{
			What: "the server is read-only (a hot standby, or default_transaction_read_only)",
			Fix:  "point the URL at the primary",
		})
	}
	const migrate = "run `idem migrate up` or postgres.Migrate (with the same WithSchema)"
	switch {
	case !table:
		return append(problems, idem.Problem{What: "table idempotency_keys does not exist", Fix: migrate}), nil
	case !versions:
		return append(problems, idem.Problem{What: "version table " + migrations.VersionTable + " does not exist: the schema was not made by idem's migrations", Fix: migrate}), nil
	}
	var v int64
	if err := d.pool.QueryRow(ctx, st.version).Scan(&v); err != nil {
		return nil, interpretError(ctx, err)
	}
	if v < migrations.SchemaVersion {
		return append(problems, idem.Problem{What: fmt.Sprintf("schema version is %d, this idem needs %d", v, migrations.SchemaVersion), Fix: migrate}), nil
	}
	if p, err := d.probeColumns(ctx, st.columns, "table idempotency_keys lacks columns idem uses, or the digest function"); err != nil || p != nil {
		if err != nil {
			return nil, err
		}
		return append(problems, *p), nil
	}
	p, err := d.probeColumns(ctx, st.bodyColumns, "table idempotency_bodies (migration 00004) is missing or lacks columns: a table body store (postgres.NewTableBodyStore) would fail")
	if err != nil {
		return nil, err
	}
	if p != nil {
		problems = append(problems, *p)
	}
	return problems, nil
}

// probeColumns runs query, which selects no row but names every column
// idem uses: a failure other than the server being unreachable is the
// problem what, a schema that is not idem's.
func (d *Dialect) probeColumns(ctx context.Context, query, what string) (*idem.Problem, error) {
	rows, err := d.pool.Query(ctx, query)
	if err == nil {
		rows.Close()
		err = rows.Err()
	}
	if err == nil {
		return nil, nil
	}
	if classified := interpretError(ctx, err); errors.Is(classified, idem.ErrStoreUnavailable) {
		return nil, classified
	}
	return &idem.Problem{What: what, Fix: "restore the schema from idem's migrations"}, nil
}

// Find implements idem.Operator.
func (d *Dialect) Find(ctx context.Context, p *idem.FindParams) ([]*idem.Record, time.Time, error) {
	if d.err != nil {
		return nil, time.Time{}, d.err
	}
	var now time.Time
	if err := d.pool.QueryRow(ctx, opsClock, pinnedNow(p.Now)).Scan(&now); err != nil {
		return nil, now, interpretError(ctx, err)
	}
	now = now.UTC()
	st := d.opsSt()
	query, args := st.findKey, []any{p.Scope, p.Key}
	if p.ByDigest {
		query, args = st.findDigest, []any{p.Digest[:]}
	}
	rows, err := d.pool.Query(ctx, query, args...)
	if err != nil {
		return nil, now, interpretError(ctx, err)
	}
	defer rows.Close()
	var out []*idem.Record
	for rows.Next() {
		rec, err := scanRecord(ctx, rows)
		if err != nil {
			return nil, now, err
		}
		out = append(out, rec)
	}
	if err := rows.Err(); err != nil {
		return nil, now, interpretError(ctx, err)
	}
	return out, now, nil
}

// Delete implements idem.Operator. Each DELETE commits on its own.
func (d *Dialect) Delete(ctx context.Context, p *idem.DeleteParams) (int, error) {
	if d.err != nil {
		return 0, d.err
	}
	if p.Limit < 1 {
		return 0, fmt.Errorf("idem: postgres: limit %d must be at least 1", p.Limit)
	}
	st := d.opsSt()
	var (
		q    strings.Builder
		args []any
	)
	param := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args))
	}
	if p.WholeScope {
		q.WriteString(st.deleteScopeHead)
		args = append(args, p.Scope)
	} else {
		q.WriteString(st.deleteKey)
		args = append(args, p.Scope, p.Key)
	}
	if p.Token != 0 {
		q.WriteString(" AND token = " + param(p.Token) + "::bigint")
	}
	if !p.Force {
		q.WriteString(" AND (status <> 1 OR lease_expires_at <= COALESCE(" + param(pinnedNow(p.Now)) + "::timestamptz, clock_timestamp()))")
	}
	if p.WholeScope {
		args = append(args, p.Limit)
		fmt.Fprintf(&q, st.deleteScopeTail, len(args))
	}
	tag, err := d.pool.Exec(ctx, q.String(), args...)
	if err != nil {
		return 0, interpretError(ctx, err)
	}
	return int(tag.RowsAffected()), nil
}

// Stats implements idem.Operator.
func (d *Dialect) Stats(ctx context.Context, p *idem.StatsParams) (*idem.Stats, error) {
	if d.err != nil {
		return nil, d.err
	}
	st := &idem.Stats{}
	var oldest *time.Time
	err := d.pool.QueryRow(ctx, d.opsSt().stats, pinnedNow(p.Now)).Scan(&st.Total, &st.Processing, &st.Succeeded, &st.Failed,
		&st.LiveLeases, &st.StaleLeases, &st.Expired, &oldest, &st.Now)
	if err != nil {
		return nil, interpretError(ctx, err)
	}
	st.Now = st.Now.UTC()
	if oldest != nil {
		st.OldestProcessing = oldest.UTC()
	}
	return st, nil
}
