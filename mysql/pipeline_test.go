package mysql_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	idemmysql "github.com/idemstore/idem/mysql"
)

// questions reads the connection's Questions counter (statements the client
// sent; one for a compound statement) on db, a pool of one connection, and
// subtracts the statement that reads it.
func questions(ctx context.Context, t *testing.T, db *sql.DB) int {
	t.Helper()
	var name string
	var n int
	require.NoError(t, db.QueryRowContext(ctx, "SHOW SESSION STATUS LIKE 'Questions'").Scan(&name, &n))
	return n
}

// onePool opens a one-connection pool on ns's database, through
// NewConnector when piped.
func onePool(t *testing.T, name string, piped bool) *sql.DB {
	t.Helper()
	s := testServer(t)
	var db *sql.DB
	if piped {
		db = s.connectPiped(t, name)
	} else {
		db = openDB(t, s.config(name, true))
	}
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	return db
}

// Store.Do sends 3 statements for a new key with a one-statement callback
// on a pool of NewConnector (START TRANSACTION with the claim, the
// callback's, the completion with COMMIT) against 5 on a plain pool, and
// its replay 3 against 4; the records and orders are those of a plain pool.
func TestPipedDoStatements(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	ns := testServer(t).open(ctx, t, true)
	for _, tc := range []struct {
		name          string
		piped         bool
		fresh, replay int
	}{
		{"plain", false, 5, 4},
		{"piped", true, 3, 3},
	} {
		db := onePool(t, ns.name, tc.piped)
		store, err := idem.New(idemmysql.New(db), nil)
		require.NoError(t, err)
		fp := idem.NewFingerprint([]byte(tc.name))
		do := func(key string) *idem.Result {
			res, err := store.Do(ctx, "s", key, fp, func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
				if err := ns.insertOrder(ctx, tx, tc.name+key); err != nil {
					return nil, err
				}
				return &idem.Response{StatusCode: 201, Body: []byte(key)}, nil
			})
			require.NoError(t, err)
			return res
		}
		do(tc.name + "-warm") // reads the server's flavour once
		before := questions(ctx, t, db)
		require.False(t, do(tc.name+"-k").Replayed)
		fresh := questions(ctx, t, db) - before - 1
		before = questions(ctx, t, db)
		res := do(tc.name + "-k")
		replay := questions(ctx, t, db) - before - 1
		require.True(t, res.Replayed)
		require.Equal(t, []byte(tc.name+"-k"), res.Response.Body)
		require.Equal(t, tc.fresh, fresh, "%s: statements of a new key", tc.name)
		require.Equal(t, tc.replay, replay, "%s: statements of a replay", tc.name)
		n, err := ns.countOrders(ctx, tc.name+tc.name+"-k")
		require.NoError(t, err)
		require.Equal(t, 1, n, tc.name)
	}
}

// CompleteCommit on a pool of NewConnector commits nothing when the
// completion matches no row (a wrong token): ErrFenced, the callback's
// order rolled back with the record.
func TestPipedCompleteCommitFenced(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	ns := testServer(t).open(ctx, t, true)
	db := testServer(t).connectPiped(t, ns.name)
	d := idemmysql.New(db)
	p := claimParams("k")
	tx, res, err := d.BeginClaim(ctx, p)
	require.NoError(t, err)
	require.True(t, res.Created)
	require.NoError(t, ns.insertOrder(ctx, tx, "fenced"))
	err = d.CompleteCommit(ctx, tx, &idem.CompleteParams{
		Scope: p.Scope, Key: p.Key, Token: p.Token + 1, Status: idem.StatusSucceeded,
		Response: &idem.Response{StatusCode: 200}, Retention: p.Retention,
	})
	require.ErrorIs(t, err, idem.ErrFenced)
	require.NoError(t, d.Rollback(ctx, tx))
	n, err := ns.countOrders(ctx, "fenced")
	require.NoError(t, err)
	require.Zero(t, n)
	records, err := ns.countRecords(ctx)
	require.NoError(t, err)
	require.Zero(t, records)
}

