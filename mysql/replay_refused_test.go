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
}

// fullConn is what database/sql and the driver's connections offer.
type fullConn interface {
	driver.Conn
	driver.ConnBeginTx
	driver.ConnPrepareContext
	driver.ExecerContext
	driver.QueryerContext
	driver.Pinger
	driver.SessionResetter
	driver.Validator
	driver.NamedValueChecker
}

func (c *refusingPrepares) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	fc, ok := conn.(fullConn)
	if !ok {
		_ = conn.Close()
		return nil, fmt.Errorf("connection %T lacks methods database/sql uses", conn)
	}
	return &refusingConn{fullConn: fc, c: c}, nil
}

type refusingConn struct {
	fullConn
	c *refusingPrepares
}

func (r *refusingConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	r.c.prepares.Add(1)
	if r.c.refuse.Load() {
		return nil, &gomysql.MySQLError{Number: 1461, Message: "Can't create more than max_prepared_stmt_count statements"}
	}
	return r.fullConn.PrepareContext(ctx, query)
}

// TestReplayReadAfterPrepareRefused: a server that refuses to prepare the
// replay read, at its prepare limit, still answers replays from the read,
// sent as text, and is asked to prepare it once, not once per replay. The
// refusal comes either from the first prepare or, for a statement already
// prepared, from database/sql preparing it again on a new connection.
func TestReplayReadAfterPrepareRefused(t *testing.T) {
	t.Parallel()
	for _, piped := range []bool{false, true} {
		t.Run(fmt.Sprintf("NewConnector=%v", piped), func(t *testing.T) {
			t.Parallel()
			ctx, b := setup(t, newPlain, true)
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
			db := sql.OpenDB(rc)
			t.Cleanup(func() { _ = db.Close() })
			// One connection at a time: a new one is a new prepare.
			db.SetMaxOpenConns(1)

			const scope, key, body = "t1/create", "refused", `{"id":7}`
			d := idemmysql.New(db)
			store, err := idem.New(d, nil)
			require.NoError(t, err)
			fp := idem.NewFingerprint()
			calls := 0
			fn := func(context.Context, *sql.Tx) (*idem.Response, error) {
				calls++
				return &idem.Response{StatusCode: 201, Body: []byte(body)}, nil
			}
			_, err = store.Do(ctx, scope, key, fp, fn)
			require.NoError(t, err)

			reader, ok := d.DB().(idem.ReplayReader)
			require.True(t, ok)
			replay := func(r idem.ReplayReader) {
				t.Helper()
				rec, err := r.GetCompleted(ctx, &idem.GetParams{Scope: scope, Key: key})
				require.NoError(t, err)
				require.JSONEq(t, body, string(rec.Response.Body))
			}

			// Prepared, on the pool's one connection.
			replay(reader)
			require.Equal(t, int64(1), rc.prepares.Load())

			// A new connection, on which database/sql prepares it again,
			// and the server refuses: the read goes as text.
			rc.refuse.Store(true)
			db.SetMaxIdleConns(0) // closes the idle connection
			db.SetMaxIdleConns(1)
			for range 5 {
				replay(reader)
			}
			require.Equal(t, int64(2), rc.prepares.Load(), "a refused prepare is not asked again at every replay")

			// Do replays from that read as well, without running fn.
			res, err := store.Do(ctx, scope, key, fp, fn)
			require.NoError(t, err)
			require.True(t, res.Replayed)
			require.JSONEq(t, body, string(res.Response.Body))
			require.Equal(t, 1, calls)

			// A Dialect of its own over a server that refuses its first
			// prepare: the same.
			other, ok := idemmysql.New(db).DB().(idem.ReplayReader)
			require.True(t, ok)
			for range 5 {
				replay(other)
			}
			require.Equal(t, int64(3), rc.prepares.Load(), "one refused prepare for the new Dialect")
		})
	}
}
