package idem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/idemstore/idem/internal/digest"
)

// Store claims idempotency keys and stores their responses in the
// idempotency_keys table of one database. TTx is the caller's transaction
// type (pgx.Tx or *sql.Tx), fixed by the dialect.
//
// Every operation comes in two forms: Op runs on the pool, OpTx inside the
// caller's transaction tx. idem never commits or rolls back a caller's tx.
//
// A Store is safe for concurrent use by multiple goroutines, and any number of
// Stores in any number of processes may share one table: exactly one claimer
// per (scope, key) acquires it.
type Store[TTx any] struct {
	dialect Dialect[TTx]
	cfg     Config
	// replays decides, with Config.ReplayRead, whether Do reads first (replay.go).
	replays replayGate
	// cache holds completed responses when Config.ReplayCache is set; nil
	// (every method a no-op) otherwise.
	cache *replayCache
}

// New returns a Store over dialect, such as postgres.New(pool). It performs
// no I/O: the schema must already be migrated (see package migrations).
func New[TTx any](dialect Dialect[TTx], cfg *Config) (*Store[TTx], error) {
	if dialect == nil {
		return nil, errors.New("idem: New needs a dialect")
	}
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	s := &Store[TTx]{dialect: dialect, cfg: c}
	if c.ReplayCache != nil {
		s.cache = newReplayCache(c.ReplayCache)
	}
	return s, nil
}

// Dialect returns the store's dialect, whose Begin, Commit and Rollback
// manage transactions of the store's type: for code that, like [Store.Do],
// runs a business transaction around idem's Tx methods without knowing
// which database it is on (the idemhttp middleware).
func (s *Store[TTx]) Dialect() Dialect[TTx] { return s.dialect }

// Complete stores resp as the successful result of the acquired claim c, in
// an autocommitted statement on the pool; from then on every retry with the
// same fingerprint replays it. Use it after [Store.Claim].
//
// It returns [ErrFenced] and changes nothing when c does not own the key any
// more (completed already, released, taken over) or never did (a replay),
// and [ErrInvalidResponse], before any statement, when resp fails
// [Response.Validate] or the Config's size limits.
func (s *Store[TTx]) Complete(ctx context.Context, c *Claim, resp *Response) error {
	return s.complete(ctx, s.dialect.DB(), nil, c, StatusSucceeded, resp)
}

// CompleteTx stores resp as the successful result of the acquired claim c
// inside the caller's transaction tx, with the errors of [Store.Complete].
// idem never commits or rolls back tx; the response becomes visible, and
// durable, when the caller commits, together with the business rows.
func (s *Store[TTx]) CompleteTx(ctx context.Context, tx TTx, c *Claim, resp *Response) error {
	return s.completeTx(ctx, tx, c, StatusSucceeded, resp)
}

// Fail stores resp as the final, failed result of c: for failures that
// already had side effects and must not run again. It is replayed exactly
// like a success. Errors are those of [Store.Complete]. For failures that are
// safe to retry, use [Store.Release] (or roll back the claiming transaction).
func (s *Store[TTx]) Fail(ctx context.Context, c *Claim, resp *Response) error {
	return s.complete(ctx, s.dialect.DB(), nil, c, StatusFailed, resp)
}

// FailTx is [Store.Fail] inside the caller's transaction tx. idem never
// commits or rolls back tx.
func (s *Store[TTx]) FailTx(ctx context.Context, tx TTx, c *Claim, resp *Response) error {
	return s.completeTx(ctx, tx, c, StatusFailed, resp)
}

// complete stores resp as c's result with exec's Complete: on the pool (tx
// nil), or in transaction tx, whose claim wrote its record; tx is where a
// body store that takes transactions writes the body (see storeBody).
func (s *Store[TTx]) complete(ctx context.Context, exec Executor, tx *TTx, c *Claim, status Status, resp *Response) error {
	return s.completeVia(ctx, tx, c, status, resp, "complete", exec.Complete)
}

// completeTx stores resp as c's result inside tx: with the dialect's
// CompleteDeferred after a deferred claim, which wrote no record to update.
func (s *Store[TTx]) completeTx(ctx context.Context, tx TTx, c *Claim, status Status, resp *Response) error {
	if dc, ok := s.dialect.(DeferredClaimer[TTx]); ok && c != nil && c.deferred {
		err := s.completeVia(ctx, &tx, c, status, resp, "complete", func(ctx context.Context, p *CompleteParams) error {
			return deferredConflict(dc.CompleteDeferred(ctx, tx, s.deferredParams(c, p)))
		})
		if err == nil {
			// The record exists now: a later completion or release of c
			// finds it completed, as after Complete.
			c.deferred = false
		}
		return err
	}
	return s.complete(ctx, s.dialect.Tx(tx), &tx, c, status, resp)
}

