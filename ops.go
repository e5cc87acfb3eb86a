package idem

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemstore/idem/internal/digest"
)

// Operator is implemented, optionally, by a [Dialect] that supports the
// store's operations methods ([Store.Check], [Store.Lookup],
// [Store.LookupDigest], [Store.Delete], [Store.PurgeScope], [Store.Stats]),
// which find it by a type assertion on the Dialect; every dialect of this
// module implements it. They are for operators and start-up checks, not
// for the request path: none of them takes part in a claim.
type Operator interface {
	// Check inspects the database without changing anything: the table and
	// its columns, the schema version recorded by the migrations, the
	// database's clock, and the connection settings the dialect needs. It
	// returns every problem found, or an error (classified as for Executor
	// methods) when the database could not be asked at all.
	Check(ctx context.Context) ([]Problem, error)

	// Find returns the records named by p, whatever their state (records
	// past their retention deadline too), with a non-locking read, and the
	// database's time (or the pinned Now) of the read. No match is an empty
	// slice, not an error.
	Find(ctx context.Context, p *FindParams) ([]*Record, time.Time, error)

	// Delete deletes up to Limit records named by p and returns how many it
	// deleted. It skips a processing record whose lease is live unless
	// Force is set, and, with Token set, a record carrying another token.
	Delete(ctx context.Context, p *DeleteParams) (int, error)

	// Stats counts the table's records as [Stats] describes, in one read of
	// the whole table.
	Stats(ctx context.Context, p *StatsParams) (*Stats, error)
}

// FindParams are the arguments of [Operator.Find]: either Scope and Key, or
// Digest.
type FindParams struct {
	Scope, Key string
	// Digest, when ByDigest is set, is the key digest of the records
	// wanted: the first 8 bytes of SHA-256(scope NUL key), found through
	// the index of migrations 00002 and 00003.
	Digest   [8]byte
	ByDigest bool
	// Now pins the clock; nil means the database's clock.
	Now *time.Time
}

// DeleteParams are the arguments of [Operator.Delete].
type DeleteParams struct {
	// Scope names the records; with WholeScope every record in it,
	// otherwise only the one of Key.
	Scope      string
	Key        string
	WholeScope bool
	// Token, when not 0, is the token the record must carry.
	Token int64
	// Force also deletes processing records whose lease is live.
	Force bool
	// Limit is the most records deleted; at least 1.
	Limit int
	// Now pins the clock; nil means the database's clock.
	Now *time.Time
}

// StatsParams are the arguments of [Operator.Stats].
type StatsParams struct {
	// Now pins the clock; nil means the database's clock.
	Now *time.Time
}

// Stats counts the records of one table at one moment.
type Stats struct {
	// Now is the database's time (or the pinned clock) of the count.
	Now time.Time
	// Total counts every row; Processing, Succeeded and Failed split it by
	// status, rows past their retention deadline included.
	Total, Processing, Succeeded, Failed int64
	// LiveLeases counts processing records whose lease has not run out.
	// StaleLeases counts processing records whose lease ran out while their
	// retention has not: what the status check and the reaper resolve.
	LiveLeases, StaleLeases int64
	// Expired counts records past their retention deadline, which the
	// reaper has not deleted yet: its backlog.
	Expired int64
	// OldestProcessing is the CreatedAt of the oldest processing record
	// (the claim of its current holder); zero when there is none.
	OldestProcessing time.Time
}

// Problem is one thing [Store.Check] found wrong, and how to fix it.
type Problem struct {
	// What is wrong, e.g. "the DSN lacks parseTime=true".
	What string
	// Fix says what to do, e.g. "add parseTime=true to the DSN".
	Fix string
}

// ErrNotReady means [Store.Check] found the database unfit for idem: a
// missing or outdated schema, or a connection setting the dialect needs. It
// is always returned as a *[CheckError] listing the problems. Nothing was
// changed.
var ErrNotReady = errors.New("idem: store not ready")

// ErrLeaseLive means [Store.Delete] refused to delete a processing record
// whose lease has not run out: its holder may still be running. Nothing
// was deleted. Force the deletion only after checking the business state.
var ErrLeaseLive = errors.New("idem: record is processing with a live lease")

// ErrNotSupported means the store's dialect does not implement [Operator].
var ErrNotSupported = errors.New("idem: operation not supported by this dialect")

// CheckError lists what [Store.Check] found wrong. It matches [ErrNotReady].
type CheckError struct {
	// Dialect is the dialect's name.
	Dialect string
	// Problems is never empty.
	Problems []Problem
}

