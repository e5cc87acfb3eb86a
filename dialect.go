package idem

import (
	"context"
	"errors"
	"time"
)

// Dialect adapts a [Store] to one database and client library. TTx is the
// caller's transaction type: pgx.Tx for package postgres, *sql.Tx for packages
// mysql and sqlite.
//
// The dialects in this module (postgres, mysql, sqlite) are the supported set;
// the interface is exported only because they live in separate packages.
// It may gain methods in minor releases (noted in CHANGELOG.md), so
// implementations outside this module must expect to be updated. Every
// implementation must pass [github.com/idemstore/idem/conformance.Run].
type Dialect[TTx any] interface {
	// Name returns "postgres", "mysql" or "sqlite"; it appears in logs.
	Name() string
	// DB returns an Executor that runs each statement on the pool, outside
	// any caller transaction.
	DB() Executor
	// Tx returns an Executor that runs inside tx. It must never commit or
	// roll back tx.
	Tx(tx TTx) Executor
	// Begin starts a transaction suitable for claiming a key (on SQLite, one
	// that takes the write lock at once). Used by [Store.Do].
	Begin(ctx context.Context) (TTx, error)
	// Commit commits tx. A failure must be reported with the driver's error
	// wrapped, classified as for Executor methods.
	Commit(ctx context.Context, tx TTx) error
	// Rollback rolls tx back. Rolling back a finished transaction is not an error.
	Rollback(ctx context.Context, tx TTx) error
}

// TxPipeliner is implemented, optionally, by a [Dialect] whose driver can
// send several statements in one round trip (package postgres, with pgx
// batches). [Store.Do], which owns its transaction, detects it by a type
// assertion on the Dialect and then saves two round trips: BEGIN travels with
// the claim, the completion with COMMIT. Every decision stays with the
// Store, which treats the results exactly as those of [Executor.Claim] and
// [Executor.Complete].
type TxPipeliner[TTx any] interface {
	// BeginClaim begins a transaction as Dialect.Begin does and runs
	// Executor.Claim(p) in it, in one round trip, with the semantics and
	// errors of Claim inside a caller's transaction (so an *InProgressError
	// has TxAborted set when the wait timeout aborted the transaction).
	//
	// It always returns a value that Dialect.Rollback accepts, even with an
	// error: when the transaction was begun it is returned, still open
	// (possibly aborted), and the caller must roll it back, or, after
	// [ErrNotFound], may go on using it through Dialect.Tx as after Claim;
	// when it could not be begun, a transaction already closed whose
	// Rollback is harmless.
	BeginClaim(ctx context.Context, p *ClaimParams) (TTx, *ClaimResult, error)

	// CompleteCommit runs Executor.Complete(p) in tx and commits tx, in one
	// round trip. When the completion matches no row it returns
	// [ErrFenced] and commits nothing: the whole transaction, the caller's
	// writes included, is rolled back. Other errors are those of Complete
	// and Dialect.Commit (a lost connection during COMMIT leaves its
	// outcome unknown, as with Commit). After any error tx is finished or
	// must be rolled back; Dialect.Rollback on it is always safe.
	CompleteCommit(ctx context.Context, tx TTx, p *CompleteParams) error
}

