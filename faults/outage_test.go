//go:build faults

package faults

import (
	"context"
	"database/sql"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	idemsqlite "github.com/idemstore/idem/sqlite"
)

// Scenario 3, database outage: the in-process order service runs under a
// steady load of new keys while its database goes away — its connections
// terminated, the server stopped cleanly and started again, the server
// killed with SIGKILL and started again (PostgreSQL and MariaDB, on private
// instances); another writer holding the SQLite write lock shorter and
// longer than the busy timeout. Clients retry a failed request with the
// same key until it succeeds, as the 503's Retry-After invites them to.
//
// What must hold: an answer during an outage is a 503 (the middleware's
// idempotency_store_unavailable or the business's own), or a 409 for a key
// an earlier attempt still holds; the service recovers by itself once the
// database is back (no restart); every 201 a client saw has exactly one
// business row, no key has two, and every acknowledged key replays its
// 201 afterwards (its record survived the crash too).

// outageDownFor is how long a stopped server stays down.
const outageDownFor = 1500 * time.Millisecond

// outageRecoverWithin bounds how long the service may take to answer a 201
// again once its database is back.
const outageRecoverWithin = 20 * time.Second

func outageConfig() inprocConfig {
	// A short lease: a payment whose completion the outage interrupted is
	// settled through the status check soon after, not after 30s.
	return inprocConfig{Lease: 2 * time.Second, ReapInterval: time.Second, Timeout: 10 * time.Second}
}

func TestOutage(t *testing.T) {
	for _, d := range dialects(t) {
		t.Run(d, func(t *testing.T) {
			switch d {
			case dialectSQLite:
				outageSQLite(t)
			case dialectPostgres:
				outagePostgres(t)
			case dialectMySQL:
				outageMySQL(t)
			}
		})
	}
}