// A response whose interpolated completion exceeds the driver's
// maxAllowedPacket cannot travel with COMMIT (the server cannot prepare a
// compound statement): the completion and COMMIT are sent apart, the body
// as a prepared statement's argument, and the replay returns it whole.
func TestPipedLargeBodyFallsBack(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s := testServer(t)
	ns := s.open(ctx, t, true)
	cfg := s.config(ns.name, true)
	cfg.MaxAllowedPacket = 64 << 10
	conn, err := idemmysql.NewConnector(cfg)
	require.NoError(t, err)
	db := sql.OpenDB(conn)
	t.Cleanup(func() { _ = db.Close() })
	store, err := idem.New(idemmysql.New(db), nil)
	require.NoError(t, err)
	body := bytes.Repeat([]byte("0123456789abcdef"), 8<<10) // 128 KiB
	fp := idem.NewFingerprint([]byte("large"))
	fn := func(ctx context.Context, tx *sql.Tx) (*idem.Response, error) {
		if err := ns.insertOrder(ctx, tx, "large"); err != nil {
			return nil, err
		}
		return &idem.Response{StatusCode: 200, Body: body}, nil
	}
	res, err := store.Do(ctx, "s", "large", fp, fn)
	require.NoError(t, err)
	require.False(t, res.Replayed)
	res, err = store.Do(ctx, "s", "large", fp, fn)
	require.NoError(t, err)
	require.True(t, res.Replayed)
	require.Equal(t, body, res.Response.Body)
	n, err := ns.countOrders(ctx, "large")
	require.NoError(t, err)
	require.Equal(t, 1, n)
}

// On a pool of NewConnector the claim and the completion in a caller's
// transaction (ClaimTx, CompleteTx) run prepared, once per connection; on a
// pool of the driver's they stay text. Counted on the connection itself
// (SHOW SESSION STATUS in the transaction; the pool has one connection).
func TestPipedClaimTxPrepared(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	ns := testServer(t).open(ctx, t, true)
	for _, tc := range []struct {
		name                     string
		piped                    bool
		firstPrepares, execPerTx int
	}{
		{"plain", false, 0, 0},
		{"piped", true, 2, 2},
	} {
		db := onePool(t, ns.name, tc.piped)
		store, err := idem.New(idemmysql.New(db), nil)
		require.NoError(t, err)
		counters := func(tx *sql.Tx) (prepares, execs int) {
			t.Helper()
			rows, err := tx.QueryContext(ctx, "SHOW SESSION STATUS WHERE Variable_name IN ('Com_stmt_prepare', 'Com_stmt_execute')")
			require.NoError(t, err)
			defer func() { _ = rows.Close() }()
			for rows.Next() {
				var name string
				var n int
				require.NoError(t, rows.Scan(&name, &n))
				if name == "Com_stmt_prepare" {
					prepares = n
				} else {
					execs = n
				}
			}
			require.NoError(t, rows.Err())
			return prepares, execs
		}
		fp := idem.NewFingerprint([]byte(tc.name))
		var prepares, execs int
		for i := range 3 {
			key := fmt.Sprintf("%s-%d", tc.name, i)
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			p0, e0 := counters(tx)
			c, err := store.ClaimTx(ctx, tx, "s", key, fp)
			require.NoError(t, err)
			require.True(t, c.Acquired())
			require.NoError(t, ns.insertOrder(ctx, tx, key))
			require.NoError(t, store.CompleteTx(ctx, tx, c, &idem.Response{StatusCode: 201, Body: []byte(key)}))
			p1, e1 := counters(tx)
			require.NoError(t, tx.Commit())
			if i == 0 {
				prepares = p1 - p0
			} else {
				require.Equal(t, 0, p1-p0, "%s: prepared once per connection", tc.name)
			}
			execs = e1 - e0
			res, err := store.Do(ctx, "s", key, fp, func(context.Context, *sql.Tx) (*idem.Response, error) {
				return nil, errors.New("completed key executed again")
			})
			require.NoError(t, err)
			require.True(t, res.Replayed)
			require.Equal(t, []byte(key), res.Response.Body)
			n, err := ns.countOrders(ctx, key)
			require.NoError(t, err)
			require.Equal(t, 1, n)
		}
		require.Equal(t, tc.firstPrepares, prepares, "%s: statements prepared by the first transaction", tc.name)
		require.Equal(t, tc.execPerTx, execs, "%s: prepared executions per transaction", tc.name)
	}
}
