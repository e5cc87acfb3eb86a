// Package conformance is the behavioural contract every idem dialect must
// pass. Each dialect package runs it against a real server from a short
// conformance_test.go:
//
//	func TestConformance(t *testing.T) {
//		t.Parallel()
//		conformance.Run(t, newHarness(t))
//	}
//
//	// The lease holder the process cases start and kill; see RunChild.
//	func TestConformanceChild(t *testing.T) { conformance.RunChild(t, reopen) }
//
// The suite only uses the public API of package idem plus the hooks a
// [Harness] provides, so it checks behaviour users rely on, not internals.
// It has two layers: cases through [idem.Store], and executor cases
// (files executor*.go, names "Executor…") that call the [idem.Executor]
// of Dialect.DB and Dialect.Tx directly, one clause of its contract at a
// time, so that a dialect that breaks a clause fails a case named for it.
// [RunExecutor] runs only the executor cases, for a variant of a dialect
// (an exec mode, a driver option).
// Dialect differences are expressed as [Features], never as checks of the
// dialect's name.
package conformance

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/migrations"
)

// Harness gives the suite fresh, isolated databases for one dialect.
type Harness[TTx any] interface {
	// Open returns a new, fully migrated, empty namespace owned by t (a
	// schema on PostgreSQL, a database on MySQL, a file on SQLite) holding
	// idem's table and a test business table. It registers cleanup on t and
	// fails t on error.
	Open(ctx context.Context, t *testing.T) *Namespace[TTx]
	// Unreachable returns a dialect whose server cannot be reached (a closed
	// port, a file that cannot be opened).
	Unreachable(ctx context.Context, t *testing.T) idem.Dialect[TTx]
	// Features reports what the dialect can do, so cases adapt to it.
	Features() Features
}

// Namespace is one isolated database opened by [Harness.Open].
type Namespace[TTx any] struct {
	// Dialect is bound to the namespace.
	Dialect idem.Dialect[TTx]
	// InsertOrder inserts one row with ref into the namespace's business
	// table inside tx. The table has no unique constraint on ref, so the
	// suite can count duplicate executions.
	InsertOrder func(ctx context.Context, tx TTx, ref string) error
	// CountOrders counts committed business rows with ref, reading on a
	// connection of its own.
	CountOrders func(ctx context.Context, ref string) (int, error)
	// CountRecords counts committed rows in idempotency_keys.
	CountRecords func(ctx context.Context) (int, error)
	// SeedExpired bulk-inserts n succeeded records in scope "seed" (keys
	// "seed-0" ... "seed-<n-1>") whose retention deadline is expiresAt, in
	// few statements, so reaper cases can start from a large table.
	SeedExpired func(ctx context.Context, n int, expiresAt time.Time) error
	// Migrate runs the dialect's Migrate on the namespace's pool (Open has
	// run it once already).
	Migrate func(ctx context.Context) error
	// Unmigrate runs every down migration of the dialect on the namespace
	// (goose down to version 0), so the migrate case can check that the
	// schema comes back.
	Unmigrate func(ctx context.Context) error
	// CorruptResponse overwrites, by hand with SQL on the namespace's pool,
	// the response_status and response_headers columns of the committed
	// record (scope, key), bypassing idem: a nil status or headers stores
	// NULL. The suite uses it to play a record written by an older
	// version, by hand, or damaged.
	CorruptResponse func(ctx context.Context, scope, key string, status *int, headers []byte) error
	// BodyTable returns the dialect's table body store (NewTableBodyStore)
	// over the namespace's pool and idempotency_bodies table, with cfg.
	BodyTable func(cfg *idem.TableBodyStoreConfig) idem.BodyStore
	// BodyRows counts committed rows in idempotency_bodies, reading on a
	// connection of its own.
	BodyRows func(ctx context.Context) (int, error)
	// SetBodyChunk overwrites by hand, with SQL on the namespace's pool,
	// the data of row seq of the object address in idempotency_bodies; nil
	// data deletes the row. It fails when no such row exists.
	SetBodyChunk func(ctx context.Context, address string, seq int64, data []byte) error
	// DropBodyTable drops idempotency_bodies, so that every statement of
	// the table body store fails: a body store that is down.
	DropBodyTable func(ctx context.Context) error
	// Close closes the namespace's connection pool. Afterwards every store
	// operation on Dialect must fail with idem.ErrStoreUnavailable.
	Close func()
	// ChildEnv is what a child process needs to reconnect to this
	// namespace, as "NAME=value" entries (a DSN or URL with the schema or
	// database name, a file path). The process cases re-execute the test
	// binary with them added to the environment; there, the reopen function
	// the dialect passes to [RunChild] reads them back.
	ChildEnv []string
}

