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

// Limits on keys and scopes, in bytes. They match the width of the key
// columns on every dialect.
const (
	MaxKeyLength   = 255
	MaxScopeLength = 255
)

// Config configures a [Store]. A nil *Config, and every zero field, means the
// default.
type Config struct {
	// LeaseDuration is how long a processing record is presumed alive after
	// it was claimed. A committed processing record whose lease has not run
	// out answers other claimers with an *InProgressError whose RetryAfter
	// is the time left. Defaults to 30s.
	LeaseDuration time.Duration

	// Retention is how long a record is kept: a claim sets the deadline to
	// claim time + Retention, a completion to completion time + Retention.
	// Past the deadline the key is treated as absent and claimed anew, with
	// whatever fingerprint the new request brings. Choose it to cover the
	// clients' retry window. Defaults to 24h.
	Retention time.Duration

	// WaitTimeout bounds how long a claim (and a takeover or lease renewal)
	// waits for another transaction that holds the same record. If the
	// holder commits in time, the claimer sees its record (replay or
	// mismatch); if it rolls back, the claimer acquires; otherwise the
	// claimer gets an *InProgressError. On MySQL the wait is rounded up to
	// whole seconds. On SQLite, where one transaction writes at a time, it
	// bounds the pool-level statements (a timeout there is
	// [ErrStoreUnavailable]: SQLite cannot tell which key the other writer
	// holds); a caller's transaction waits for the database lock when it
	// begins, bounded by the connection's busy timeout. Defaults to 5s.
	WaitTimeout time.Duration

	// MaxTxRetries is how many times [Store.Do] runs its transaction again,
	// and [Store.Claim] its statement, after an error matching [ErrRetryable]
	// (a deadlock or serialization failure). Defaults to 3; a negative value
	// disables retries.
	MaxTxRetries int

	// Logger receives debug records of claim outcomes and warnings. Keys and
	// scopes appear only as short digests. Defaults to discarding everything.
	Logger *slog.Logger

	// Now pins the clock used for leases and retention, for tests. Defaults
	// to nil, which uses the database's clock, the one clock all instances
	// share.
	Now func() time.Time

	// StatusCheck asks the application whether the business effect of a
	// processing record whose lease ran out actually committed (a crashed
	// holder). A claim that meets such a record, and the [Reaper], call it
	// and act on the [Verdict]: committed finalises the record with the
	// verdict's response, which is replayed; not committed hands the key to
	// the next claimer; unknown (also any error or panic of the check) keeps
	// the record processing and pushes its lease out. Only one caller at a
	// time runs the check for a record: it first takes the record over with
	// a new fencing token, which also fences the old holder out.
	//
	// Defaults to nil: an expired lease then stays in progress until its
	// retention deadline, unless BlindTakeover is set.
	StatusCheck StatusCheck

	// StatusCheckTimeout bounds one call of StatusCheck; a check that runs
	// out counts as unknown. Defaults to 10s.
	StatusCheckTimeout time.Duration

	// MaxResponseBytes bounds the body of a stored response; a larger one
	// is refused with [ErrInvalidResponse] and nothing is stored. Keep it
	// below what the database accepts in one statement (MySQL's
	// max_allowed_packet). idemhttp's own Config.MaxResponseBytes must not
	// exceed it. Defaults to 8 MiB ([DefaultMaxResponseBytes]).
	MaxResponseBytes int

	// MaxResponseHeaderBytes bounds the headers of a stored response,
	// counted as header lines ("Name: value\r\n"); larger ones are refused
	// with [ErrInvalidResponse]. Defaults to 64 KiB
	// ([DefaultMaxResponseHeaderBytes]).
	MaxResponseHeaderBytes int

	// LogCallbackErrors adds the text of errors returned by the
	// application's callbacks (a StatusCheck, a [Store.Do] callback) to
	// the Logger's records. Such text may carry keys, tenants or business
	// data (an error such as fmt.Errorf("lookup %s", key)), so by default
	// only the error's class is logged, with the key's digest. Defaults to
	// false.
	LogCallbackErrors bool

	// BlindTakeover hands a key whose lease ran out to the next claimer
	// without asking anyone. Only safe when the business effect is itself
	// idempotent or cannot have happened without the record completing
	// (claims inside the business transaction): with an outside side effect
	// such as a payment, a holder that crashed after the charge but before
	// completing gets charged twice. Must not be combined with StatusCheck.
	// Defaults to false.
	BlindTakeover bool

	// BodyStore, when set, keeps response bodies larger than InlineBodyMax
	// out of the record: the body is written there before the record
	// commits, and the record holds its address, length and SHA-256 (see
	// [BodyStore], [Store.OpenBody]). Replays of such records carry
	// Response.BodyRef and an empty Body. Defaults to nil: every body is
	// stored inline.
	BodyStore BodyStore

	// InlineBodyMax is the largest body stored in the record when a
	// BodyStore is set. Defaults to 64 KiB ([DefaultInlineBodyMax]), or
	// MaxResponseBytes if that is smaller.
	InlineBodyMax int

	// Observer receives claim, completion, lease, status-check and reaper
	// events, for metrics and traces (see contrib/idemotel). Defaults to
	// nil: nothing is reported, at no cost.
	Observer *Observer
}