// completeVia checks what a completion of c was given, builds its
// parameters, and stores them with send, which runs the completion's
// statement (and, pipelined, the commit); what names the step in errors.
func (s *Store[TTx]) completeVia(ctx context.Context, tx *TTx, c *Claim, status Status, resp *Response, what string,
	send func(ctx context.Context, p *CompleteParams) error,
) error {
	p, err := s.completeParams(ctx, tx, c, status, resp)
	if err != nil {
		return err
	}
	start := s.observeStart()
	err = send(ctx, p)
	if s.cfg.Observer != nil {
		s.observeComplete(ctx, start, c, status, resp, err)
	}
	if err != nil {
		return fmt.Errorf("idem: %s key %s: %w", what, digest.Key(c.Scope, c.Key), err)
	}
	s.logKey(ctx, c.Scope, c.Key, completedOutcome(status))
	return nil
}

// completeParams checks what a completion was given and builds the
// parameters it sends.
func (s *Store[TTx]) completeParams(ctx context.Context, tx *TTx, c *Claim, status Status, resp *Response) (*CompleteParams, error) {
	if err := validateClaim(c); err != nil {
		return nil, err
	}
	if err := s.validateResponse(resp); err != nil {
		return nil, fmt.Errorf("idem: complete key %s: %w", digest.Key(c.Scope, c.Key), err)
	}
	resp, err := s.storeBody(ctx, tx, c.Scope, c.Key, c.Token, resp)
	if err != nil {
		return nil, err
	}
	return &CompleteParams{
		Scope:     c.Scope,
		Key:       c.Key,
		Token:     c.Token,
		Status:    status,
		Response:  resp,
		Retention: s.cfg.Retention,
		Now:       s.now(),
	}, nil
}

// deferredParams are the parameters of the completion p of the deferred
// claim c.
func (s *Store[TTx]) deferredParams(c *Claim, p *CompleteParams) *CompleteDeferredParams {
	return &CompleteDeferredParams{
		CompleteParams: *p, Fingerprint: c.fingerprint, CreatedAt: c.createdAt, LeaseExpiresAt: c.LeaseExpiresAt,
		WaitTimeout: s.cfg.WaitTimeout,
	}
}

// deferredConflict marks ErrFenced from the completion of a deferred claim
// as retryable: a record appeared under the key although its lock was held,
// written by a claimer that does not take the lock (an older idem during a
// rolling upgrade). The transaction is rolled back; Do's next try finds the
// record and answers from it.
func deferredConflict(err error) error {
	if errors.Is(err, ErrFenced) {
		return fmt.Errorf("%w (a record for the key was written without its lock): %w", err, ErrRetryable)
	}
	return err
}

// optimisticConflict marks ErrFenced from the completion of an optimistic
// claim as retryable: a concurrent claimer of the key committed first. The
// transaction is rolled back, fn's writes with it; Do's next try finds the
// record and answers from it.
func optimisticConflict(err error) error {
	if errors.Is(err, ErrFenced) {
		return fmt.Errorf("%w (a concurrent claimer completed the key first): %w", err, ErrRetryable)
	}
	return err
}

// Release gives up the acquired claim c after a failure that is safe to
// retry: the record is deleted, so the next claimer acquires at once. It
// returns [ErrFenced] and changes nothing when c does not own the key.
func (s *Store[TTx]) Release(ctx context.Context, c *Claim) error {
	return s.release(ctx, s.dialect.DB(), c)
}

// ReleaseTx is [Store.Release] inside the caller's transaction tx. idem never
// commits or rolls back tx. After a deferred claim (PostgreSQL, SQLite; see
// [Store.ClaimTx]) there is no record to delete: the key's lock keeps other
// claimers waiting until tx ends, as the deleted record's lock would, and
// a commit leaves the key free.
func (s *Store[TTx]) ReleaseTx(ctx context.Context, tx TTx, c *Claim) error {
	if c == nil || !c.deferred {
		return s.release(ctx, s.dialect.Tx(tx), c)
	}
	if err := validateClaim(c); err != nil {
		return err
	}
	c.deferred = false // released: a later completion or release of c is fenced, as after Release
	s.logOutcome(ctx, digest.Key(c.Scope, c.Key), "released")
	return nil
}