// Features describes the dialect's capabilities and documented differences.
type Features struct {
	// TimePrecision is the resolution of stored times (1µs on every
	// shipped dialect).
	TimePrecision time.Duration
	// SingleWriter is true for SQLite: writers serialise on the database
	// lock at BEGIN, so an uncommitted claim can never be observed from
	// another transaction, and a wait that times out reports
	// idem.ErrStoreUnavailable (the database is busy) instead of
	// idem.ErrInProgress.
	SingleWriter bool
	// WaitAbortsTx is true when a claim whose wait times out aborts the
	// surrounding transaction (PostgreSQL).
	WaitAbortsTx bool
	// WaitGranularity is the step WaitTimeout is rounded up to (1s on
	// MySQL, whose innodb_lock_wait_timeout counts whole seconds).
	WaitGranularity time.Duration
	// DeferredClaims is true when the Dialect must implement
	// idem.DeferredClaimer (PostgreSQL, SQLite), false when it must not
	// (MySQL): the suite fails on a mismatch either way, so a dialect that
	// loses the interface fails instead of skipping its cases.
	DeferredClaims bool
	// Pipelined is true when the Dialect must implement idem.TxPipeliner
	// and, with DeferredClaims, idem.DeferredTxPipeliner (PostgreSQL); the
	// suite fails on a mismatch either way.
	Pipelined bool
	// OptimisticDo is true when the Dialect must implement
	// idem.OptimisticClaimer and answer with optimistic claims (package
	// mysql with WithOptimisticDo): two overlapping Do calls of one key may
	// both run fn, and exactly one commits.
	OptimisticDo bool
}

// Run runs every conformance case against h as parallel subtests of t, in a
// fixed order.
func Run[TTx any](t *testing.T, h Harness[TTx]) {
	t.Helper()
	// Runs after every parallel case: the log scan must have seen lines,
	// or it proved nothing.
	t.Cleanup(func() {
		if loggedLines.Load() == 0 {
			t.Error("conformance: no case logged a line; the log scan saw nothing")
		}
	})
	run(t, h, cases[TTx]())
}

// RunExecutor runs only the executor cases, which call the Executor
// directly, clause by clause: for a variant of a dialect (a driver option,
// an exec mode) whose Store-level behaviour Run already covers.
func RunExecutor[TTx any](t *testing.T, h Harness[TTx]) {
	t.Helper()
	run(t, h, executorCases[TTx]())
}

func run[TTx any](t *testing.T, h Harness[TTx], cases []testCase[TTx]) {
	t.Helper()
	features := h.Features()
	for _, c := range cases {
		if c.applies != nil && !c.applies(features) {
			continue // not applicable: registered as no subtest, so never counted as a pass or a skip
		}
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t, h)
		})
	}
}

type testCase[TTx any] struct {
	name string
	run  func(t *testing.T, h Harness[TTx])
	// applies, when set, limits the case to dialects with these features.
	applies func(Features) bool
}

// concurrentWriters holds for dialects where two transactions can write at
// once, so one can wait inside its transaction for the other's claim.
func concurrentWriters(f Features) bool { return !f.SingleWriter }

// optimisticDo selects the cases of optimistic claims.
func optimisticDo(f Features) bool { return f.OptimisticDo }

// entriesWhileHeld is how often a Do whose key another transaction holds
// enters its callback before it answers: never when it waits before fn;
// once with optimistic claims, whose callback runs and is rolled back.
func entriesWhileHeld(f Features) int {
	if f.OptimisticDo {
		return 1
	}
	return 0
}

// cases lists the suite in a fixed order, grouped by concern.
func cases[TTx any]() []testCase[TTx] {
	var all []testCase[TTx]
	all = append(all, claimCases[TTx]()...)
	all = append(all, txCases[TTx]()...)
	all = append(all, waitCases[TTx]()...)
	all = append(all, retentionCases[TTx]()...)
	all = append(all, concurrencyCases[TTx]()...)
	all = append(all, mixedCases[TTx]()...)
	all = append(all, leaseCases[TTx]()...)
	all = append(all, reaperCases[TTx]()...)
	all = append(all, raceCases[TTx]()...)
	all = append(all, staleCases[TTx]()...)
	all = append(all, tenantCases[TTx]()...)
	all = append(all, errorCases[TTx]()...)
	all = append(all, executorCases[TTx]()...)
	all = append(all, validateCases[TTx]()...)
	all = append(all, opsCases[TTx]()...)
	all = append(all, bodyStoreCases[TTx](dirBodyStores{})...)
	all = append(all, bodyTableCases[TTx]()...)
	all = append(all, decisionCases[TTx]()...)
	all = append(all, replayReadCases[TTx]()...)
	return all
}

// MigrateDown runs every down migration of the migrations package's
// dialect on db (goose down to version 0): a [Namespace.Unmigrate] for
// dialects whose pool is, or can be wrapped as, a *sql.DB.
func MigrateDown(ctx context.Context, dialect string, db *sql.DB) error {
	p, err := migrations.NewProvider(dialect, db)
	if err != nil {
		return err
	}
	_, err = p.DownTo(ctx, 0)
	return err
}

// SetBodyChunkSQL is a [Namespace.SetBodyChunk] for dialects whose pool
// is a *sql.DB whose placeholders are "?".
func SetBodyChunkSQL(ctx context.Context, db *sql.DB, address string, seq int64, data []byte) error {
	var (
		res sql.Result
		err error
	)
	if data == nil {
		res, err = db.ExecContext(ctx, `DELETE FROM idempotency_bodies WHERE address = ? AND seq = ?`, address, seq)
	} else {
		res, err = db.ExecContext(ctx, `UPDATE idempotency_bodies SET data = ? WHERE address = ? AND seq = ?`, data, address, seq)
	}
	if err != nil {
		return err
	}
	if n, err := res.RowsAffected(); err != nil || n != 1 {
		return fmt.Errorf("conformance: set body chunk: %d rows affected (%w)", n, err)
	}
	return nil
}
