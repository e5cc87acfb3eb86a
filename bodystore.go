package idem

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemstore/idem/internal/digest"
)

// BodyStore keeps response bodies too large to store in the record (see
// Config.BodyStore): the record then holds the object's address, the body's
// length and its SHA-256, and every replay reads the object back, checking
// both. [DirBodyStore] is the built-in implementation; an application may
// bring its own (an object store).
//
// idem names every object it writes (see Put) and relies on these rules:
//   - Put returns only once the object is durable: idem commits the record
//     that names it right after, and a record must never outlive a crash
//     without its object.
//   - Open of an address that does not exist returns an error matching
//     [fs.ErrNotExist]; any other error is taken as the store being
//     unreachable.
//   - Delete of an address that does not exist is not an error.
type BodyStore interface {
	// Put stores the bytes read from r until io.EOF as a new object and
	// returns its address. The address must begin with name (idem's
	// name for the object: the key digest and the holder's fencing token,
	// see [Store.SweepBodies]), followed by nothing or by '.' and anything
	// of the store's choosing, and be at most 1024 bytes of printable
	// ASCII. On error nothing must be addressable under the name (a
	// partial object may remain, invisible to List).
	Put(ctx context.Context, name string, r io.Reader) (address string, err error)
	// Open returns the object's bytes.
	Open(ctx context.Context, address string) (io.ReadCloser, error)
	// Delete removes the object.
	Delete(ctx context.Context, address string) error
	// List calls fn with the address of every object last written before
	// the given time, in any order, stopping at fn's first error.
	List(ctx context.Context, writtenBefore time.Time, fn func(address string) error) error
}

// BodyRef names a response body kept in the store's [BodyStore] instead of
// in the record.
type BodyRef struct {
	// Address is the object's address in the BodyStore.
	Address string
	// Length is the body's size in bytes.
	Length int64
	// SHA256 is the body's SHA-256.
	SHA256 [32]byte
}

// ErrBodyUnavailable means the [BodyStore] could not be reached or failed
// (a disk error, a network error): a completion that had to store its body
// there stored nothing and must be refused, a replay could not read it.
// Errors matching it also match [ErrStoreUnavailable], so that callers that
// refuse on the store being down (idemhttp's 503) refuse here too. A body
// object that is missing or does not match its record is not unavailable
// but [ErrCorruptRecord].
var ErrBodyUnavailable = errors.New("idem: body store unavailable")

// DefaultInlineBodyMax is Config.InlineBodyMax when a BodyStore is set.
const DefaultInlineBodyMax = 64 << 10

// bodyRefHeader is the stored header that carries a BodyRef in the
// record's response_headers column. Its name is not an RFC 9110 token, so
// no valid response can hold it (Response.Validate refuses such names), and
// an idem that predates body stores, reading such a record, answers
// ErrCorruptRecord instead of replaying the empty inline body: reading
// old and new records the same way needs no new column and no table lock.
const bodyRefHeader = ":idem-body"

type bodyUnavailableError struct{ cause error }

func (e *bodyUnavailableError) Error() string {
	return "idem: body store unavailable: " + e.cause.Error()
}

func (e *bodyUnavailableError) Is(target error) bool {
	return target == ErrBodyUnavailable || target == ErrStoreUnavailable
}

func (e *bodyUnavailableError) Unwrap() error { return e.cause }

// objectName is idem's name of the object holding the body of key's
// holder tok: the key digest lets the sweep find the record that may name
// the object through the digest index, and the token keeps a later holder
// of the same key from reusing (and then losing to the sweep) the object
// of an earlier one.
func objectName(scope, key string, tok int64) string {
	return digest.Key(scope, key) + "-" + strconv.FormatInt(tok, 10)
}

// hashingReader counts and hashes what it reads and refuses to read past
// limit bytes.
type hashingReader struct {
	r     io.Reader
	h     hash.Hash
	n     int64
	limit int64
}

var errBodyTooLarge = errors.New("idem: body larger than Config.MaxResponseBytes")

func (hr *hashingReader) Read(p []byte) (int, error) {
	n, err := hr.r.Read(p)
	hr.h.Write(p[:n])
	hr.n += int64(n)
	if hr.n > hr.limit {
		return n, errBodyTooLarge
	}
	return n, err
}

