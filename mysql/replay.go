package mysql

import (
	"context"
	"database/sql"
	"runtime"
	"sync"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/replayrow"
)

// getCompleted reads what a replay answers from: six columns of a live
// record, by primary key, without a lock (a consistent read). A processing
// record is read too and refused in Go (replayrow.Decode).
//
// Arguments: scope, key, now.
const getCompleted = `SELECT ` + replayrow.Columns + `
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ? AND expires_at > ` + now

// getCompletedLive is getCompleted on the server's clock, for a Store
// without Config.Now (almost every one): the same answer without the
// COALESCE and CAST of a NULL argument, which the server parses and
// evaluates on every replay (the text protocol of interpolateParams has no
// prepared plan to keep them in).
//
// Arguments: scope, key.
const getCompletedLive = `SELECT ` + replayrow.Columns + `
FROM idempotency_keys
WHERE scope = ? AND idempotency_key = ? AND expires_at > UTC_TIMESTAMP(6)`

var _ idem.ReplayReader = (*executor)(nil)

// replayRow holds the scan targets of getCompleted: one allocation for all
// of them instead of one each.
type replayRow struct {
	fingerprint, header, body sql.RawBytes
	status                    idem.Status
	code                      sql.NullInt64
	expires                   dbTime
}

// GetCompleted implements idem.ReplayReader.
//
// It scans through Rows into sql.RawBytes, the driver's buffer, which Row
// does not allow: the fingerprint and header are only read, so only the
// body is copied, where Row.Scan would copy all three. A replay is meant to
// cost what a bare primary-key read costs.
func (e *executor) GetCompleted(ctx context.Context, p *idem.GetParams) (*idem.Record, error) {
	rows, err := e.queryCompleted(ctx, p)
	if err != nil {
		return nil, interpretError(err)
	}
	defer func() { _ = rows.Close() }()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return nil, interpretError(err)
		}
		return nil, idem.ErrNotFound
	}
	v := new(replayRow)
	if err := rows.Scan(&v.fingerprint, &v.status, &v.code, &v.header, &v.body, &v.expires); err != nil {
		return nil, interpretError(err)
	}
	var body []byte
	if v.body != nil {
		body = append(make([]byte, 0, len(v.body)), v.body...)
	}
	// Decoded before Close, which frees the driver's buffer.
	rec, err := replayrow.Decode(p.Scope, p.Key, v.fingerprint, v.status, int(v.code.Int64), v.header, body, v.expires.Time)
	// As Row.Scan does: an error closing the answer wins over the row.
	if cerr := rows.Close(); cerr != nil {
		return nil, interpretError(cerr)
	}
	return rec, err
}

// queryCompleted runs the replay read. On the pool and the server's clock,
// the read Do makes before every claim of a key that is likely a replay, it
// runs as a prepared statement: the text protocol of interpolateParams makes
// the server parse and resolve the whole statement on every replay, which
// cost MariaDB more CPU than reading the row (docs/performance-history.md,
// round 8); a prepared one is parsed once per connection. Without
// interpolateParams, database/sql would otherwise prepare, execute and close
// it: three round trips where this takes one. A transaction's read (GetTx)
// and a pinned clock (Config.Now, tests) keep the text statement.
//
// A server that refuses to prepare (at its max_prepared_stmt_count, or a
// proxy without prepared statements: isPrepareRefused) gets the text
// statement instead, which with interpolateParams needs no prepare, for
// this replay and for replayRefusalPause after it,
// so that a replay costs one failed prepare a minute, not one each, and is
// still answered from the read rather than falling through to a claim.
// database/sql prepares the statement again on every connection it has not
// run on yet, so the refusal can come from QueryContext as well.
func (e *executor) queryCompleted(ctx context.Context, p *idem.GetParams) (*sql.Rows, error) {
	scope, key := []byte(p.Scope), []byte(p.Key)
	switch {
	case p.Now != nil:
		return e.h.QueryContext(ctx, getCompleted, scope, key, pinned(p.Now))
	case e.db == nil || e.d.replayRefusedRecently():
		return e.h.QueryContext(ctx, getCompletedLive, scope, key)
	}
	stmt, err := e.d.preparedReplay(ctx)
	if err == nil {
		var rows *sql.Rows
		if rows, err = stmt.QueryContext(ctx, scope, key); err == nil {
			return rows, nil
		}
	}
	if !isPrepareRefused(err) {
		return nil, err
	}
	e.d.replayRefusedAt.Store(time.Now().UnixNano())
	return e.h.QueryContext(ctx, getCompletedLive, scope, key)
}

