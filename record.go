package idem

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"net/http"
	"time"
)

// Status is the state of a record. The numeric values are stored in the
// database and never change.
type Status int16

// Record states. A record is processing from its claim until it is completed
// as succeeded or failed; both final states are replayed.
const (
	StatusProcessing Status = 1
	StatusSucceeded  Status = 2
	StatusFailed     Status = 3
)

// String returns "processing", "succeeded" or "failed".
func (s Status) String() string {
	switch s {
	case StatusProcessing:
		return "processing"
	case StatusSucceeded:
		return "succeeded"
	case StatusFailed:
		return "failed"
	default:
		return "unknown"
	}
}

// Final reports whether s is a completed state whose response is replayed.
func (s Status) Final() bool { return s == StatusSucceeded || s == StatusFailed }

// Fingerprint identifies the request an idempotency key was first used with,
// typically a SHA-256 over the method, route, tenant and canonical body. A
// retry must present the same fingerprint to get the stored response.
type Fingerprint [32]byte

// NewFingerprint returns the SHA-256 of parts, each prefixed by its length so
// that ("ab", "c") and ("a", "bc") differ.
func NewFingerprint(parts ...[]byte) Fingerprint {
	h := sha256.New()
	var n [8]byte
	for _, p := range parts {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write(p)
	}
	var fp Fingerprint
	h.Sum(fp[:0])
	return fp
}

// Equal compares two fingerprints in constant time.
func (f Fingerprint) Equal(other Fingerprint) bool {
	return subtle.ConstantTimeCompare(f[:], other[:]) == 1
}

// Response is the stored answer of a completed key, replayed byte for byte to
// every retry with the same fingerprint.
type Response struct {
	// StatusCode is the protocol status, an HTTP status for idemhttp.
	StatusCode int
	// Header holds the headers to replay. Store only what is safe to send to
	// another attempt of the same client (idemhttp applies an allowlist).
	Header http.Header
	// Body is replayed byte for byte.
	Body []byte
	// BodyRef, when set, names the body kept in the store's BodyStore
	// (Config.BodyStore) and Body is empty: read it with [Store.OpenBody].
	// A replay has it for a body stored by reference; a completion may set
	// it to the reference [Store.PutBody] returned for the same claim.
	BodyRef *BodyRef
}

// Record is the stored state of one (scope, key).
type Record struct {
	// Scope and Key name the record; they match byte for byte.
	Scope string
	Key   string
	// Fingerprint identifies the request the key is bound to.
	Fingerprint Fingerprint
	// Status is processing until the record completes.
	Status Status
	// Token is the fencing token of the current holder. It changes on every
	// new holder of the key, so a stale holder cannot complete.
	Token int64
	// Attempt counts holders of this key since it was first claimed.
	Attempt int
	// LeaseExpiresAt is when a processing record's holder is presumed gone.
	LeaseExpiresAt time.Time
	// Response is nil while the record is processing.
	Response *Response
	// CreatedAt is when the current holder claimed the key; UpdatedAt when
	// the record last changed. All times are UTC, to the microsecond.
	CreatedAt time.Time
	UpdatedAt time.Time
	// CompletedAt is zero while the record is processing.
	CompletedAt time.Time
	// ExpiresAt is the retention deadline; after it the key is claimed anew.
	ExpiresAt time.Time
}