// PutBody writes a response body read from r to the store's BodyStore for
// the acquired claim c, and returns the reference to complete c with (as
// Response.BodyRef, Body empty): for a body too large to hold in memory.
// The object is durable when PutBody returns; if the completion then fails
// or its transaction rolls back, the object is an orphan that
// [Store.SweepBodies] removes. It returns [ErrInvalidResponse] for a body
// over Config.MaxResponseBytes and [ErrBodyUnavailable] when the body store
// fails; it is an error without a BodyStore.
func (s *Store[TTx]) PutBody(ctx context.Context, c *Claim, r io.Reader) (*BodyRef, error) {
	if err := validateClaim(c); err != nil {
		return nil, err
	}
	return s.putBody(ctx, nil, c.Scope, c.Key, c.Token, r)
}

// putBody writes r to the BodyStore: inside *tx when tx is set and the
// BodyStore is a TxBodyStore of the store's transaction type, on its own
// otherwise.
func (s *Store[TTx]) putBody(ctx context.Context, tx *TTx, scope, key string, tok int64, r io.Reader) (*BodyRef, error) {
	if s.cfg.BodyStore == nil {
		return nil, errors.New("idem: no Config.BodyStore to put a body in")
	}
	kd := digest.Key(scope, key)
	name := objectName(scope, key, tok)
	hr := &hashingReader{r: r, h: sha256.New(), limit: int64(s.cfg.MaxResponseBytes)}
	addr, inTx, err := s.put(ctx, tx, name, hr)
	if errors.Is(err, errBodyTooLarge) || hr.n > hr.limit {
		if err == nil && !inTx {
			// An object written inside tx goes with tx, which the caller
			// rolls back on this error.
			_ = s.cfg.BodyStore.Delete(context.WithoutCancel(ctx), addr)
		}
		return nil, fmt.Errorf("idem: complete key %s: %w", kd, &InvalidResponseError{Field: "Body",
			Reason: fmt.Sprintf("more than Config.MaxResponseBytes (%d)", s.cfg.MaxResponseBytes)})
	}
	if err != nil {
		s.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idem: body store failed to store a response body; refusing the completion",
			slog.String("key", kd), slog.String("error_class", errorClass(err)))
		return nil, fmt.Errorf("idem: complete key %s: %w", kd, &bodyUnavailableError{cause: err})
	}
	if !strings.HasPrefix(addr, name) || (len(addr) > len(name) && addr[len(name)] != '.') || !validAddress(addr) {
		return nil, fmt.Errorf("idem: complete key %s: %w", kd, &bodyUnavailableError{
			cause: errors.New("the BodyStore returned an address that breaks its contract")})
	}
	ref := &BodyRef{Address: addr, Length: hr.n}
	hr.h.Sum(ref.SHA256[:0])
	return ref, nil
}

func validAddress(a string) bool {
	if a == "" || len(a) > 1024 {
		return false
	}
	for i := 0; i < len(a); i++ {
		if a[i] <= ' ' || a[i] > '~' {
			return false
		}
	}
	return true
}

// storeBody returns the response to hand to the executor for a completion
// of (scope, key) by holder tok: resp itself for an inline body; with the
// body written to the BodyStore when it is larger than Config.InlineBodyMax;
// and, for a response carrying a BodyRef, a copy whose headers carry the
// reference. resp has been validated.
//
// tx is the transaction the completion runs in, nil on the pool: a
// TxBodyStore writes the body in it.
func (s *Store[TTx]) storeBody(ctx context.Context, tx *TTx, scope, key string, tok int64, resp *Response) (*Response, error) {
	if resp.BodyRef == nil && (s.cfg.BodyStore == nil || len(resp.Body) <= s.cfg.InlineBodyMax) {
		return resp, nil
	}
	ref := resp.BodyRef
	if ref != nil && !strings.HasPrefix(ref.Address, objectName(scope, key, tok)) {
		// An object put for another claim would be named by two records,
		// or by one the sweep does not look up.
		return nil, fmt.Errorf("idem: complete key %s: %w", digest.Key(scope, key),
			&InvalidResponseError{Field: "BodyRef", Reason: "not put for this claim (use Store.PutBody with the same claim)"})
	}
	if ref == nil {
		var err error
		ref, err = s.putBody(ctx, tx, scope, key, tok, bytes.NewReader(resp.Body))
		if err != nil {
			return nil, err
		}
	}
	h := make(http.Header, len(resp.Header)+1)
	for k, v := range resp.Header {
		h[k] = v
	}
	h[bodyRefHeader] = []string{"v1 " + strconv.FormatInt(ref.Length, 10) + " " + hex.EncodeToString(ref.SHA256[:]) + " " + ref.Address}
	return &Response{StatusCode: resp.StatusCode, Header: h}, nil
}

