//go:build faults

package faults

import (
	"context"
	"net"
	"net/url"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/internal/testdb"
)

// TestWireProxy checks the proxy itself against the real servers, before
// the scenarios trust it: a dropped acknowledgement leaves the row
// committed, a reset at the COMMIT leaves nothing, a stall holds the
// client until its own deadline, and the COMMIT is found however the
// driver sends it.
func TestWireProxy(t *testing.T) {
	for _, d := range wireDialects(t) {
		t.Run(d, func(t *testing.T) {
			switch d {
			case dialectPostgres:
				wireProxyPostgres(t)
			case dialectMySQL:
				wireProxyMySQL(t, true)
				t.Run("prepared", func(t *testing.T) { wireProxyMySQL(t, false) })
			}
		})
	}
}

func wireProxyPostgres(t *testing.T) {
	ctx := t.Context()
	direct := testdb.PostgresURL(t)
	admin, err := pgx.Connect(ctx, direct)
	require.NoError(t, err)
	defer admin.Close(context.WithoutCancel(ctx))
	schema := testdb.Name()
	_, err = admin.Exec(ctx, "CREATE SCHEMA "+schema)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec(context.WithoutCancel(ctx), "DROP SCHEMA "+schema+" CASCADE") })
	_, err = admin.Exec(ctx, "CREATE TABLE "+schema+".t (k text)")
	require.NoError(t, err)
	count := func(k string) int {
		var n int
		require.NoError(t, admin.QueryRow(ctx, "SELECT count(*) FROM "+schema+".t WHERE k = $1", k).Scan(&n))
		return n
	}

	u, err := url.Parse(direct)
	require.NoError(t, err)
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "5432")
	}
	p := newWireProxy(t, wirePostgres, host)
	u.Host = p.Addr()
	connect := func() *pgx.Conn {
		c, err := pgx.Connect(ctx, u.String())
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close(context.WithoutCancel(ctx)) })
		return c
	}
	insert := "INSERT INTO " + schema + ".t VALUES ($1)"

	// Tx.Commit: "commit" as a simple query.
	ch := p.Arm(wireRule{Fault: wireDropAck, Marker: "pg-drop-simple"})
	c := connect()
	tx, err := c.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, insert, "pg-drop-simple")
	require.NoError(t, err)
	require.Error(t, tx.Commit(ctx), "the acknowledgement was dropped")
	ev, err := wireWait(ch, 5*time.Second)
	require.NoError(t, err)
	assert.Positive(t, ev.Forwarded, "the insert's messages went through")
	ev.Forwarded = 0
	assert.Equal(t, wireEvent{Fault: wireDropAck, AtCommit: true, Committed: true, Via: "Query"}, ev)
	assert.Equal(t, 1, count("pg-drop-simple"), "committed although the client never heard")

	// A batch ending in COMMIT, as the dialect's completion sends it.
	ch = p.Arm(wireRule{Fault: wireDropAck, Marker: "pg-drop-batch"})
	c = connect()
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue(insert, "pg-drop-batch")
	b.Queue("COMMIT")
	require.Error(t, c.SendBatch(ctx, b).Close())
	ev, err = wireWait(ch, 5*time.Second)
	require.NoError(t, err)
	assert.True(t, ev.Committed && ev.AtCommit && ev.Via == "Execute", "%+v", ev)
	assert.Equal(t, 1, count("pg-drop-batch"))

	// A reset at the COMMIT: never forwarded, nothing committed.
	ch = p.Arm(wireRule{Fault: wireReset, Marker: "pg-reset", After: 100})
	c = connect()
	tx, err = c.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, insert, "pg-reset")
	require.NoError(t, err)
	require.Error(t, tx.Commit(ctx))
	ev, err = wireWait(ch, 5*time.Second)
	require.NoError(t, err)
	assert.True(t, ev.AtCommit && !ev.Committed, "%+v", ev)
	assert.Equal(t, 0, count("pg-reset"))

	// A stall at the insert: the client waits until its deadline, the
	// server's transaction until the stall ends.
	ch = p.Arm(wireRule{Fault: wireStall, Marker: "pg-stall", Stall: time.Second})
	c = connect()
	tx, err = c.Begin(ctx)
	require.NoError(t, err)
	sctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	start := time.Now()
	_, err = tx.Exec(sctx, insert, "pg-stall")
	cancel()
	require.Error(t, err)
	assert.Less(t, time.Since(start), 900*time.Millisecond, "the client's deadline ends its wait")
	_, err = wireWait(ch, time.Second)
	require.NoError(t, err)
	assert.Equal(t, 0, count("pg-stall"))
}