const (
	defaultLeaseDuration = 30 * time.Second
	defaultRetention     = 24 * time.Hour
	defaultWaitTimeout   = 5 * time.Second
	defaultMaxTxRetries  = 3
	defaultCheckTimeout  = 10 * time.Second

	// maxClaimRounds bounds how often a claim starts over when the record
	// it found changed under it (deleted by the reaper, taken over by a
	// concurrent claimer). Each round is caused by another writer's progress.
	maxClaimRounds = 5
)

func (c *Config) withDefaults() Config {
	var out Config
	if c != nil {
		out = *c
	}
	if out.LeaseDuration == 0 {
		out.LeaseDuration = defaultLeaseDuration
	}
	if out.Retention == 0 {
		out.Retention = defaultRetention
	}
	if out.WaitTimeout == 0 {
		out.WaitTimeout = defaultWaitTimeout
	}
	if out.MaxTxRetries == 0 {
		out.MaxTxRetries = defaultMaxTxRetries
	} else if out.MaxTxRetries < 0 {
		out.MaxTxRetries = 0
	}
	if out.StatusCheckTimeout == 0 {
		out.StatusCheckTimeout = defaultCheckTimeout
	}
	if out.Logger == nil {
		out.Logger = slog.New(slog.DiscardHandler)
	}
	if out.MaxResponseBytes == 0 {
		out.MaxResponseBytes = DefaultMaxResponseBytes
	}
	if out.MaxResponseHeaderBytes == 0 {
		out.MaxResponseHeaderBytes = DefaultMaxResponseHeaderBytes
	}
	if out.InlineBodyMax == 0 {
		out.InlineBodyMax = min(DefaultInlineBodyMax, out.MaxResponseBytes)
	}
	return out
}

func (c *Config) validate() error {
	switch {
	case c.LeaseDuration < 0:
		return errors.New("idem: Config.LeaseDuration must not be negative")
	case c.Retention < 0:
		return errors.New("idem: Config.Retention must not be negative")
	case c.WaitTimeout < 0:
		return errors.New("idem: Config.WaitTimeout must not be negative")
	case c.Retention < c.LeaseDuration:
		return errors.New("idem: Config.Retention must not be shorter than Config.LeaseDuration")
	case c.StatusCheckTimeout < 0:
		return errors.New("idem: Config.StatusCheckTimeout must not be negative")
	case c.MaxResponseBytes < 0:
		return errors.New("idem: Config.MaxResponseBytes must not be negative")
	case c.MaxResponseHeaderBytes < 0:
		return errors.New("idem: Config.MaxResponseHeaderBytes must not be negative")
	case c.InlineBodyMax < 0 || c.InlineBodyMax > c.MaxResponseBytes:
		return errors.New("idem: Config.InlineBodyMax must be between 0 and Config.MaxResponseBytes")
	case c.StatusCheck != nil && c.BlindTakeover:
		return errors.New("idem: Config.BlindTakeover and Config.StatusCheck exclude each other")
	}
	return nil
}

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
	return &Store[TTx]{dialect: dialect, cfg: c}, nil
}

// Dialect returns the store's dialect, whose Begin, Commit and Rollback
// manage transactions of the store's type: for code that, like [Store.Do],
// runs a business transaction around idem's Tx methods without knowing
// which database it is on (the idemhttp middleware).
func (s *Store[TTx]) Dialect() Dialect[TTx] { return s.dialect }