// decodeBodyRef moves a stored body reference from the headers of rec's
// response to Response.BodyRef.
func decodeBodyRef(rec *Record, kd string) error {
	if rec == nil || rec.Response == nil {
		return nil
	}
	vals, ok := rec.Response.Header[bodyRefHeader]
	if !ok {
		return nil
	}
	bad := func(reason string) error {
		return &CorruptRecordError{KeyDigest: kd, Reason: "its body reference " + reason}
	}
	if len(vals) != 1 || len(rec.Response.Body) != 0 {
		return bad("is malformed")
	}
	f := strings.Split(vals[0], " ")
	if len(f) != 4 || f[0] != "v1" {
		return bad("has an unknown format")
	}
	n, err := strconv.ParseInt(f[1], 10, 64)
	sum, herr := hex.DecodeString(f[2])
	if err != nil || n < 0 || herr != nil || len(sum) != 32 || !validAddress(f[3]) {
		return bad("is malformed")
	}
	ref := &BodyRef{Address: f[3], Length: n}
	copy(ref.SHA256[:], sum)
	h := make(http.Header, len(rec.Response.Header)-1)
	for k, v := range rec.Response.Header {
		if k != bodyRefHeader {
			h[k] = v
		}
	}
	if len(h) == 0 {
		h = nil
	}
	resp := *rec.Response
	resp.Header, resp.BodyRef, resp.Body = h, ref, nil
	rec.Response = &resp
	return nil
}

// OpenBody returns the body of resp, a response answered by this store: its
// inline Body, or the object its BodyRef names, read from the BodyStore.
// An object is read once in full and checked against the length and
// SHA-256 of its record before the reader is returned, so that a missing
// or damaged object is an error before the first byte is sent: a missing
// object, or one that does not match, is [ErrCorruptRecord] (logged with
// the key digest); a body store that fails is [ErrBodyUnavailable]. The
// returned reader reads the object again and checks it again: should it
// change in between, Read returns ErrCorruptRecord at the end, and the
// caller must abort the answer (idemhttp aborts the connection) rather than
// finish it.
func (s *Store[TTx]) OpenBody(ctx context.Context, resp *Response) (io.ReadCloser, error) {
	if resp == nil {
		return nil, &InvalidResponseError{Field: "Response", Reason: "nil"}
	}
	ref := resp.BodyRef
	if ref == nil {
		return io.NopCloser(bytes.NewReader(resp.Body)), nil
	}
	kd, _, _ := strings.Cut(ref.Address, "-")
	if s.cfg.BodyStore == nil {
		return nil, s.bodyCorrupt(ctx, kd, "names a body object but the store has no Config.BodyStore", nil)
	}
	// First pass: check before anything is answered.
	if err := s.checkObject(ctx, kd, ref, io.Discard); err != nil {
		return nil, err
	}
	rc, err := s.cfg.BodyStore.Open(ctx, ref.Address)
	if err != nil {
		return nil, s.objectOpenError(ctx, kd, err)
	}
	return &checkedBody{rc: rc, ref: ref, h: sha256.New(), corrupt: func(reason string) error {
		return s.bodyCorrupt(ctx, kd, reason, nil)
	}}, nil
}

func (s *Store[TTx]) checkObject(ctx context.Context, kd string, ref *BodyRef, w io.Writer) error {
	rc, err := s.cfg.BodyStore.Open(ctx, ref.Address)
	if err != nil {
		return s.objectOpenError(ctx, kd, err)
	}
	defer rc.Close()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(h, w), io.LimitReader(rc, ref.Length+1))
	if err != nil {
		return fmt.Errorf("idem: read body of key %s: %w", kd, &bodyUnavailableError{cause: err})
	}
	if n != ref.Length {
		return s.bodyCorrupt(ctx, kd, "names a body object whose length does not match", nil)
	}
	if subtle.ConstantTimeCompare(h.Sum(nil), ref.SHA256[:]) != 1 {
		return s.bodyCorrupt(ctx, kd, "names a body object whose SHA-256 does not match", nil)
	}
	return nil
}