// DeferredClaimer is implemented, optionally, by a [Dialect] that can claim
// a key inside a transaction without writing its record: the transaction
// holds a lock on the key instead, and the completion inserts the finished
// record, one row version where [Executor.Claim] and [Executor.Complete]
// write two (an insert, then an update touching every index). Package
// postgres takes a transaction-level advisory lock; package sqlite relies on
// the write lock BEGIN IMMEDIATE took. [Store.Do] detects it by a type
// assertion on the Dialect; a dialect without it (package mysql, whose row
// is the lock) claims and completes with the Executor's methods. Every
// decision stays with the Store, which treats a deferred claim's result as
// that of Claim.
//
// Contract, clause by clause (tx is a transaction of Dialect.Begin; the
// Executor's clauses on errors, Now and caller transactions apply too):
//   - When the key has no record, ClaimDeferred writes nothing and returns
//     Created, with Record the processing record the completion will insert:
//     p's Token and Fingerprint, Attempt 1, CreatedAt = now, LeaseExpiresAt
//     = now + LeaseDuration, ExpiresAt = now + Retention, as the dialect
//     stores them.
//   - From then until tx ends, tx holds the key's lock: every Executor.Claim
//     of the key, on the pool or in another transaction, and every other
//     ClaimDeferred waits for tx to end (bounded by its WaitTimeout, as in
//     Claim) and then sees what tx committed; if tx rolls back, the key is
//     free. No record of the key is created meanwhile by any of them.
//   - When the key has a record, ClaimDeferred returns it with Created
//     false, read by the rules of Claim: after a wait for a holder, as the
//     holder committed it; expired records as they are; ErrNotFound when
//     it vanished before it could be read. When a committed record is
//     visible it takes no lock, so that replays of a key in long caller
//     transactions never wait for one another.
//   - A wait past WaitTimeout returns an *[InProgressError], as in Claim.
//   - ClaimDeferred returns [ErrSkipDefer] when tx cannot hold the key
//     without a row (PostgreSQL under REPEATABLE READ or SERIALIZABLE,
//     whose snapshot may predate the lock); tx stays usable, and the Store
//     claims with Executor.Claim in it and completes with Executor.Complete.
//   - CompleteDeferred, after a Created ClaimDeferred in the same tx,
//     inserts the finished record: p's Status, Response, Token, Fingerprint,
//     CreatedAt and LeaseExpiresAt, Attempt 1, CompletedAt = UpdatedAt =
//     now, ExpiresAt = now + Retention.
//   - If a record for the key exists nonetheless (written by a claimer that
//     does not take the key's lock, such as an older idem during a rolling
//     upgrade), CompleteDeferred leaves it alone and returns [ErrFenced];
//     tx may then be aborted, and the Store rolls it back.
type DeferredClaimer[TTx any] interface {
	// ClaimDeferred claims p's key in tx without writing a record for a
	// free key (see the contract above).
	ClaimDeferred(ctx context.Context, tx TTx, p *ClaimParams) (*ClaimResult, error)
	// CompleteDeferred inserts the finished record of a deferred claim in tx.
	CompleteDeferred(ctx context.Context, tx TTx, p *CompleteDeferredParams) error
}

// DeferredTxPipeliner is implemented, optionally, by a [Dialect] that is both
// a [TxPipeliner] and a [DeferredClaimer] (package postgres): the pipelined
// forms of the deferred claim, which [Store.Do] prefers to the others.
type DeferredTxPipeliner[TTx any] interface {
	TxPipeliner[TTx]
	DeferredClaimer[TTx]
	// BeginClaimDeferred is TxPipeliner.BeginClaim with the semantics and
	// errors of ClaimDeferred in place of Claim's, [ErrSkipDefer] included
	// (the transaction it returns is then open and usable).
	BeginClaimDeferred(ctx context.Context, p *ClaimParams) (TTx, *ClaimResult, error)
	// CompleteDeferredCommit is TxPipeliner.CompleteCommit with
	// CompleteDeferred in place of Complete: when a record exists it
	// returns [ErrFenced] and commits nothing.
	CompleteDeferredCommit(ctx context.Context, tx TTx, p *CompleteDeferredParams) error
}