// Claim is the result of claiming a key: either the caller now owns the key
// (Acquired) and must run the business effect and complete the claim, or the
// key was already completed and Replay holds the stored record.
type Claim struct {
	// Scope and Key name the record.
	Scope string
	Key   string
	// Token is the fencing token of this holder; completion is accepted
	// only while the record still carries it.
	Token int64
	// Attempt counts holders of this key.
	Attempt int
	// LeaseExpiresAt is when other claimers may presume this holder gone;
	// for a takeover it is estimated (early) from the database clock.
	LeaseExpiresAt time.Time
	// Replay is the completed record when the key was used before with the
	// same fingerprint. The caller must answer with Replay.Response and must
	// not run the business effect again.
	Replay *Record

	// deferred is set by Do's deferred claims: no record exists yet, and
	// the completion inserts it with fingerprint and createdAt.
	deferred    bool
	fingerprint Fingerprint
	createdAt   time.Time
}

// Acquired reports whether the caller owns the key and must run the
// business effect.
func (c *Claim) Acquired() bool { return c != nil && c.Replay == nil }

// Result is what [Store.Do] answers.
type Result struct {
	// Response is the callback's response, or the stored one on a replay.
	Response *Response
	// Replayed is true when Response was stored by an earlier request and
	// the callback did not run.
	Replayed bool
	// Status is the stored record's status: StatusSucceeded, or
	// StatusFailed for a failure stored as final (see [FinalFailure]).
	Status Status
}

// FinalFailureError carries a response that [Store.Do] stores as a final
// failure; build it with [FinalFailure].
type FinalFailureError struct {
	Response *Response
}

// Error implements error.
func (e *FinalFailureError) Error() string {
	if e.Response == nil {
		return "idem: final failure without a response"
	}
	return fmt.Sprintf("idem: final failure with status %d", e.Response.StatusCode)
}

// FinalFailure returns an error that tells [Store.Do] to store resp as a
// final failure and commit the transaction, instead of rolling it back: for a
// failure whose effects must stand (a declined payment recorded in the same
// transaction), so that retries replay resp instead of running again. Do then
// returns a nil error and a Result with Status StatusFailed.
func FinalFailure(resp *Response) error { return &FinalFailureError{Response: resp} }

// Claim claims key in scope for the request identified by fp on the pool,
// committing the processing record at once: it is visible to every other
// claimer before Claim returns. Use it when the business effect is not in the
// same database; otherwise prefer [Store.ClaimTx] or [Store.Do], which commit
// the claim with the business rows.
//
// Outcomes:
//   - the key is new, or past its retention deadline: the caller acquires it;
//   - the key was completed with the same fingerprint: a Claim with Replay set;
//   - the key was used with another fingerprint: [ErrFingerprint];
//   - another holder owns it: [ErrInProgress] (as *[InProgressError]).
//
// It returns [ErrInvalidKey] or [ErrInvalidScope] for bad input (nothing is
// written) and [ErrStoreUnavailable] when the database cannot be reached. A
// deadlock is retried up to Config.MaxTxRetries times before [ErrRetryable]
// is returned.
func (s *Store[TTx]) Claim(ctx context.Context, scope, key string, fp Fingerprint) (c *Claim, err error) {
	if s.cfg.Observer != nil {
		start := time.Now()
		defer func() { s.observeClaim(ctx, start, scope, key, c, err) }()
	}
	if err := validate(scope, key); err != nil {
		return nil, err
	}
	if c, done, err := s.replayFast(ctx, scope, key, fp); done {
		return c, err
	}
	// On the pool each statement commits on its own, so a deadlock victim
	// (possible on MySQL when claimers of one key pile up) lost nothing but
	// that statement: trying again is safe, unlike inside a caller's tx.
	for try := 0; ; try++ {
		c, err := s.claim(ctx, s.dialect.DB(), false, scope, key, fp)
		if err == nil || !errors.Is(err, ErrRetryable) || try >= s.cfg.MaxTxRetries || ctx.Err() != nil {
			return c, err
		}
		if err := sleepCtx(ctx, backoff(try)); err != nil {
			return nil, err
		}
	}
}