// Error implements error.
func (e *CheckError) Error() string {
	var b strings.Builder
	b.WriteString("idem: ")
	b.WriteString(e.Dialect)
	b.WriteString(" store not ready:")
	for i, p := range e.Problems {
		if i > 0 {
			b.WriteString(";")
		}
		b.WriteString(" ")
		b.WriteString(p.What)
		if p.Fix != "" {
			b.WriteString(" (")
			b.WriteString(p.Fix)
			b.WriteString(")")
		}
	}
	return b.String()
}

// Is reports whether target is ErrNotReady.
func (e *CheckError) Is(target error) bool { return target == ErrNotReady }

// ErrInvalidDigest means a key digest given to [Store.LookupDigest] is not
// the 16 hexadecimal digits idem's logs print.
var ErrInvalidDigest = errors.New("idem: invalid key digest (want 16 hexadecimal digits)")

// KeyDigest returns the digest idem's logs and errors print for key in
// scope: 16 hex digits, the first 8 bytes of SHA-256(scope NUL key). Pass
// it to [Store.LookupDigest] to find the record.
func KeyDigest(scope, key string) string { return digest.Key(scope, key) }

// purgeBatch bounds one DELETE of [Store.PurgeScope], and so the locks it holds.
const purgeBatch = 500

func (s *Store[TTx]) operator() (Operator, error) {
	op, ok := any(s.dialect).(Operator)
	if !ok {
		return nil, fmt.Errorf("%w (%s)", ErrNotSupported, s.dialect.Name())
	}
	return op, nil
}

// Check verifies at start-up that the store can work: the table and its
// columns exist, the schema version recorded by the migrations is the one
// this idem needs, the database's clock is readable, and the connection has
// the settings the dialect needs (MySQL: parseTime=true and loc=UTC;
// SQLite: WAL and a busy timeout). It changes nothing: a missing or old
// schema is reported, never migrated.
//
// It returns nil when all is well, a *[CheckError] (matching
// [ErrNotReady]) naming each problem and its fix, or an error matching
// [ErrStoreUnavailable] when the database cannot be reached. Call it before
// serving, so a misconfiguration stops the deploy instead of turning every
// request into a 503.
func (s *Store[TTx]) Check(ctx context.Context) error {
	op, err := s.operator()
	if err != nil {
		return err
	}
	problems, err := op.Check(ctx)
	if err != nil {
		return fmt.Errorf("idem: check: %w", err)
	}
	if len(problems) > 0 {
		return &CheckError{Dialect: s.dialect.Name(), Problems: problems}
	}
	return nil
}

// Lookup returns the record for key in scope whatever its state, including
// a record past its retention deadline that the reaper has not deleted
// (unlike [Store.Get], which returns live records only). It returns
// [ErrNotFound] when there is none.
func (s *Store[TTx]) Lookup(ctx context.Context, scope, key string) (*Record, error) {
	if err := validate(scope, key); err != nil {
		return nil, err
	}
	op, err := s.operator()
	if err != nil {
		return nil, err
	}
	recs, _, err := op.Find(ctx, &FindParams{Scope: scope, Key: key, Now: s.now()})
	if err != nil {
		return nil, fmt.Errorf("idem: lookup key %s: %w", digest.Key(scope, key), err)
	}
	if len(recs) == 0 {
		return nil, fmt.Errorf("%w (key %s)", ErrNotFound, digest.Key(scope, key))
	}
	return recs[0], nil
}

// LookupDigest returns the records whose key digest (as printed in idem's
// logs and errors, see [KeyDigest]) is d, through an index: normally one,
// more only if two keys share the 64-bit digest. It returns
// [ErrInvalidDigest] for anything but 16 hex digits and [ErrNotFound] when
// no record matches.
func (s *Store[TTx]) LookupDigest(ctx context.Context, d string) ([]*Record, error) {
	sum, err := digest.Parse(d)
	if err != nil {
		return nil, ErrInvalidDigest
	}
	op, err := s.operator()
	if err != nil {
		return nil, err
	}
	recs, _, err := op.Find(ctx, &FindParams{Digest: sum, ByDigest: true, Now: s.now()})
	if err != nil {
		return nil, fmt.Errorf("idem: lookup digest %s: %w", strings.ToLower(d), err)
	}
	if len(recs) == 0 {
		return nil, fmt.Errorf("%w (digest %s)", ErrNotFound, strings.ToLower(d))
	}
	return recs, nil
}

// DeleteOptions qualify [Store.Delete] and [Store.PurgeScope]. A nil
// *DeleteOptions means the zero value.
type DeleteOptions struct {
	// Force deletes processing records whose lease is live, whose holder
	// may still be running: its completion then fails with ErrFenced, and
	// the next retry runs the business effect again. Set it only after
	// checking the business state.
	Force bool
	// Token, when not 0, deletes the record only while it carries this
	// fencing token (as shown by Lookup): a record that changed holder
	// since it was inspected is left alone ([ErrFenced]).
	Token int64
}