// OptimisticClaimer is implemented, optionally, by a [Dialect] whose
// [Store.Do] can claim a free key without writing or locking anything
// (package mysql, with its WithOptimisticDo option): the claim is a plain
// read, fn runs, and the completion inserts the finished record and
// commits, where the duplicate key of a concurrent claimer that got there
// first rolls everything back. It serves Do alone, whose fn may only write
// through its transaction and may already run more than once (Do retries
// a deadlock): two Do calls of one key may then both run fn, and the
// database's unique key lets exactly one of them commit. Where the dialect
// holds the key with a lock of its own instead ([DeferredClaimer]), that
// is preferred.
//
// Contract (the Executor's clauses on errors and Now apply too):
//   - BeginClaimOptimistic returns [ErrSkipDefer], having begun nothing,
//     when the dialect is not set up for optimistic claims; the Store then
//     claims as it would without the interface.
//   - Otherwise it begins a transaction, as Dialect.Begin does, and reads
//     the key's committed record in it with a snapshot taken no earlier than
//     the read, taking no lock and writing nothing. With an error the
//     transaction, when it was begun, is returned open for the Store to
//     roll back (as TxPipeliner.BeginClaim).
//   - When the key has no committed record it returns Created, with Record
//     the processing record the completion will insert (p's Token and
//     Fingerprint, Attempt 1, CreatedAt = now, LeaseExpiresAt = now +
//     LeaseDuration, ExpiresAt = now + Retention, as the dialect stores
//     them) and Now the read's clock. Another transaction may be writing
//     the key at that moment; nothing waits for it.
//   - When the key has a record it returns it with Created false, as
//     stored (expired records too), and Now the read's clock; the Store
//     goes on with Executor.Claim and the other Executor methods in the
//     transaction, as after TxPipeliner.BeginClaim.
//   - CompleteOptimisticCommit, after a Created BeginClaimOptimistic,
//     inserts the finished record (the fields of
//     [DeferredClaimer.CompleteDeferred]) and commits the transaction.
//     When the key's record exists, or is written by a transaction that
//     then commits, it commits nothing and returns [ErrFenced]; when that
//     transaction holds the key past p.WaitTimeout it commits nothing and
//     returns an *[InProgressError]. Either way the Store rolls back and,
//     after ErrFenced, runs Do's transaction again, which finds the record.
type OptimisticClaimer[TTx any] interface {
	// BeginClaimOptimistic begins a transaction and reads p's key in it
	// (see the contract above).
	BeginClaimOptimistic(ctx context.Context, p *ClaimParams) (TTx, *ClaimResult, error)
	// CompleteOptimisticCommit inserts the finished record of an
	// optimistic claim in tx and commits tx.
	CompleteOptimisticCommit(ctx context.Context, tx TTx, p *CompleteDeferredParams) error
}

// ErrSkipDefer is returned by a [DeferredClaimer]'s claim when the
// transaction cannot hold the key without writing its record, so that the
// Store claims with [Executor.Claim] instead, as if the dialect did not
// implement the interface (database/sql/driver's ErrSkip plays the same
// part). The Store never returns it.
var ErrSkipDefer = errors.New("idem: deferred claim unavailable in this transaction")