func (s *Store[TTx]) objectOpenError(ctx context.Context, kd string, err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return s.bodyCorrupt(ctx, kd, "names a body object that does not exist", err)
	}
	s.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idem: body store failed to open a response body",
		slog.String("key", kd), slog.String("error_class", errorClass(err)))
	return fmt.Errorf("idem: read body of key %s: %w", kd, &bodyUnavailableError{cause: err})
}

func (s *Store[TTx]) bodyCorrupt(ctx context.Context, kd, reason string, cause error) error {
	err := &CorruptRecordError{KeyDigest: kd, Reason: "it " + reason, Cause: cause}
	s.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idem: stored record is invalid; answering ErrCorruptRecord, the row is left for an operator to delete",
		slog.String("dialect", s.dialect.Name()), slog.String("key", kd), slog.String("reason", err.Reason))
	return err
}

// checkedBody streams an object and checks, at its end, its length and
// SHA-256 again.
type checkedBody struct {
	rc      io.ReadCloser
	ref     *BodyRef
	h       hash.Hash
	n       int64
	corrupt func(reason string) error
}

func (b *checkedBody) Read(p []byte) (int, error) {
	if rest := b.ref.Length + 1 - b.n; int64(len(p)) > rest {
		p = p[:rest]
	}
	n, err := b.rc.Read(p)
	b.h.Write(p[:n])
	b.n += int64(n)
	if b.n > b.ref.Length {
		return 0, b.corrupt("names a body object that grew while it was read")
	}
	if errors.Is(err, io.EOF) {
		if b.n != b.ref.Length || subtle.ConstantTimeCompare(b.h.Sum(nil), b.ref.SHA256[:]) != 1 {
			return n, b.corrupt("names a body object that changed while it was read")
		}
	} else if err != nil {
		err = &bodyUnavailableError{cause: err}
	}
	return n, err
}

func (b *checkedBody) Close() error { return b.rc.Close() }

// SweepBodies deletes the objects of the BodyStore that no record names
// and that were written more than grace ago: those of records the reaper
// deleted (an object outlives its record) and orphans, written for a
// completion that then failed or rolled back, or whose process crashed
// before the commit. grace must exceed the longest time between writing a
// body and committing its record (a completion inside a long transaction),
// or the sweep could remove the body of a record about to commit; it is
// at least a minute. Objects whose address idem did not name are left
// alone. It returns how many objects it deleted.
func (s *Store[TTx]) SweepBodies(ctx context.Context, grace time.Duration) (int, error) {
	if s.cfg.BodyStore == nil {
		return 0, nil
	}
	if grace < time.Minute {
		return 0, errors.New("idem: SweepBodies needs a grace period of at least a minute")
	}
	deleted := 0
	err := s.cfg.BodyStore.List(ctx, time.Now().Add(-grace), func(addr string) error {
		kd, _, ok := strings.Cut(addr, "-")
		if !ok || len(kd) != 16 {
			return nil
		}
		named, err := s.objectNamed(ctx, kd, addr)
		if err != nil || named {
			return err
		}
		if err := s.cfg.BodyStore.Delete(ctx, addr); err != nil {
			return &bodyUnavailableError{cause: err}
		}
		deleted++
		return nil
	})
	if err != nil {
		return deleted, fmt.Errorf("idem: sweep bodies: %w", err)
	}
	return deleted, nil
}

// objectNamed reports whether a record of key digest kd names addr.
func (s *Store[TTx]) objectNamed(ctx context.Context, kd, addr string) (bool, error) {
	recs, err := s.LookupDigest(ctx, kd)
	if errors.Is(err, ErrNotFound) || errors.Is(err, ErrInvalidDigest) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	for _, rec := range recs {
		if rec.Response == nil {
			continue
		}
		if vals := rec.Response.Header[bodyRefHeader]; len(vals) == 1 && strings.HasSuffix(vals[0], " "+addr) {
			return true, nil
		}
		if rec.Response.BodyRef != nil && rec.Response.BodyRef.Address == addr {
			return true, nil
		}
	}
	return false, nil
}