// Delete deletes the record for key in scope, so the key's next claim
// starts afresh. It refuses a processing record whose lease is live with
// [ErrLeaseLive] unless opts.Force is set, and a record whose token is not
// opts.Token (when set) with [ErrFenced]; it returns [ErrNotFound] when
// there is no record. Nothing is deleted on any error.
func (s *Store[TTx]) Delete(ctx context.Context, scope, key string, opts *DeleteOptions) error {
	if err := validate(scope, key); err != nil {
		return err
	}
	var o DeleteOptions
	if opts != nil {
		o = *opts
	}
	op, err := s.operator()
	if err != nil {
		return err
	}
	kd := digest.Key(scope, key)
	n, err := op.Delete(ctx, &DeleteParams{Scope: scope, Key: key, Token: o.Token, Force: o.Force, Limit: 1, Now: s.now()})
	// After the delete, whatever its outcome: a Do that read the record
	// before it presents an older generation and its fill is dropped.
	s.cache.forget(scope, key, false)
	if err != nil {
		return fmt.Errorf("idem: delete key %s: %w", kd, err)
	}
	if n == 1 {
		s.logOutcome(ctx, kd, "deleted")
		return nil
	}
	// Nothing deleted: say why, from the record as it is now.
	recs, now, err := op.Find(ctx, &FindParams{Scope: scope, Key: key, Now: s.now()})
	switch {
	case err != nil:
		return fmt.Errorf("idem: delete key %s: %w", kd, err)
	case len(recs) == 0:
		return fmt.Errorf("%w (key %s)", ErrNotFound, kd)
	case o.Token != 0 && recs[0].Token != o.Token:
		return fmt.Errorf("idem: delete key %s: token %d is not the record's: %w", kd, o.Token, ErrFenced)
	case recs[0].Status == StatusProcessing && recs[0].LeaseExpiresAt.After(now):
		return fmt.Errorf("idem: delete key %s: %w until %s", kd, ErrLeaseLive, recs[0].LeaseExpiresAt.Format(time.RFC3339))
	default:
		// It changed between the two reads; let the caller look again.
		return fmt.Errorf("idem: delete key %s: the record changed meanwhile: %w", kd, ErrFenced)
	}
}

// PurgeScope deletes every record in scope, in batches, and returns how
// many it deleted. Processing records whose lease is live are kept unless
// opts.Force is set (opts.Token is ignored). The batches commit one by
// one: an error leaves the ones before it deleted.
func (s *Store[TTx]) PurgeScope(ctx context.Context, scope string, opts *DeleteOptions) (int, error) {
	if !validText(scope, MaxScopeLength) {
		return 0, ErrInvalidScope
	}
	var force bool
	if opts != nil {
		force = opts.Force
	}
	op, err := s.operator()
	if err != nil {
		return 0, err
	}
	total := 0
	defer s.cache.forget(scope, "", true) // see Delete
	for {
		n, err := op.Delete(ctx, &DeleteParams{Scope: scope, WholeScope: true, Force: force, Limit: purgeBatch, Now: s.now()})
		total += n
		if err != nil {
			return total, fmt.Errorf("idem: purge scope: %w", err)
		}
		if n < purgeBatch {
			return total, nil
		}
	}
}

// ReleaseLease frees the key of a processing record stuck on a holder that
// will never complete it (a dead payment provider, a lost worker) by
// deleting the record, so the next retry acquires the key and runs the
// business effect again. It is an operator's decision, taken after checking
// that the effect did not happen: token must be the record's current
// fencing token (shown by [Store.Lookup]), so a record that changed holder
// since then is left alone ([ErrFenced]), as is a completed one. Unlike
// [Store.Delete] it does not wait for the lease to run out.
func (s *Store[TTx]) ReleaseLease(ctx context.Context, scope, key string, token int64) error {
	if err := validate(scope, key); err != nil {
		return err
	}
	kd := digest.Key(scope, key)
	if err := s.dialect.DB().Release(ctx, &ReleaseParams{Scope: scope, Key: key, Token: token, Now: s.now()}); err != nil {
		return fmt.Errorf("idem: release lease of key %s: %w", kd, err)
	}
	s.logOutcome(ctx, kd, "lease_released_by_operator")
	return nil
}

// Stats counts the table's records by status, live and stale leases,
// records awaiting the reaper and the oldest processing record. It reads the
// whole table: run it by hand or every few minutes, not per request.
func (s *Store[TTx]) Stats(ctx context.Context) (*Stats, error) {
	op, err := s.operator()
	if err != nil {
		return nil, err
	}
	st, err := op.Stats(ctx, &StatsParams{Now: s.now()})
	if err != nil {
		return nil, fmt.Errorf("idem: stats: %w", err)
	}
	return st, nil
}