// replayFast answers a pool-level claim of a completed key with one plain
// read by primary key on the pool: no transaction, no lock, no write. It is
// correct because a completed record never changes until its retention
// deadline, which the read checks with the database's clock (Executor.Get
// returns only live records): the replay or mismatch it reports is exactly
// what the claim would have decided at the moment of the read. done is false
// when the key is absent, processing or past retention; the caller then
// claims as usual (a new key pays this one extra primary-key read).
//
// Only the pool path uses it. Inside a caller's transaction the claim must
// take the dialect's locks (MySQL's shared lock keeps a completed record
// from being taken over until the transaction ends), and Do, which claims in
// its own transaction, would pay the extra read on every new key for no
// saving on its replays' round trips (on PostgreSQL the claim travels with
// BEGIN).
func (s *Store[TTx]) replayFast(ctx context.Context, scope, key string, fp Fingerprint) (_ *Claim, done bool, _ error) {
	rec, err := s.dialect.DB().Get(ctx, &GetParams{Scope: scope, Key: key, Now: s.now()})
	switch {
	case errors.Is(err, ErrNotFound):
		return nil, false, nil
	case err != nil:
		kd := digest.Key(scope, key)
		return nil, true, fmt.Errorf("idem: claim key %s: %w", kd, s.checkRead(ctx, nil, err, kd))
	case !rec.Status.Final():
		return nil, false, nil
	case !rec.Fingerprint.Equal(fp):
		kd := digest.Key(scope, key)
		s.logOutcome(ctx, kd, "fingerprint_mismatch")
		return nil, true, fmt.Errorf("%w (key %s)", ErrFingerprint, kd)
	}
	if err := s.checkRead(ctx, rec, nil, digest.Key(scope, key)); err != nil {
		return nil, true, fmt.Errorf("idem: claim key %s: %w", digest.Key(scope, key), err)
	}
	s.logKey(ctx, scope, key, "replay")
	return &Claim{Scope: scope, Key: key, Token: rec.Token, Attempt: rec.Attempt, Replay: rec}, true, nil
}

// ClaimTx claims key in scope inside the caller's transaction tx, with the
// outcomes and errors of [Store.Claim]. idem never commits or rolls back tx;
// the claim becomes visible, and durable, when the caller commits. Until then
// other claimers of the key wait (up to Config.WaitTimeout; on SQLite they
// wait to begin their transactions), and if tx rolls back the key is free
// again. On MySQL the claim holds a lock on the record until tx ends, even
// when it did not acquire: end tx promptly after a replay or an error.
//
// After an acquired ClaimTx, run the business writes on tx, then
// [Store.CompleteTx] on tx, then commit: the stored response and the business
// rows commit together, or neither does. Pass the errors of your own
// statements and of the commit through [Store.Classify] to learn whether
// running the whole transaction again may succeed ([ErrRetryable]; on
// MariaDB Galera a certification failure can end any statement or COMMIT).
//
// After any error, roll tx back unless the error is an *[InProgressError]
// with TxAborted false or [ErrFingerprint]; on PostgreSQL every database
// error aborts the transaction.
func (s *Store[TTx]) ClaimTx(ctx context.Context, tx TTx, scope, key string, fp Fingerprint) (c *Claim, err error) {
	if s.cfg.Observer != nil {
		start := time.Now()
		defer func() { s.observeClaim(ctx, start, scope, key, c, err) }()
	}
	return s.claim(ctx, s.dialect.Tx(tx), true, scope, key, fp)
}

// claim runs the decision table on exec; inTx tells that exec is a caller's
// transaction, where a stale lease's status check must not run.
func (s *Store[TTx]) claim(ctx context.Context, exec Executor, inTx bool, scope, key string, fp Fingerprint) (*Claim, error) {
	return s.claimFrom(ctx, exec, inTx, scope, key, fp, nil, false)
}