func wireProxyMySQL(t *testing.T, interpolate bool) {
	ctx := t.Context()
	cfg, err := gomysql.ParseDSN(testdb.MySQLDSN(t, inprocMySQLAddr))
	require.NoError(t, err)
	admin := inprocMySQLDB(t, cfg, 1)
	name := testdb.Name()
	_, err = admin.ExecContext(ctx, "CREATE DATABASE "+name)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.ExecContext(context.WithoutCancel(ctx), "DROP DATABASE IF EXISTS "+name) })
	_, err = admin.ExecContext(ctx, "CREATE TABLE "+name+".t (k VARCHAR(64)) ENGINE = InnoDB")
	require.NoError(t, err)
	count := func(k string) int {
		var n int
		require.NoError(t, admin.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+name+".t WHERE k = ?", k).Scan(&n))
		return n
	}
	p := newWireProxy(t, wireMySQL, cfg.Addr)
	pcfg := cfg.Clone()
	pcfg.Addr = p.Addr()
	pcfg.DBName = name
	pcfg.InterpolateParams = interpolate
	pcfg.Logger = &gomysql.NopLogger{}
	db := inprocMySQLDB(t, pcfg, 4)
	insert := "INSERT INTO t VALUES (?)"
	run := func(k string) error {
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		_, err = tx.ExecContext(ctx, insert, k)
		require.NoError(t, err)
		return tx.Commit()
	}

	ch := p.Arm(wireRule{Fault: wireDropAck, Marker: "my-drop"})
	require.Error(t, run("my-drop"))
	ev, err := wireWait(ch, 5*time.Second)
	require.NoError(t, err)
	assert.True(t, ev.Committed && ev.AtCommit && ev.Via == "COM_QUERY", "%+v", ev)
	assert.Equal(t, 1, count("my-drop"), "committed although the client never heard")

	ch = p.Arm(wireRule{Fault: wireReset, Marker: "my-reset", After: 100})
	require.Error(t, run("my-reset"))
	ev, err = wireWait(ch, 5*time.Second)
	require.NoError(t, err)
	assert.True(t, ev.AtCommit && !ev.Committed, "%+v", ev)
	assert.Equal(t, 0, count("my-reset"))
}

// TestWireBusinessInsert: the proxy tells a transaction that wrote an order
// or a payment from one that only claimed, whether the tables are named bare
// or schema-qualified (a regression: the qualified names of the pooler-safe
// namespaces went unrecognised, and every lost acknowledgement was counted
// as a claim's).
func TestWireBusinessInsert(t *testing.T) {
	for sql, want := range map[string]bool{
		`INSERT INTO orders (tenant, idem_key, amount) VALUES ($1, $2, $3)`:                     true,
		`INSERT INTO "idem_t_0a1b"."payments" (tenant, idem_key, charge_id, amount) VALUES (1)`: true,
		`insert into "orders" (tenant) values ('x')`:                                            true,
		`INSERT INTO "idem_t_0a1b"."idempotency_keys" (scope) VALUES ($1)`:                      false,
		`INSERT INTO orders_archive (id) VALUES (1)`:                                            false,
	} {
		assert.Equal(t, want, wireBusinessInsert.MatchString(sql), sql)
	}
}
