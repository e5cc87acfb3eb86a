package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/codec"
	"github.com/idemstore/idem/internal/workload"
)

// The floor scenarios measure what no design of Store.Do (floor) or of
// ClaimTx and CompleteTx (floortx) can do without, for a fresh key: in the
// business transaction, the primary-key read a claim needs to learn that
// the key is free, and the INSERT of the finished record, nothing else (no
// key lock, no processing row, no lock_timeout juggling). Run in the same
// repetition as do and tx, a floor ÷ bare below a target shows the target
// out of reach for every design on this machine.
//
// Their rows go to a table of their own, floorTable, created after the
// migrations as a copy of idempotency_keys (columns, primary key and
// secondary indexes, so an insert pays the same index entries), so that
// the exactly-once check of the other scenarios still reads
// idempotency_keys alone.
const floorTable = "idembench_floor_records"

// floorRecordColumns are the columns of floorTable the floor scenarios
// read and write: idempotency_keys' (SQLite's key_digest, written from Go,
// is added by its own statement).
const floorRecordColumns = `scope, idempotency_key, fingerprint, status, token, attempt, lease_expires_at,
	response_status, response_headers, response_body, created_at, updated_at, completed_at, expires_at`

// floorDoneWhere selects the rows of floorTable that are finished records:
// succeeded, every column filled.
const floorDoneWhere = `status = 2 AND fingerprint IS NOT NULL AND token IS NOT NULL AND attempt = 1
	AND lease_expires_at IS NOT NULL AND response_status IS NOT NULL AND response_headers IS NOT NULL
	AND response_body IS NOT NULL AND created_at IS NOT NULL AND updated_at IS NOT NULL
	AND completed_at IS NOT NULL AND expires_at IS NOT NULL`

// floorHeader is response's header as idem stores it.
var floorHeader = func() []byte {
	h, err := codec.EncodeHeader(response.Header)
	if err != nil {
		panic(err) // a constant header: cannot fail
	}
	return h
}()

// Store defaults (idem.Config), which every Store of the tool keeps: a
// finished record carries the lease its claim took and the retention its
// completion set.
const (
	floorLease     = 30 * time.Second
	floorRetention = 24 * time.Hour
)

// floorRow is one finished record of the floor scenarios, as a completion
// of a fresh key writes it.
type floorRow struct {
	scope, key                 string
	token                      int64
	now, leaseExpires, expires time.Time
}

func newFloorRow(scope, key string) *floorRow {
	now := time.Now().UTC().Truncate(time.Microsecond)
	return &floorRow{
		scope: scope, key: key, token: rand.Int64(), //nolint:gosec // a token need only differ
		now: now, leaseExpires: now.Add(floorLease), expires: now.Add(floorRetention),
	}
}

// args are the values of floorRecordColumns, times as the driver takes
// them (PostgreSQL, MariaDB).
func (r *floorRow) args() []any {
	return []any{r.scope, r.key, fingerprint[:], int16(idem.StatusSucceeded), r.token, int32(1), r.leaseExpires,
		int32(response.StatusCode), floorHeader, response.Body, r.now, r.now, r.now, r.expires}
}

// errFloorKeyFound is the answer of a floor read that found the fresh key.
var errFloorKeyFound = errors.New("floor: fresh key found")

// floorRunner runs the floor scenarios on one pool.
type floorRunner[TTx any] struct {
	// do is floor's operation: BEGIN; the read; the shape (insert); the
	// finished record's INSERT; COMMIT, in as many round trips as Do (nil
	// when the runner was opened for floortx).
	do func(ctx context.Context, insert func(context.Context, TTx, string) error, scope string) error
	// lock is floorlock's: on MariaDB see mysqlFloorLockClaim, on
	// PostgreSQL pgFloorTryLock (nil on SQLite).
	lock func(ctx context.Context, insert func(context.Context, TTx, string) error, scope string) error
	// lockBound is floorlockbound's (MariaDB only): see
	// mysqlFloorLockBoundClaim.
	lockBound func(ctx context.Context, insert func(context.Context, TTx, string) error, scope string) error
	// resp is floorresp's (MariaDB only): see mysqlFloorRespClaim.
	resp func(ctx context.Context, insert func(context.Context, TTx, string) error, scope string) error
	// tx is floortx's: the same in a transaction begun as a caller begins
	// one, each statement sent alone.
	tx    func(ctx context.Context, insert func(context.Context, TTx, string) error, scope string) error
	close func()
}