// claimFrom is claim whose first Claim, when first is not nil, is made by
// first instead of exec.Claim: first returns the claim's result and the
// Executor every later statement runs on (a pipelined BeginClaim returns
// the transaction it began). exec may then be nil. Every result goes
// through the same decision table. deferred asks for a deferred claim
// (ClaimParams.Defer): only Do, whose callback never sees the record, asks.
func (s *Store[TTx]) claimFrom(ctx context.Context, exec Executor, inTx bool, scope, key string, fp Fingerprint,
	first func(p *ClaimParams) (Executor, *ClaimResult, error), deferred bool,
) (*Claim, error) {
	if err := validate(scope, key); err != nil {
		return nil, err
	}
	// The key's digest, for errors and logs only: computed when first needed.
	var digested string
	kd := func() string {
		if digested == "" {
			digested = digest.Key(scope, key)
		}
		return digested
	}
	for round := range maxClaimRounds {
		token := newToken()
		p := &ClaimParams{
			Scope:         scope,
			Key:           key,
			Fingerprint:   fp,
			Token:         token,
			LeaseDuration: s.cfg.LeaseDuration,
			Retention:     s.cfg.Retention,
			WaitTimeout:   s.cfg.WaitTimeout,
			Now:           s.now(),
			Defer:         deferred,
		}
		var (
			res *ClaimResult
			err error
		)
		if round == 0 && first != nil {
			exec, res, err = first(p)
		} else {
			res, err = exec.Claim(ctx, p)
		}
		if errors.Is(err, ErrNotFound) {
			continue // the conflicting record vanished before we read it
		}
		if err != nil {
			var inProgress *InProgressError
			if errors.As(err, &inProgress) {
				out := *inProgress
				out.KeyDigest = kd()
				s.logOutcome(ctx, kd(), "in_progress_uncommitted")
				return nil, &out
			}
			return nil, fmt.Errorf("idem: claim key %s: %w", kd(), s.checkRead(ctx, nil, err, kd()))
		}
		rec := res.Record
		if res.Created {
			s.logKey(ctx, scope, key, "acquired")
			c := &Claim{Scope: scope, Key: key, Token: rec.Token, Attempt: rec.Attempt, LeaseExpiresAt: rec.LeaseExpiresAt}
			if res.Deferred {
				c.deferred, c.fingerprint, c.createdAt = true, fp, rec.CreatedAt
			}
			return c, nil
		}
		if !rec.ExpiresAt.After(res.Now) {
			// Past retention the old intent is forgotten: claim the key
			// anew, fenced by the old token so only one claimer wins.
			newTok := max(token, rec.Token+1)
			err := exec.Takeover(ctx, &TakeoverParams{
				Scope:         scope,
				Key:           key,
				Token:         rec.Token,
				NewToken:      newTok,
				Fingerprint:   fp,
				Attempt:       1,
				LeaseDuration: s.cfg.LeaseDuration,
				Retention:     s.cfg.Retention,
				Condition:     TakeoverRetentionExpired,
				WaitTimeout:   s.cfg.WaitTimeout,
				Now:           s.now(),
			})
			if errors.Is(err, ErrFenced) {
				continue // another claimer took it over, or the holder completed, first
			}
			if inProgress, ok := errors.AsType[*InProgressError](err); ok {
				out := *inProgress
				out.KeyDigest = kd()
				return nil, &out
			}
			if err != nil {
				return nil, fmt.Errorf("idem: claim expired key %s: %w", kd(), err)
			}
			s.logOutcome(ctx, kd(), "acquired_expired")
			return &Claim{Scope: scope, Key: key, Token: newTok, Attempt: 1, LeaseExpiresAt: res.Now.Add(s.cfg.LeaseDuration)}, nil
		}
		if !rec.Fingerprint.Equal(fp) {
			s.logOutcome(ctx, kd(), "fingerprint_mismatch")
			return nil, fmt.Errorf("%w (key %s)", ErrFingerprint, kd())
		}
		if rec.Status.Final() {
			if err := s.checkRead(ctx, rec, nil, kd()); err != nil {
				return nil, fmt.Errorf("idem: claim key %s: %w", kd(), err)
			}
			s.logKey(ctx, scope, key, "replay")
			return &Claim{Scope: scope, Key: key, Token: rec.Token, Attempt: rec.Attempt, Replay: rec}, nil
		}
		if rec.LeaseExpiresAt.After(res.Now) {
			s.logOutcome(ctx, kd(), "in_progress")
			return nil, &InProgressError{KeyDigest: kd(), RetryAfter: rec.LeaseExpiresAt.Sub(res.Now)}
		}
		c, err := s.claimStale(ctx, exec, inTx, rec, res.Now, kd())
		if errors.Is(err, ErrFenced) {
			continue // another claimer, a reaper or a renewal got to the record first
		}
		if inProgress, ok := errors.AsType[*InProgressError](err); ok && inProgress.KeyDigest == "" {
			out := *inProgress
			out.KeyDigest = kd()
			return nil, &out
		}
		return c, err
	}
	return nil, fmt.Errorf("idem: claim key %s: the record kept changing under concurrent writers: %w", kd(), ErrRetryable)
}

// Complete stores resp as the successful result of the acquired claim c, in
// an autocommitted statement on the pool; from then on every retry with the
// same fingerprint replays it. Use it after [Store.Claim].
//
// It returns [ErrFenced] and changes nothing when c does not own the key any
// more (completed already, released, taken over) or never did (a replay),
// and [ErrInvalidResponse], before any statement, when resp fails
// [Response.Validate] or the Config's size limits.
func (s *Store[TTx]) Complete(ctx context.Context, c *Claim, resp *Response) error {
	return s.complete(ctx, s.dialect.DB(), c, StatusSucceeded, resp)
}

