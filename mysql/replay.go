package mysql

import (
	"context"
	"database/sql"
	"runtime"
	"sync"
	"sync/atomic"
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
// statement instead, for this replay and, on every Dialect over the pool,
// for replayRefusalPause after it, so that the pool's replays cost one
// failed prepare a minute, not one each, and are still answered from the
// read rather than falling through to a claim. database/sql prepares the
// statement again on every connection it has not run on yet, so the
// refusal can come from QueryContext as well. Only with interpolateParams
// does the text need no prepare; without it database/sql prepares the text
// too, the server refuses that as well, and the replay falls through to the
// claim as before.
func (e *executor) queryCompleted(ctx context.Context, p *idem.GetParams) (*sql.Rows, error) {
	scope, key := []byte(p.Scope), []byte(p.Key)
	if p.Now != nil {
		return e.h.QueryContext(ctx, getCompleted, scope, key, pinned(p.Now))
	}
	if e.db == nil {
		return e.h.QueryContext(ctx, getCompletedLive, scope, key)
	}
	sh := e.d.sharedReplay()
	if sh.refusedRecently() {
		return e.h.QueryContext(ctx, getCompletedLive, scope, key)
	}
	stmt, err := sh.prepared(ctx, e.db)
	if err == nil {
		var rows *sql.Rows
		if rows, err = stmt.QueryContext(ctx, scope, key); err == nil {
			return rows, nil
		}
	}
	if !isPrepareRefused(err) {
		return nil, err
	}
	sh.refused()
	return e.h.QueryContext(ctx, getCompletedLive, scope, key)
}

// replayRefusalPause is how long replays send the text statement after
// the server refused to prepare the replay read. The limit that refuses
// is usually server-wide and held by other clients, so it lasts; a minute
// bounds the failed prepares without giving up on the prepared read.
const replayRefusalPause = time.Minute

// processStart is the origin of sharedReplay.refusedAt: durations since it
// are monotonic, where a stored wall-clock time would stretch or cut the
// pause by any step of the system clock.
var processStart = time.Now()

// sharedReplay is what the Dialects over one pool share about the replay
// read: the prepared statement and the last refusal to prepare it.
//
// The statement belongs to the pool, not to the Dialect, so that a service
// building Dialects freely, one per tenant or per request, does not leave
// one more server-side statement per Dialect on each connection until the
// connection closes, up to the server-wide max_prepared_stmt_count
// (16 382 by default), where every client of the server, not only idem,
// would be refused its prepares; and does not pay one refused prepare per
// Dialect either. database/sql prepares the statement again on each
// connection it first runs on (one more round trip, once per connection)
// and drops it with the connection.
type sharedReplay struct {
	stmt atomic.Pointer[sql.Stmt]
	// refusedAt is when the server last refused to prepare the read, as
	// time since processStart (0: never).
	refusedAt atomic.Int64
	// users counts the Dialects that joined; guarded by replayStatements.mu.
	users int
}

// prepared returns getCompletedLive prepared on db, preparing it on the
// first call that succeeds. No lock is held while preparing: a prepare
// that hangs (the server gone silent) would keep every other replay
// waiting past its own context. Calls that find nothing prepared each
// prepare, the first to finish is kept and the others close theirs. A
// failed prepare keeps nothing: the next replay tries again.
func (sh *sharedReplay) prepared(ctx context.Context, db *sql.DB) (*sql.Stmt, error) {
	if s := sh.stmt.Load(); s != nil {
		return s, nil
	}
	fresh, err := db.PrepareContext(ctx, getCompletedLive)
	if err != nil {
		return nil, err
	}
	if !sh.stmt.CompareAndSwap(nil, fresh) {
		_ = fresh.Close()
	}
	return sh.stmt.Load(), nil
}

// refused records a refusal to prepare the read.
func (sh *sharedReplay) refused() {
	sh.refusedAt.Store(max(int64(time.Since(processStart)), 1))
}

// refusedRecently reports whether the server refused to prepare the read
// less than replayRefusalPause ago.
func (sh *sharedReplay) refusedRecently() bool {
	at := sh.refusedAt.Load()
	return at != 0 && time.Since(processStart)-time.Duration(at) < replayRefusalPause
}

// sharedReplay returns what d's pool shares about the replay read, joining
// it at d's first replay.
func (d *Dialect) sharedReplay() *sharedReplay {
	if sh := d.replay.Load(); sh != nil {
		return sh
	}
	return replayStatements.join(d)
}

// replayStatements holds, for each pool on which a replay ran, what its
// Dialects share about the replay read, with the number of Dialects using
// it. A Dialect joins once, at its first replay; a cleanup on the Dialect
// leaves when it becomes unreachable, and the last to leave closes the
// statement, which frees it on the server, and forgets the pool.
var replayStatements = replayRegistry{byDB: make(map[*sql.DB]*sharedReplay)}

type replayRegistry struct {
	mu   sync.Mutex
	byDB map[*sql.DB]*sharedReplay
}

// join makes d one of the users of its pool's sharedReplay, creating it
// if the pool has none. The cleanup's argument is the pool, which does not
// reach d, so that it does not keep d alive.
func (r *replayRegistry) join(d *Dialect) *sharedReplay {
	r.mu.Lock()
	defer r.mu.Unlock()
	if sh := d.replay.Load(); sh != nil {
		// Joined meanwhile, by a concurrent first replay of d.
		return sh
	}
	sh := r.byDB[d.db]
	if sh == nil {
		sh = &sharedReplay{}
		r.byDB[d.db] = sh
	}
	sh.users++
	d.replay.Store(sh)
	runtime.AddCleanup(d, r.leave, d.db)
	return sh
}

// leave ends one Dialect's use of db's sharedReplay; the last use closes
// the statement. Close runs outside the lock: it may write to the
// connections it was prepared on.
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
	if s := sh.stmt.Load(); s != nil {
		_ = s.Close()
	}
}