// floorTxOp returns floortx's operation on s: BEGIN (s's dialect, as a
// caller's); read; the shape; write; COMMIT, each a statement of its own.
func floorTxOp[TTx any](s *idem.Store[TTx], read func(ctx context.Context, tx TTx, r *floorRow) error,
	write func(ctx context.Context, tx TTx, r *floorRow) error,
) func(context.Context, func(context.Context, TTx, string) error, string) error {
	return func(ctx context.Context, insert func(context.Context, TTx, string) error, scope string) error {
		r := newFloorRow(scope, workload.NewKey())
		return inTx(ctx, s, func(tx TTx) error {
			if err := read(ctx, tx, r); err != nil {
				return err
			}
			if err := insert(ctx, tx, scope); err != nil {
				return err
			}
			return write(ctx, tx, r)
		})
	}
}

// floorScenarios returns floor and floortx of shape; each opens its runner
// on the main pools for its measurement.
func (l *level[TTx]) floorScenarios(insert func(context.Context, TTx, string) error) []*scenario {
	mk := func(name string, callerTx bool, writes writeKind) *scenario {
		var run func(context.Context, func(context.Context, TTx, string) error, string) error
		return &scenario{
			name: name, writes: writes,
			setup: func(ctx context.Context) (func(), error) {
				fr, err := l.p.openFloor(ctx, callerTx)
				if err != nil {
					return nil, fmt.Errorf("open floor: %w", err)
				}
				switch name {
				case "floortx":
					run = fr.tx
				case "floorlock":
					run = fr.lock
				case "floorlockbound":
					run = fr.lockBound
				case "floorresp":
					run = fr.resp
				default:
					run = fr.do
				}
				if run == nil {
					fr.close()
					return nil, fmt.Errorf("%s: not measured on this dialect", name)
				}
				return fr.close, nil
			},
			op: func(ctx context.Context, _ int) error { return run(ctx, insert, randomScope()) },
		}
	}
	all := []*scenario{mk("floor", false, writesFloor), mk("floortx", true, writesFloor)}
	switch {
	case l.p.floorLock:
		all = append(all, mk("floorlock", false, writesFloorLock), mk("floorlockbound", false, writesFloorLock),
			mk("floorresp", false, writesFloorResp))
	case l.p.floorKeyLock:
		all = append(all, mk("floorlock", false, writesFloor))
	}
	return all
}

// floorSeed is the reset's statement that gives floorTable the seeded
// records idempotency_keys gets (extra: columns beyond
// floorRecordColumns), so that the floor's read and INSERT meet an index
// as deep as the claims' and, on PostgreSQL, the plans a table of that
// size gets: planned on an empty table, a prepared read's generic plan can
// stay a sequential scan while the table grows.
func floorSeed(extra string) string {
	return `INSERT INTO ` + floorTable + ` (` + floorRecordColumns + extra + `) SELECT ` + floorRecordColumns + extra + ` FROM idembench_seed`
}

// floorNotSeeded leaves the seeded rows out of a count of floorTable
// (alias f).
const floorNotSeeded = ` NOT EXISTS (SELECT 1 FROM idembench_seed s WHERE s.scope = f.scope AND s.idempotency_key = f.idempotency_key)`

// checkFloor is the floor scenarios' part of the exactly-once check: as
// many finished records in floorTable (reset to the seeds) as orders.
func checkFloor[TTx any](ctx context.Context, b *backend[TTx], a admin, orders int64) error {
	all, err := a.queryInt(ctx, `SELECT COUNT(*) FROM `+floorTable+` f WHERE`+floorNotSeeded)
	if err != nil {
		return fmt.Errorf("count floor records: %w", err)
	}
	done, err := a.queryInt(ctx, `SELECT COUNT(*) FROM `+floorTable+` f WHERE`+floorNotSeeded+` AND `+b.sql.floorDone)
	if err != nil {
		return fmt.Errorf("count floor records: %w", err)
	}
	if all != orders || done != orders {
		return fmt.Errorf("exactly-once check (floor): %d floor records, %d of them finished, for %d orders", all, done, orders)
	}
	return nil
}
