package idem

import (
	"errors"
	"log/slog"
	"time"
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

	// ReplayRead says when [Store.Do] reads the key on the pool before it
	// begins its transaction, so that a replay costs one primary-key read
	// (see [ReplayRead]). Defaults to ReplayReadAuto: while at least half
	// of the recent answers were replays.
	ReplayRead ReplayRead

	// ReplayCache, when set, keeps the responses this Store completed or
	// replayed in memory for a while, so that [Store.Do] answers a replay
	// of the same fingerprint without reaching the database (see
	// [ReplayCacheConfig] for its bounds and what it cannot see).
	// Defaults to nil: off, every replay reads the database.
	ReplayCache *ReplayCacheConfig
}

const (
	defaultLeaseDuration = 30 * time.Second
	defaultRetention     = 24 * time.Hour
	defaultWaitTimeout   = 5 * time.Second
	defaultMaxTxRetries  = 3
	defaultCheckTimeout  = 10 * time.Second
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
	if out.ReplayCache != nil {
		out.ReplayCache = out.ReplayCache.withDefaults(out.Retention)
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
	case c.ReplayRead < ReplayReadAuto || c.ReplayRead > ReplayReadNever:
		return errors.New("idem: Config.ReplayRead is not a ReplayRead setting")
	case c.StatusCheck != nil && c.BlindTakeover:
		return errors.New("idem: Config.BlindTakeover and Config.StatusCheck exclude each other")
	case c.ReplayCache != nil:
		return c.ReplayCache.validate(c.Retention)
	}
	return nil
}