// Executor runs the store's statements against one connection pool or one
// transaction. Each method is one atomic step of the state machine; the
// [Store] owns validation and every decision, the Executor owns SQL, scanning
// and error translation.
//
// Contract, clause by clause:
//   - A missing row is reported as [ErrNotFound]; a fencing-token mismatch on
//     a write as [ErrFenced]; never as a native driver error.
//   - Connection failures, a closed pool and timeouts must match
//     [ErrStoreUnavailable]; serialization failures, deadlocks and lock wait
//     timeouts outside Claim's own wait must match [ErrRetryable]. The
//     driver's error stays reachable through %w wrapping, and so do
//     [context.Canceled] and [context.DeadlineExceeded].
//   - Params.Now nil means the database's clock; set, it replaces that clock
//     in every time written or compared by the statement.
//   - Methods never commit or roll back a caller's transaction.
type Executor interface {
	// Claim atomically inserts a processing record for (Scope, Key) unless a
	// record exists, then returns the record as it is now.
	//
	// If another transaction holds an uncommitted record for the key, Claim
	// must wait for it (up to WaitTimeout) and must never insert while that
	// transaction may still commit. If the holder rolls back, Claim inserts.
	// If the wait exceeds WaitTimeout, Claim returns an *[InProgressError]
	// (KeyDigest may be empty; the Store fills it in) with TxAborted set when
	// the database aborted the surrounding transaction.
	//
	// After a conflict, the record must be read so that it reflects the
	// holder's commit (a locking read where snapshots would hide it). If the
	// conflicting record vanished before it could be read, Claim returns
	// [ErrNotFound] and the Store tries again.
	//
	// Claim does not interpret what it found: expired records are returned
	// as they are.
	Claim(ctx context.Context, p *ClaimParams) (*ClaimResult, error)

	// Takeover replaces the record for (Scope, Key) with a new processing
	// record, but only while the record still carries Token and meets
	// Condition (evaluated against the record's newest committed version).
	// It returns [ErrFenced] when no such record exists. A wait for another
	// transaction holding the record is bounded by WaitTimeout, as in Claim.
	Takeover(ctx context.Context, p *TakeoverParams) error

	// Get returns the record for (Scope, Key) with a non-locking read. It
	// returns [ErrNotFound] when none exists or its ExpiresAt is not after now.
	Get(ctx context.Context, p *GetParams) (*Record, error)

	// Complete stores the response and final status on the record, only
	// while it is processing and carries Token; otherwise it returns
	// [ErrFenced] and changes nothing. ExpiresAt becomes now + Retention.
	Complete(ctx context.Context, p *CompleteParams) error

	// Release deletes the record, only while it is processing and carries
	// Token (and, with OnlyIfLeaseExpired, its lease has run out); otherwise
	// it returns [ErrFenced] and changes nothing.
	Release(ctx context.Context, p *ReleaseParams) error

	// RenewLease sets LeaseExpiresAt = now + Duration, the token to NewToken
	// (equal to Token for a plain renewal) and ExpiresAt to the later of
	// itself and the new LeaseExpiresAt (a processing record never passes
	// its retention deadline while its lease is live), only while the
	// record is processing and carries Token (and, with OnlyIfExpired, its
	// lease has run out); otherwise it returns [ErrFenced] and changes
	// nothing. It returns the new LeaseExpiresAt. A wait for another
	// transaction holding the record is bounded by WaitTimeout, as in Claim.
	RenewLease(ctx context.Context, p *RenewLeaseParams) (time.Time, error)

	// ListStaleLeases returns up to Limit processing records whose lease has
	// run out (LeaseExpiresAt <= now) and whose retention has not
	// (ExpiresAt > now), oldest lease first, with a non-locking read, and
	// the time it used as now.
	ListStaleLeases(ctx context.Context, p *ListStaleLeasesParams) ([]*Record, time.Time, error)

	// DeleteExpired deletes up to Limit records whose ExpiresAt <= now, in
	// one statement that uses the expires_at index and locks no more rows
	// than it deletes, and returns how many it deleted.
	DeleteExpired(ctx context.Context, p *DeleteExpiredParams) (int, error)
}

// ClaimParams are the arguments of [Executor.Claim].
type ClaimParams struct {
	// Scope, Key and Fingerprint are those of the new record.
	Scope       string
	Key         string
	Fingerprint Fingerprint
	// Token is the fencing token of the new record.
	Token int64
	// LeaseDuration sets LeaseExpiresAt = now + LeaseDuration on the new record.
	LeaseDuration time.Duration
	// Retention sets ExpiresAt = now + Retention on the new record.
	Retention time.Duration
	// WaitTimeout bounds the wait on an uncommitted holder of the key.
	WaitTimeout time.Duration
	// Now pins the clock; nil means the database's clock.
	Now *time.Time
}

// ClaimResult is the answer of [Executor.Claim].
type ClaimResult struct {
	// Record is the record as it is now: the new one when Created.
	Record *Record
	// Created is true when this call acquired the key: Claim inserted
	// Record; a deferred claim ([DeferredClaimer]) holds the key's lock and
	// Record is the record its completion will insert, not yet written.
	Created bool
	// Now is the database's time (or the pinned Now) at which Record was read.
	Now time.Time
}