// CompleteTx stores resp as the successful result of the acquired claim c
// inside the caller's transaction tx, with the errors of [Store.Complete].
// idem never commits or rolls back tx; the response becomes visible, and
// durable, when the caller commits, together with the business rows.
func (s *Store[TTx]) CompleteTx(ctx context.Context, tx TTx, c *Claim, resp *Response) error {
	return s.complete(ctx, s.dialect.Tx(tx), c, StatusSucceeded, resp)
}

// Fail stores resp as the final, failed result of c: for failures that
// already had side effects and must not run again. It is replayed exactly
// like a success. Errors are those of [Store.Complete]. For failures that are
// safe to retry, use [Store.Release] (or roll back the claiming transaction).
func (s *Store[TTx]) Fail(ctx context.Context, c *Claim, resp *Response) error {
	return s.complete(ctx, s.dialect.DB(), c, StatusFailed, resp)
}

// FailTx is [Store.Fail] inside the caller's transaction tx. idem never
// commits or rolls back tx.
func (s *Store[TTx]) FailTx(ctx context.Context, tx TTx, c *Claim, resp *Response) error {
	return s.complete(ctx, s.dialect.Tx(tx), c, StatusFailed, resp)
}

func (s *Store[TTx]) complete(ctx context.Context, exec Executor, c *Claim, status Status, resp *Response) error {
	p, err := s.completeParams(ctx, c, status, resp)
	if err != nil {
		return err
	}
	start := s.observeStart()
	err = exec.Complete(ctx, p)
	if s.cfg.Observer != nil {
		s.observeComplete(ctx, start, c, status, resp, err)
	}
	if err != nil {
		return fmt.Errorf("idem: complete key %s: %w", digest.Key(c.Scope, c.Key), deferredConflict(c, err))
	}
	s.logKey(ctx, c.Scope, c.Key, completedOutcome(status))
	return nil
}

// completeCommit is complete followed by the commit of tx, both through
// pipe.CompleteCommit in one round trip.
func (s *Store[TTx]) completeCommit(ctx context.Context, pipe TxPipeliner[TTx], tx TTx, c *Claim, status Status, resp *Response) error {
	p, err := s.completeParams(ctx, c, status, resp)
	if err != nil {
		return err
	}
	start := s.observeStart()
	err = pipe.CompleteCommit(ctx, tx, p)
	if s.cfg.Observer != nil {
		s.observeComplete(ctx, start, c, status, resp, err)
	}
	if err != nil {
		return fmt.Errorf("idem: complete and commit key %s: %w", digest.Key(c.Scope, c.Key), deferredConflict(c, err))
	}
	s.logKey(ctx, c.Scope, c.Key, completedOutcome(status))
	return nil
}

// completeParams checks what complete and completeCommit were given and
// builds the parameters both send.
func (s *Store[TTx]) completeParams(ctx context.Context, c *Claim, status Status, resp *Response) (*CompleteParams, error) {
	if err := validateClaim(c); err != nil {
		return nil, err
	}
	if err := s.validateResponse(resp); err != nil {
		return nil, fmt.Errorf("idem: complete key %s: %w", digest.Key(c.Scope, c.Key), err)
	}
	resp, err := s.storeBody(ctx, c.Scope, c.Key, c.Token, resp)
	if err != nil {
		return nil, err
	}
	return &CompleteParams{
		Scope:          c.Scope,
		Key:            c.Key,
		Token:          c.Token,
		Status:         status,
		Response:       resp,
		Retention:      s.cfg.Retention,
		Now:            s.now(),
		Insert:         c.deferred,
		Fingerprint:    c.fingerprint,
		CreatedAt:      c.createdAt,
		LeaseExpiresAt: c.LeaseExpiresAt,
	}, nil
}