// replayRefusalPause is how long replays send the text statement after
// the server refused to prepare the replay read. The limit that refuses
// is usually server-wide and held by other clients, so it lasts; a minute
// bounds the failed prepares without giving up on the prepared read.
const replayRefusalPause = time.Minute

// replayRefusedRecently reports whether the server refused to prepare the
// replay read less than replayRefusalPause ago.
func (d *Dialect) replayRefusedRecently() bool {
	at := d.replayRefusedAt.Load()
	return at != 0 && time.Since(time.Unix(0, at)) < replayRefusalPause
}

// preparedReplay returns getCompletedLive prepared on the pool, preparing it
// on the first call that succeeds. database/sql prepares it again on each
// connection it first runs on (one more round trip, once per connection)
// and drops it with the connection; the server holds one statement per open
// connection of the pool (max_prepared_stmt_count bounds them server-wide,
// 16 382 by default).
//
// The statement belongs to the pool, not to the Dialect: every Dialect over
// one *sql.DB shares it (see replayStatements), so that a service building
// Dialects freely, one per tenant or per request, does not leave one more
// server-side statement per Dialect on each connection until the
// connection closes, up to the server-wide limit, where every client of
// the server, not only idem, would be refused its prepares.
//
// No lock is held while preparing: a prepare that hangs (the server gone
// silent) would keep every other replay waiting past its own context. Calls
// that find nothing prepared each prepare, the first to finish is kept and
// the others close theirs. A failed prepare keeps nothing: the next replay
// tries again.
func (d *Dialect) preparedReplay(ctx context.Context) (*sql.Stmt, error) {
	if s := d.replayStmt.Load(); s != nil {
		return s, nil
	}
	if s := replayStatements.join(d, nil); s != nil {
		return s, nil
	}
	fresh, err := d.db.PrepareContext(ctx, getCompletedLive)
	if err != nil {
		return nil, err
	}
	s := replayStatements.join(d, fresh)
	if s != fresh {
		_ = fresh.Close()
	}
	return s, nil
}

// replayStatements holds the prepared replay read of each pool that has
// one, with the number of Dialects using it. A Dialect joins once, at its
// first prepared replay; a cleanup on the Dialect leaves when it becomes
// unreachable, and the last to leave closes the statement, which frees it
// on the server, and forgets the pool.
var replayStatements = replayRegistry{byDB: make(map[*sql.DB]*sharedReplay)}

type replayRegistry struct {
	mu   sync.Mutex
	byDB map[*sql.DB]*sharedReplay
}

// sharedReplay is one pool's prepared replay read and its users.
type sharedReplay struct {
	stmt  *sql.Stmt
	users int
}

// join returns the statement of d's pool, making d one of its users if it
// is not yet. When the pool has none, fresh becomes it; when fresh is nil,
// join returns nil and records nothing. The cleanup's argument is the pool,
// which does not reach d, so that it does not keep d alive.
func (r *replayRegistry) join(d *Dialect, fresh *sql.Stmt) *sql.Stmt {
	r.mu.Lock()
	defer r.mu.Unlock()
	if s := d.replayStmt.Load(); s != nil {
		// Joined meanwhile, by a concurrent first replay of d: the pool's
		// statement cannot have changed, d's use keeps it.
		return s
	}
	sh := r.byDB[d.db]
	if sh == nil {
		if fresh == nil {
			return nil
		}
		sh = &sharedReplay{stmt: fresh}
		r.byDB[d.db] = sh
	}
	sh.users++
	d.replayStmt.Store(sh.stmt)
	runtime.AddCleanup(d, r.leave, d.db)
	return sh.stmt
}

// leave ends one Dialect's use of db's statement; the last use closes it.
// Close runs outside the lock: it may write to the connections it was
// prepared on.
func (r *replayRegistry) leave(db *sql.DB) {
	r.mu.Lock()
	sh := r.byDB[db]
	if sh == nil {
		r.mu.Unlock()
		return
	}
	sh.users--
	if sh.users > 0 {
		r.mu.Unlock()
		return
	}
	delete(r.byDB, db)
	r.mu.Unlock()
	_ = sh.stmt.Close()
}