func outagePostgres(t *testing.T) {
	srv, url := outageStartPostgres(t)
	svc := inprocOpenPostgres(t, url, false, outageConfig())
	l := outageStartLoad(t, svc)
	terminate := func() int {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Fatalf("terminate: connect: %v", err)
		}
		defer conn.Close(ctx)
		var n int
		// Only the service's backends: the pool sets application_name.
		err = conn.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE application_name = $1 AND pid <> pg_backend_pid()`, inprocPGAppName).Scan(&n)
		if err != nil {
			t.Fatalf("terminate: %v", err)
		}
		return n
	}
	outageScript(t, l, srv, terminate, syscall.SIGINT, "pg_terminate_backend", "fast shutdown (SIGINT)")
}

func outageMySQL(t *testing.T) {
	srv, dsn := outageStartMariaDB(t)
	svc, dbName := inprocOpenMySQL(t, dsn, outageConfig())
	l := outageStartLoad(t, svc)
	terminate := func() int {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		admin := inprocMySQLDB(t, inprocMySQLConfig(t, dsn), 1)
		defer admin.Close()
		// The service's connections are the ones using its database.
		rows, err := admin.QueryContext(ctx, `SELECT id FROM information_schema.PROCESSLIST WHERE db = ? AND id <> CONNECTION_ID()`, dbName)
		if err != nil {
			t.Fatalf("terminate: list connections: %v", err)
		}
		var ids []int64
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				t.Fatalf("terminate: %v", err)
			}
			ids = append(ids, id)
		}
		if err := rows.Err(); err != nil {
			t.Fatalf("terminate: %v", err)
		}
		_ = rows.Close() //nolint:sqlclosecheck // closed before the KILLs below, which need the connection it holds
		n := 0
		for _, id := range ids {
			// The driver interpolates the ID client-side (interpolateParams):
			// KILL takes no server-side placeholder. A connection that
			// closed meanwhile is "unknown thread": not counted.
			if _, err := admin.ExecContext(ctx, `KILL CONNECTION ?`, id); err == nil {
				n++
			}
		}
		return n
	}
	outageScript(t, l, srv, terminate, syscall.SIGTERM, "KILL CONNECTION", "shutdown (SIGTERM)")
}

// outageScript runs the faults of a server dialect under the load, then
// settles and checks.
func outageScript(t *testing.T, l *outageLoad, srv *outageServer, terminate func() int, stopSig syscall.Signal, terminateName, stopName string) {
	time.Sleep(time.Second)
	var recovered []time.Duration
	terminated, terminations := 0, 0
	for range scaled(3, 10) {
		terminated += terminate()
		terminations++
		recovered = append(recovered, l.waitOK(t, time.Now()))
		time.Sleep(500 * time.Millisecond)
	}
	if terminated == 0 {
		t.Errorf("%s found none of the service's connections to end", terminateName)
	}

	rounds := scaled(1, 3)
	for i := range 2 * rounds {
		if crash := i%2 == 1; crash {
			srv.crash()
		} else {
			srv.stop(stopSig)
		}
		l.down.Store(true)
		time.Sleep(outageDownFor)
		l.down.Store(false)
		srv.start()
		recovered = append(recovered, l.waitOK(t, time.Now()))
		time.Sleep(time.Second)
	}

	l.finish(t, 2*rounds+terminations,
		fmt.Sprintf("%d× %s (%d conns), %d× %s + start, %d× kill -9 + start", terminations, terminateName, terminated, rounds, stopName, rounds),
		fmt.Sprintf("down %s per stop", outageDownFor), recovered)
}

// outageSQLite: SQLite has no server to stop. Its outage is the database
// file being unwritable: another connection (as another process would)
// holds the write lock, first for less than the 5s busy timeout of
// idemsqlite.Open (requests queue and succeed), then for longer (requests
// get 503 until it lets go). A read-only file does not apply here: the
// tests run as root, which the file's permissions do not stop, and a
// read-only mount needs privileges the CI machine does not grant.
func outageSQLite(t *testing.T) {
	dir := t.TempDir()
	svc, _ := inprocOpenSQLite(t, dir, outageConfig())
	other, err := idemsqlite.Open(filepath.Join(dir, "orders.db"))
	if err != nil {
		t.Fatalf("open the other writer: %v", err)
	}
	t.Cleanup(func() { _ = other.Close() })
	l := outageStartLoad(t, svc)
	time.Sleep(time.Second)
	var recovered []time.Duration
	var holds []time.Duration
	for range scaled(1, 3) {
		holds = append(holds, 2*time.Second, 7*time.Second)
	}
	for _, hold := range holds {
		// Begin is BEGIN IMMEDIATE (idemsqlite.Open): it takes the write lock.
		tx, err := other.BeginTx(t.Context(), &sql.TxOptions{})
		if err != nil {
			t.Fatalf("take the write lock: %v", err)
		}
		l.down.Store(true)
		time.Sleep(hold)
		l.down.Store(false)
		if err := tx.Rollback(); err != nil {
			t.Fatalf("release the write lock: %v", err)
		}
		recovered = append(recovered, l.waitOK(t, time.Now()))
		time.Sleep(time.Second)
	}
	l.finish(t, len(holds), "write lock held by another connection, alternately 2s and 7s; busy timeout 5s", "", recovered)
}

// outageLoad is the clients: workers that send new keys and retry each
// until it is acknowledged.
type outageLoad struct {
	svc  *inprocService
	ctx  context.Context
	stop context.CancelFunc
	wg   sync.WaitGroup
	// down is set while the database is away, to count those answers apart.
	down atomic.Bool
	oks  atomic.Int64 // 201s seen

	mu         sync.Mutex
	requests   int
	codes      map[string]int
	downCodes  map[string]int
	unexpected map[string]int
	acked      map[inprocKey]inprocAnswer
	pending    map[inprocKey]int64 // sent, not acknowledged when the load stopped → amount
}

// outageWorkers is the number of concurrent clients.
const outageWorkers = 6

func outageStartLoad(t *testing.T, svc *inprocService) *outageLoad {
	ctx, stop := context.WithCancel(t.Context())
	l := &outageLoad{svc: svc, ctx: ctx, stop: stop, codes: map[string]int{}, downCodes: map[string]int{},
		unexpected: map[string]int{}, acked: map[inprocKey]inprocAnswer{}, pending: map[inprocKey]int64{}}
	t.Cleanup(func() { stop(); l.wg.Wait() })
	for range outageWorkers {
		l.wg.Go(l.worker)
	}
	return l
}

func (l *outageLoad) worker() {
	for l.ctx.Err() == nil {
		route := inprocOrders
		if rand.IntN(5) == 0 {
			route = inprocPayments
		}
		k := inprocKey{Route: route, Tenant: "acme", Key: inprocNewKey("outage")}
		amount := 1 + rand.Int64N(10_000)
		for {
			a := l.svc.post(l.ctx, k, amount)
			if l.ctx.Err() != nil {
				// Stopped mid-request: whatever happened is settled later.
				l.mu.Lock()
				l.pending[k] = amount
				l.mu.Unlock()
				return
			}
			if l.record(k, a) {
				break
			}
			// Retry the same key soon: shorter than Retry-After, to put
			// the service under pressure while the database is away.
			outageSleep(l.ctx, time.Duration(20+rand.IntN(40))*time.Millisecond)
		}
		outageSleep(l.ctx, 10*time.Millisecond)
	}
}

// record counts an answer and reports whether the key is done with.
func (l *outageLoad) record(k inprocKey, a inprocAnswer) (done bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.requests++
	l.codes[a.Label()]++
	if l.down.Load() {
		l.downCodes[a.Label()]++
	}
	switch {
	case a.Err == nil && a.Status == http.StatusCreated:
		if prev, ok := l.acked[k]; ok && (prev.Body.ID != a.Body.ID || prev.Body.ChargeID != a.Body.ChargeID) {
			l.unexpected["201 with another body than the first 201"]++
		}
		if _, ok := l.acked[k]; !ok {
			l.acked[k] = a
		}
		l.oks.Add(1)
		return true
	case inprocIsUnavailable(a):
		return false
	default:
		l.unexpected[a.Label()]++
		return true
	}
}

// waitOK waits until a 201 arrives after since, and returns how long it
// took: the service recovering without a restart.
func (l *outageLoad) waitOK(t *testing.T, since time.Time) time.Duration {
	t.Helper()
	base := l.oks.Load()
	for l.oks.Load() == base {
		if time.Since(since) > outageRecoverWithin {
			t.Fatalf("%s: no 201 within %s of the database coming back: the service did not recover", l.svc.Dialect, outageRecoverWithin)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return time.Since(since)
}

// finish stops the load, retries the keys left unacknowledged until each is
// acknowledged, replays every acknowledged key, checks the rows and reports.
func (l *outageLoad) finish(t *testing.T, faults int, kind, notes string, recovered []time.Duration) {
	t.Helper()
	l.stop()
	l.wg.Wait()
	ctx := t.Context()

	// Settle: a client retries with the same key until it gets its 201.
	deadline := time.Now().Add(outageRecoverWithin)
	for k, amount := range l.pending {
		for !l.record(k, l.svc.post(ctx, k, amount)) {
			if time.Now().After(deadline) {
				t.Errorf("%s: a key retried after the outage still failed after %s", l.svc.Dialect, outageRecoverWithin)
				break
			}
			outageSleep(ctx, 100*time.Millisecond)
		}
	}

	// Replay: every acknowledged key's record survived and answers the
	// same 201.
	replays, replayBad := 0, 0
	for k, first := range l.acked {
		body := l.svc.post(ctx, k, first.Body.Amount)
		replays++
		l.codes[body.Label()]++
		if body.Err != nil || body.Status != http.StatusCreated || !body.Replayed ||
			body.Body.ID != first.Body.ID || body.Body.ChargeID != first.Body.ChargeID {
			replayBad++
		}
	}
	if replayBad > 0 {
		t.Errorf("%s: %d of %d acknowledged keys did not replay their 201 after the outage", l.svc.Dialect, replayBad, replays)
	}

	dups, lost, err := inprocCheck(ctx, l.svc, l.acked)
	if err != nil {
		t.Fatalf("%v", err)
	}
	for what, n := range l.unexpected {
		t.Errorf("%s: unexpected answer %s (%d times)", l.svc.Dialect, what, n)
	}
	var rec []string
	for _, d := range recovered {
		rec = append(rec, d.Round(10*time.Millisecond).String())
	}
	var down []string
	for _, k := range slices.Sorted(maps.Keys(l.downCodes)) {
		down = append(down, fmt.Sprintf("%s: %d", k, l.downCodes[k]))
	}
	payments, recoveredPay := 0, 0
	for k, a := range l.acked {
		if k.Route == inprocPayments {
			payments++
			if a.Body.Recovered {
				recoveredPay++
			}
		}
	}
	n := fmt.Sprintf("%d keys acknowledged (%d payments, %d settled by the status check), %d retried after the load; first 201 after each fault in %s; while down: %s; %d replays all 201 replayed",
		len(l.acked), payments, recoveredPay, len(l.pending), strings.Join(rec, ", "), strings.Join(down, ", "), replays-replayBad)
	if notes != "" {
		n += "; " + notes
	}
	report(t, outcome{
		Scenario:   "database outage",
		Dialect:    l.svc.Dialect,
		Requests:   l.requests + replays,
		Faults:     faults,
		FaultKind:  "(" + kind + ")",
		Duplicates: dups,
		Lost:       lost,
		Codes:      l.codes,
		Notes:      n,
	})
}

func outageSleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}