// deferredConflict marks ErrFenced from the completion of a deferred claim
// as retryable: a record appeared under the key although its lock was held,
// written by a claimer that does not take the lock (an older idem during a
// rolling upgrade). The transaction is rolled back; Do's next try finds the
// record and answers from it.
func deferredConflict(c *Claim, err error) error {
	if c.deferred && errors.Is(err, ErrFenced) {
		return fmt.Errorf("%w (a record for the key was written without its lock): %w", err, ErrRetryable)
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
// commits or rolls back tx.
func (s *Store[TTx]) ReleaseTx(ctx context.Context, tx TTx, c *Claim) error {
	return s.release(ctx, s.dialect.Tx(tx), c)
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

// GetTx is [Store.Get] inside the caller's transaction tx, which sees the
// transaction's own uncommitted claim. idem never commits or rolls back tx.
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

// Do runs fn exactly once per (scope, key, fp) across every process sharing
// the table: it begins a transaction, claims the key in it, runs fn with the
// transaction, stores fn's response and commits, so the business rows and the
// stored response commit together. A retry with the same fingerprint gets the
// stored response (Result.Replayed) without running fn.
//
// fn must touch the database only through tx, and nothing outside it: Do
// runs it again when the transaction fails with [ErrRetryable] (a deadlock
// or serialization failure), up to Config.MaxTxRetries times. Work with
// outside side effects must use [Store.Claim] and [Store.Complete] instead.
//
// If fn returns an error or panics, the transaction rolls back, nothing is
// stored, the key is free again, and the error (or panic) reaches the caller,
// except for an error made by [FinalFailure], whose response is stored as a
// final failure and committed.
// A response (or FinalFailure response) that cannot be stored rolls the
// transaction back with [ErrInvalidResponse]; it is not retried.
// An error from fn that matches [ErrRetryable] is retried like idem's own;
// so is a driver error of fn's own statements that the dialect's
// [ErrorClassifier] classifies as retryable (package mysql: a deadlock, or a
// certification failure on Galera), and fn's errors reach the caller so
// classified (see [Store.Classify]).
// Other errors are those of [Store.Claim].
//
// On a dialect that implements [TxPipeliner] (postgres), BEGIN is sent with
// the claim and the completion with COMMIT, saving two round trips. On
// PostgreSQL and SQLite the claim writes nothing: Do holds a lock on the key
// (an advisory lock; SQLite's write lock) and the completion inserts the
// finished record, one row version instead of an insert and an update (see
// docs/design.md). fn therefore does not find the key's record through
// [Store.GetTx] while it runs.
func (s *Store[TTx]) Do(ctx context.Context, scope, key string, fp Fingerprint, fn func(ctx context.Context, tx TTx) (*Response, error)) (*Result, error) {
	if err := validate(scope, key); err != nil {
		return nil, err
	}
	if fn == nil {
		return nil, errors.New("idem: Do needs a callback")
	}
	for try := 0; ; try++ {
		res, err := s.doOnce(ctx, scope, key, fp, fn)
		if err == nil || !errors.Is(err, ErrRetryable) || try >= s.cfg.MaxTxRetries || ctx.Err() != nil {
			return res, err
		}
		s.cfg.Logger.LogAttrs(ctx, slog.LevelDebug, "idem: retrying transaction",
			slog.String("key", digest.Key(scope, key)), slog.Int("try", try+1))
		if err := sleepCtx(ctx, backoff(try)); err != nil {
			return nil, err
		}
	}
}

func (s *Store[TTx]) doOnce(ctx context.Context, scope, key string, fp Fingerprint, fn func(ctx context.Context, tx TTx) (*Response, error)) (*Result, error) {
	pipe, piped := s.dialect.(TxPipeliner[TTx])
	var (
		tx    TTx
		err   error
		began = !piped // with pipe, once BeginClaim was called
		start = s.observeStart()
	)
	if !piped {
		tx, err = s.dialect.Begin(ctx)
		if err != nil {
			err = fmt.Errorf("idem: begin: %w", err)
			if s.cfg.Observer != nil {
				s.observeClaim(ctx, start, scope, key, nil, err)
			}
			return nil, err
		}
	}
	done := false
	defer func() {
		if !done && began {
			// Roll back even when ctx is cancelled; runs during panics too.
			// After a failed BeginClaim this is harmless (its contract).
			_ = s.dialect.Rollback(context.WithoutCancel(ctx), tx)
		}
	}()
	var c *Claim
	if piped {
		// BEGIN and the first claim in one round trip; any later claim
		// statement (a retry, a takeover) runs in the same transaction.
		c, err = s.claimFrom(ctx, nil, true, scope, key, fp, func(p *ClaimParams) (Executor, *ClaimResult, error) {
			var res *ClaimResult
			var berr error
			tx, res, berr = pipe.BeginClaim(ctx, p)
			began = true
			return s.dialect.Tx(tx), res, berr
		}, true)
	} else {
		c, err = s.claimFrom(ctx, s.dialect.Tx(tx), true, scope, key, fp, nil, true)
	}
	if s.cfg.Observer != nil && !errors.Is(err, errStaleLease) {
		// A stale lease is reported by doStale's pool-level claim.
		s.observeClaim(ctx, start, scope, key, c, err)
	}
	if errors.Is(err, errStaleLease) {
		// A crashed leased holder's record: the status check must not run
		// inside this transaction (its verdict would roll back with it, and
		// it would hold locks for the whole check). Resolve on the pool.
		done = true
		_ = s.dialect.Rollback(context.WithoutCancel(ctx), tx)
		return s.doStale(ctx, scope, key, fp, fn)
	}
	if inProgress, ok := errors.AsType[*InProgressError](err); ok && inProgress.TxAborted {
		// Do rolls its own transaction back: nothing is left for the caller to do.
		out := *inProgress
		out.TxAborted = false
		return nil, &out
	}
	if err != nil {
		return nil, err
	}
	if !c.Acquired() {
		return &Result{Response: c.Replay.Response, Replayed: true, Status: c.Replay.Status}, nil
	}
	if piped {
		// The completion and COMMIT in one round trip. On an error nothing
		// was committed (unless COMMIT's outcome is unknown, as with
		// Commit) and the deferred Rollback is harmless.
		res, err := s.runAndComplete(ctx, tx, c, fn, pipe)
		if err != nil {
			return nil, err
		}
		done = true
		return res, nil
	}
	res, err := s.runAndComplete(ctx, tx, c, fn, nil)
	if err != nil {
		return nil, err
	}
	done = true
	if err := s.dialect.Commit(ctx, tx); err != nil {
		return nil, fmt.Errorf("idem: commit key %s: %w", digest.Key(scope, key), err)
	}
	return res, nil
}

// runAndComplete runs fn in tx and completes c in tx with its response,
// as a final failure for a [FinalFailure] error. With pipe nil it neither
// commits nor rolls back; otherwise it completes and commits through
// pipe.CompleteCommit.
func (s *Store[TTx]) runAndComplete(ctx context.Context, tx TTx, c *Claim, fn func(ctx context.Context, tx TTx) (*Response, error), pipe TxPipeliner[TTx]) (*Result, error) {
	resp, err := fn(withDoClaim(ctx, c), tx)
	status := StatusSucceeded
	if final, ok := errors.AsType[*FinalFailureError](err); ok {
		resp, err, status = final.Response, nil, StatusFailed
	}
	if err != nil {
		// fn's own statements can meet a conflict (on Galera, a
		// certification failure at any statement): Do retries it only
		// if it matches ErrRetryable.
		return nil, s.Classify(err)
	}
	if resp == nil {
		return nil, errors.New("idem: Do callback returned a nil response and no error")
	}
	if pipe != nil {
		if err := s.completeCommit(ctx, pipe, tx, c, status, resp); err != nil {
			return nil, err
		}
		return &Result{Response: resp, Status: status}, nil
	}
	if err := s.complete(ctx, s.dialect.Tx(tx), c, status, resp); err != nil {
		return nil, err
	}
	return &Result{Response: resp, Status: status}, nil
}

// doStale finishes a Do whose key holds a stale lease: a pool-level claim
// resolves it through the status check, committing the verdict; if the key
// is handed over to this call, fn runs in a transaction of its own and the
// committed claim is completed there, fenced by its token, or released when
// fn fails (its writes rolled back, so the key is free again).
func (s *Store[TTx]) doStale(ctx context.Context, scope, key string, fp Fingerprint, fn func(ctx context.Context, tx TTx) (*Response, error)) (*Result, error) {
	c, err := s.Claim(ctx, scope, key, fp)
	if err != nil {
		return nil, err
	}
	if !c.Acquired() {
		return &Result{Response: c.Replay.Response, Replayed: true, Status: c.Replay.Status}, nil
	}
	tx, err := s.dialect.Begin(ctx)
	if err != nil {
		_ = s.Release(context.WithoutCancel(ctx), c)
		return nil, fmt.Errorf("idem: begin: %w", err)
	}
	done := false
	defer func() {
		if !done {
			// Runs during panics too: the writes roll back, the key is freed.
			_ = s.dialect.Rollback(context.WithoutCancel(ctx), tx)
			_ = s.Release(context.WithoutCancel(ctx), c)
		}
	}()
	res, err := s.runAndComplete(ctx, tx, c, fn, nil)
	if err != nil {
		return nil, err
	}
	done = true
	if err := s.dialect.Commit(ctx, tx); err != nil {
		// The claim stays committed and processing: after its lease the
		// status check settles whether this commit happened.
		return nil, fmt.Errorf("idem: commit key %s: %w", digest.Key(scope, key), err)
	}
	return res, nil
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