// TakeoverParams are the arguments of [Executor.Takeover].
type TakeoverParams struct {
	// Scope and Key name the record.
	Scope string
	Key   string
	// Token is the token the record must still carry.
	Token int64
	// NewToken, Fingerprint and Attempt are written to the record, which
	// becomes processing with no response, CreatedAt = now,
	// LeaseExpiresAt = now + LeaseDuration and ExpiresAt = now + Retention.
	NewToken      int64
	Fingerprint   Fingerprint
	Attempt       int
	LeaseDuration time.Duration
	Retention     time.Duration
	// Condition says what else must hold for the takeover to happen.
	Condition TakeoverCondition
	// WaitTimeout bounds a wait on another transaction holding the record.
	WaitTimeout time.Duration
	Now         *time.Time
}

// TakeoverCondition is what, besides the token, a takeover requires of the
// record, so that a holder that just completed or renewed (which keeps its
// token) is never overwritten.
type TakeoverCondition int

// Takeover conditions.
const (
	// TakeoverRetentionExpired requires ExpiresAt <= now.
	TakeoverRetentionExpired TakeoverCondition = iota + 1
	// TakeoverLeaseExpired requires a processing record whose
	// LeaseExpiresAt <= now.
	TakeoverLeaseExpired
	// TakeoverReserved requires nothing more: the caller reserved the
	// record with a token of its own through RenewLease.
	TakeoverReserved
)

// GetParams are the arguments of [Executor.Get].
type GetParams struct {
	// Scope and Key name the record.
	Scope string
	Key   string
	// Now pins the clock; nil means the database's clock.
	Now *time.Time
}

// CompleteParams are the arguments of [Executor.Complete].
type CompleteParams struct {
	// Scope and Key name the record; Token is the one it must carry.
	Scope string
	Key   string
	Token int64
	// Status is StatusSucceeded or StatusFailed.
	Status Status
	// Response is stored (headers encoded with internal/codec).
	Response *Response
	// Retention sets ExpiresAt = now + Retention.
	Retention time.Duration
	// Now pins the clock; nil means the database's clock.
	Now *time.Time
}

// CompleteDeferredParams are the arguments of
// [DeferredClaimer.CompleteDeferred]: those of a completion, and the values
// of the claim that a plain completion finds in the record.
type CompleteDeferredParams struct {
	CompleteParams
	// Fingerprint, CreatedAt and LeaseExpiresAt are those of the deferred
	// claim's Record.
	Fingerprint    Fingerprint
	CreatedAt      time.Time
	LeaseExpiresAt time.Time
	// WaitTimeout bounds a wait for another transaction that writes the
	// same key ([OptimisticClaimer.CompleteOptimisticCommit]; a deferred
	// claim's lock leaves nothing to wait for).
	WaitTimeout time.Duration
}

// ReleaseParams are the arguments of [Executor.Release].
type ReleaseParams struct {
	// Scope and Key name the record; Token is the one it must carry.
	Scope string
	Key   string
	Token int64
	// OnlyIfLeaseExpired also requires LeaseExpiresAt <= now.
	OnlyIfLeaseExpired bool
	// Now pins the clock; nil means the database's clock.
	Now *time.Time
}

// RenewLeaseParams are the arguments of [Executor.RenewLease].
type RenewLeaseParams struct {
	// Scope and Key name the record.
	Scope string
	Key   string
	// Token is the token the record must still carry.
	Token int64
	// NewToken replaces it; equal to Token for a plain renewal.
	NewToken int64
	// Duration sets LeaseExpiresAt = now + Duration.
	Duration time.Duration
	// OnlyIfExpired also requires LeaseExpiresAt <= now: the caller is
	// reserving a stale record, not renewing its own lease.
	OnlyIfExpired bool
	// WaitTimeout bounds a wait on another transaction holding the record.
	WaitTimeout time.Duration
	Now         *time.Time
}

// ListStaleLeasesParams are the arguments of [Executor.ListStaleLeases].
type ListStaleLeasesParams struct {
	// Limit is the most records returned; at least 1.
	Limit int
	// Now pins the clock; nil means the database's clock.
	Now *time.Time
}

// DeleteExpiredParams are the arguments of [Executor.DeleteExpired].
type DeleteExpiredParams struct {
	// Limit is the most records deleted; at least 1.
	Limit int
	// Now pins the clock; nil means the database's clock.
	Now *time.Time
}
