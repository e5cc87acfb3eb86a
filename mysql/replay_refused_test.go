package mysql_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"sync/atomic"
	"testing"

	gomysql "github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	idemmysql "github.com/idemstore/idem/mysql"
)

// refusingPrepares is a connector to the real server whose connections,
// once refuse is set, refuse every prepare database/sql asks of them with
// ER_MAX_PREPARED_STMT_COUNT_REACHED, as a server at its
// max_prepared_stmt_count does. The test cannot lower that global limit
// without refusing the prepares of every other client of the server, the
// tests running beside it included. Everything else reaches the server.
type refusingPrepares struct {
	driver.Connector
	refuse   atomic.Bool
	prepares atomic.Int64 // asked of the connections, refused or not
	begins   atomic.Int64 // transactions begun
}

func (c *refusingPrepares) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	fc, ok := conn.(idemmysql.DriverConn)
	if !ok {
		_ = conn.Close()
		return nil, fmt.Errorf("connection %T lacks methods database/sql uses", conn)
	}
	return &refusingConn{DriverConn: fc, c: c}, nil
}

type refusingConn struct {
	idemmysql.DriverConn
	c *refusingPrepares
}

func (r *refusingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	r.c.begins.Add(1)
	return r.DriverConn.BeginTx(ctx, opts)
}

func (r *refusingConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	r.c.prepares.Add(1)
	if r.c.refuse.Load() {
		return nil, &gomysql.MySQLError{Number: 1461, Message: "Can't create more than max_prepared_stmt_count statements"}
	}
	return r.DriverConn.PrepareContext(ctx, query)
}

// TestReplayReadAfterPrepareRefused: a server that refuses to prepare the
// replay read, at its prepare limit, still answers replays from the read,
// sent as text, and is asked to prepare it once per pool, not once per
// replay nor once per Dialect. The refusal comes either from the first
// prepare or, for a statement already prepared, from database/sql preparing
// it again on a new connection.
func TestReplayReadAfterPrepareRefused(t *testing.T) {
	t.Parallel()
	for _, piped := range []bool{false, true} {
		t.Run(fmt.Sprintf("NewConnector=%v", piped), func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, newPlain, true)
			open := func(refuse bool) (*sql.DB, *refusingPrepares) {
				cfg := testServer(t).config(b.name, true)
				var inner driver.Connector
				var err error
				if piped {
					inner, err = idemmysql.NewConnector(cfg)
				} else {
					inner, err = gomysql.NewConnector(cfg)
				}
				require.NoError(t, err)
				rc := &refusingPrepares{Connector: inner}
				rc.refuse.Store(refuse)
				db := sql.OpenDB(rc)
				t.Cleanup(func() { _ = db.Close() })
				// One connection at a time: a new one is a new prepare.
				db.SetMaxOpenConns(1)
				return db, rc
			}

			const scope, key, body = "t1/create", "refused", `{"id":7}`
			db, rc := open(false)
			d := idemmysql.New(db)
			// Do reads first, so that a replay shows which read answered.
			store, err := idem.New(d, &idem.Config{ReplayRead: idem.ReplayReadAlways})
			require.NoError(t, err)
			fp := idem.NewFingerprint()
			calls := 0
			fn := func(context.Context, *sql.Tx) (*idem.Response, error) {
				calls++
				return &idem.Response{StatusCode: 201, Body: []byte(body)}, nil
			}
			_, err = store.Do(ctx, scope, key, fp, fn)
			require.NoError(t, err)

			replay := func(d *idemmysql.Dialect) {
				t.Helper()
				reader, ok := d.DB().(idem.ReplayReader)
				require.True(t, ok)
				rec, err := reader.GetCompleted(ctx, &idem.GetParams{Scope: scope, Key: key})
				require.NoError(t, err)
				require.JSONEq(t, body, string(rec.Response.Body))
			}

			// Prepared, on the pool's one connection (Do's own read
			// prepared it already).
			replay(d)
			require.Equal(t, int64(1), rc.prepares.Load())

			// A new connection, on which database/sql prepares it again,
			// and the server refuses: the read goes as text.
			rc.refuse.Store(true)
			db.SetMaxIdleConns(0) // closes the idle connection
			db.SetMaxIdleConns(1)
			for range 5 {
				replay(d)
			}
			require.Equal(t, int64(2), rc.prepares.Load(), "a refused prepare is not asked again at every replay")

			// Do answers from that read, without a transaction.
			begins := rc.begins.Load()
			res, err := store.Do(ctx, scope, key, fp, fn)
			require.NoError(t, err)
			require.True(t, res.Replayed)
			require.JSONEq(t, body, string(res.Response.Body))
			require.Equal(t, 1, calls)
			require.Equal(t, begins, rc.begins.Load(), "the read answered: no claim's transaction")

			// Another Dialect over the pool knows of the refusal.
			for range 5 {
				replay(idemmysql.New(db))
			}
			require.Equal(t, int64(2), rc.prepares.Load(), "the refusal is the pool's, not one Dialect's")

			// A pool whose first prepare is refused: the same.
			db2, rc2 := open(true)
			for range 3 {
				replay(idemmysql.New(db2))
			}
			require.Equal(t, int64(1), rc2.prepares.Load(), "one refused prepare for the pool")
		})
	}
}