// validateBodyRef checks a response that carries a BodyRef: it needs a
// BodyStore, an empty Body and a length within Config.MaxResponseBytes.
func (s *Store[TTx]) validateBodyRef(r *Response) error {
	ref := r.BodyRef
	switch {
	case ref == nil:
		return nil
	case s.cfg.BodyStore == nil:
		return &InvalidResponseError{Field: "BodyRef", Reason: "set without a Config.BodyStore"}
	case len(r.Body) != 0:
		return &InvalidResponseError{Field: "BodyRef", Reason: "set with a non-empty Body"}
	case ref.Length < 0 || ref.Length > int64(s.cfg.MaxResponseBytes):
		return &InvalidResponseError{Field: "BodyRef", Reason: fmt.Sprintf(
			"a length of %d bytes, more than Config.MaxResponseBytes (%d)", ref.Length, s.cfg.MaxResponseBytes)}
	case !validAddress(ref.Address):
		return &InvalidResponseError{Field: "BodyRef", Reason: "an invalid address"}
	}
	return nil
}

const defaultBodyGrace = time.Hour

func (c *ReaperConfig) bodyDefaults() error {
	if c.BodyGrace < 0 || c.BodySweepEvery < 0 {
		return errors.New("idem: ReaperConfig.BodyGrace and BodySweepEvery must not be negative")
	}
	if c.BodyGrace == 0 {
		c.BodyGrace = defaultBodyGrace
	}
	if c.BodyGrace < time.Minute {
		return errors.New("idem: ReaperConfig.BodyGrace must be at least a minute")
	}
	if c.BodySweepEvery == 0 {
		c.BodySweepEvery = defaultBodyGrace
	}
	return nil
}

// bodySweep remembers when the reaper last swept the BodyStore.
type bodySweep struct {
	mu   sync.Mutex
	last time.Time
}

// sweepBodies sweeps the BodyStore when BodySweepEvery has passed since
// the last sweep. It runs after the pass deleted expired records, so an
// object whose record was just deleted goes in the same pass (once past
// its grace period): the record is always gone first.
func (r *Reaper[TTx]) sweepBodies(ctx context.Context) (int, error) {
	if r.store.cfg.BodyStore == nil {
		return 0, nil
	}
	r.sweep.mu.Lock()
	if !r.sweep.last.IsZero() && time.Since(r.sweep.last) < r.cfg.BodySweepEvery {
		r.sweep.mu.Unlock()
		return 0, nil
	}
	r.sweep.last = time.Now()
	r.sweep.mu.Unlock()
	return r.store.SweepBodies(ctx, r.cfg.BodyGrace)
}

type doClaimKey struct{}

func withDoClaim(ctx context.Context, c *Claim) context.Context {
	return context.WithValue(ctx, doClaimKey{}, c)
}

// DoClaim returns, inside a [Store.Do] callback, the claim the callback runs
// under (a copy), for [Store.PutBody]: a callback whose body is too large
// to hold in memory streams it to the BodyStore and returns a Response
// with the BodyRef. It returns nil outside a Do callback.
func DoClaim(ctx context.Context) *Claim {
	c, _ := ctx.Value(doClaimKey{}).(*Claim)
	if c == nil {
		return nil
	}
	out := *c
	return &out
}

// BodyStoreThreshold returns Config.InlineBodyMax when the store has a
// BodyStore, and -1 when it has none: for a caller (idemhttp) that streams
// bodies larger than this to [Store.PutBody] while they are written.
func (s *Store[TTx]) BodyStoreThreshold() int {
	if s.cfg.BodyStore == nil {
		return -1
	}
	return s.cfg.InlineBodyMax
}

// LoadBody returns resp with its body in Body: resp itself for an inline
// body, or a copy holding the object its BodyRef names, read and checked
// by [Store.OpenBody] (its errors: ErrCorruptRecord, ErrBodyUnavailable).
// For callers that answer from memory anyway (a gRPC message, a queue's
// result); the object's size is bounded by Config.MaxResponseBytes when it
// was stored. A caller that ignored BodyRef would replay an empty body.
func (s *Store[TTx]) LoadBody(ctx context.Context, resp *Response) (*Response, error) {
	if resp == nil || resp.BodyRef == nil {
		return resp, nil
	}
	rc, err := s.OpenBody(ctx, resp)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	body := make([]byte, 0, resp.BodyRef.Length)
	buf := bytes.NewBuffer(body)
	if _, err := buf.ReadFrom(rc); err != nil {
		return nil, err
	}
	out := *resp
	out.Body, out.BodyRef = buf.Bytes(), nil
	return &out, nil
}