func (s *Store[TTx]) release(ctx context.Context, exec Executor, c *Claim) error {
	if err := validateClaim(c); err != nil {
		return err
	}
	kd := digest.Key(c.Scope, c.Key)
	if err := exec.Release(ctx, &ReleaseParams{Scope: c.Scope, Key: c.Key, Token: c.Token}); err != nil {
		return fmt.Errorf("idem: release key %s: %w", kd, err)
	}
	s.logOutcome(ctx, kd, "released")
	return nil
}

// Get returns the live record for key in scope, reading on the pool without
// taking locks. It returns [ErrNotFound] when there is none or it is past its
// retention deadline; an uncommitted claim of another transaction is not seen.
// A completed record that cannot be answered from is [ErrCorruptRecord], as
// on every path that replays one.
func (s *Store[TTx]) Get(ctx context.Context, scope, key string) (*Record, error) {
	return s.get(ctx, s.dialect.DB(), scope, key)
}

// GetTx is [Store.Get] inside the caller's transaction tx, which sees what
// tx wrote: on MySQL the record of its own uncommitted claim; on PostgreSQL
// and SQLite, whose claims in a transaction are deferred and write no record
// until the completion (see [Store.ClaimTx]), the completed record once
// CompleteTx ran, and ErrNotFound before. idem never commits or rolls back
// tx.
func (s *Store[TTx]) GetTx(ctx context.Context, tx TTx, scope, key string) (*Record, error) {
	return s.get(ctx, s.dialect.Tx(tx), scope, key)
}

func (s *Store[TTx]) get(ctx context.Context, exec Executor, scope, key string) (*Record, error) {
	if err := validate(scope, key); err != nil {
		return nil, err
	}
	rec, err := exec.Get(ctx, &GetParams{Scope: scope, Key: key, Now: s.now()})
	if !errors.Is(err, ErrNotFound) {
		err = s.checkRead(ctx, rec, err, digest.Key(scope, key))
	}
	if err != nil {
		return nil, fmt.Errorf("idem: get key %s: %w", digest.Key(scope, key), err)
	}
	return rec, nil
}

func (s *Store[TTx]) now() *time.Time {
	if s.cfg.Now == nil {
		return nil
	}
	t := s.cfg.Now().UTC()
	return &t
}

// debug reports whether the logger takes debug records, so that the hot
// paths skip building them (a digest, a string) when it does not.
func (s *Store[TTx]) debug(ctx context.Context) bool {
	return s.cfg.Logger.Enabled(ctx, slog.LevelDebug)
}

// completedOutcome names a completion's outcome in logs, without building a
// string on the hot path.
func completedOutcome(status Status) string {
	if status == StatusFailed {
		return "completed_failed"
	}
	return "completed_succeeded"
}

// logKey is logOutcome for the hot paths: the digest is computed only when
// the record is logged.
func (s *Store[TTx]) logKey(ctx context.Context, scope, key, outcome string) {
	if s.debug(ctx) {
		s.logOutcome(ctx, digest.Key(scope, key), outcome)
	}
}

func (s *Store[TTx]) logOutcome(ctx context.Context, keyDigest, outcome string) {
	if !s.debug(ctx) {
		return
	}
	s.cfg.Logger.LogAttrs(ctx, slog.LevelDebug, "idem: "+outcome,
		slog.String("dialect", s.dialect.Name()), slog.String("key", keyDigest))
}

// newToken proposes a fencing token for a new holder. Wall-clock
// microseconds keep tokens increasing across a key's deletion and re-creation;
// takeovers also enforce old+1, so a token never repeats for a live record.
func newToken() int64 { return time.Now().UnixMicro() }

func validate(scope, key string) error {
	if !validText(scope, MaxScopeLength) {
		return ErrInvalidScope
	}
	if !validText(key, MaxKeyLength) {
		return ErrInvalidKey
	}
	return nil
}

func validateClaim(c *Claim) error {
	if c == nil {
		return fmt.Errorf("idem: nil claim: %w", ErrFenced)
	}
	if err := validate(c.Scope, c.Key); err != nil {
		return err
	}
	if c.Replay != nil {
		return fmt.Errorf("idem: key %s was replayed, not acquired: %w", digest.Key(c.Scope, c.Key), ErrFenced)
	}
	return nil
}

func validText(s string, maxLen int) bool {
	if s == "" || len(s) > maxLen || !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if unicode.IsControl(r) {
			return false
		}
	}
	return true
}

func backoff(try int) time.Duration {
	base := 5 * time.Millisecond << min(try, 6)
	return base/2 + rand.N(base) //nolint:gosec // not security-sensitive: backoff only spreads retries
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
