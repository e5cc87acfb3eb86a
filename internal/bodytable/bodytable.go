// Package bodytable is what the table body stores of packages postgres,
// mysql and sqlite share: the layout of an object in the
// idempotency_bodies table (migration 00004) as rows of at most one chunk
// each, the writing of a body chunk by chunk and its reading back chunk by
// chunk, so that memory stays bounded by one chunk whatever the body's
// size. The dialects own the SQL.
//
// An object is the rows (address, seq, data, written_at) with seq 0, 1, 2,
// ... in order; it always has row 0 (empty for an empty body), which marks
// it: Open looks for row 0 and List lists rows 0. Rows are written inside
// one transaction, the caller's or the store's own, so an object is never
// seen in part.
package bodytable

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"time"
)

// Chunk sizes.
const (
	// DefaultChunkSize is the data of one row: small enough for MariaDB's
	// default max_allowed_packet (16 MiB) many times over and for a
	// driver's buffers, large enough that a 50 MiB body is 200 rows.
	DefaultChunkSize = 256 << 10
	// MinChunkSize and MaxChunkSize bound the configured size.
	MinChunkSize = 1 << 10
	MaxChunkSize = 4 << 20
)

// MaxAddress is the length of the address column; every address made by
// NewAddress fits (the name is a 16-digit key digest, '-' and a token of
// at most 20 characters, then '.' and 16 random hex digits).
const MaxAddress = 96

// Config is a table store's validated configuration.
type Config struct {
	ChunkSize int
	Now       func() time.Time
}

// NewConfig applies the defaults to a chunk size (0: DefaultChunkSize) and
// a clock (nil: time.Now), and refuses a size out of bounds.
func NewConfig(chunk int, now func() time.Time) (Config, error) {
	if chunk == 0 {
		chunk = DefaultChunkSize
	}
	if chunk < MinChunkSize || chunk > MaxChunkSize {
		return Config{}, fmt.Errorf("ChunkSize %d is outside [%d, %d]", chunk, MinChunkSize, MaxChunkSize)
	}
	if now == nil {
		now = time.Now
	}
	return Config{ChunkSize: chunk, Now: now}, nil
}

// WrittenAt is the time stored with a new object's rows, truncated to the
// microsecond every dialect keeps.
func (c Config) WrittenAt() time.Time { return c.Now().UTC().Truncate(time.Microsecond) }

// NewAddress returns a new address for an object of idem's name: the name,
// '.', and 16 random hex digits, so that two puts under one name (a
// completion retried by the caller with the same claim) never collide.
func NewAddress(name string) (string, error) {
	if !validName(name) {
		return "", errors.New("invalid object name")
	}
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return name + "." + hex.EncodeToString(b[:]), nil
}

func validName(name string) bool {
	if name == "" || len(name)+17 > MaxAddress {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'z') && c != '-' {
			return false
		}
	}
	return true
}

// ValidAddress reports whether a is an address NewAddress could have
// made: anything else (an address read from a damaged record, another
// store's) is not looked up, and does not exist.
func ValidAddress(a string) bool {
	if len(a) < 18 || len(a) > MaxAddress || a[len(a)-17] != '.' {
		return false
	}
	if _, err := hex.DecodeString(a[len(a)-16:]); err != nil {
		return false
	}
	return validName(a[:len(a)-17])
}

// ErrNotExist is Open's error for an address that names no object.
var ErrNotExist = fmt.Errorf("idem: no such body object: %w", fs.ErrNotExist)

// Write reads r to its end in chunks of c.ChunkSize bytes and calls insert
// for each, in order from seq 0; an empty body is one empty chunk. It
// stops at ctx's end and at the first error of r or insert.
func Write(ctx context.Context, c Config, r io.Reader, insert func(seq int64, data []byte) error) error {
	buf := make([]byte, c.ChunkSize)
	for seq := int64(0); ; seq++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		n, err := io.ReadFull(r, buf)
		last := errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)
		if err != nil && !last {
			return err
		}
		if n > 0 || seq == 0 {
			if err := insert(seq, buf[:n]); err != nil {
				return err
			}
		}
		if last {
			return nil
		}
	}
}

// Fetch reads row seq of the object into buf[:0] (or a new slice) and
// returns it; found is false when there is none. The reader passes back
// the buffer of the previous row, which it no longer reads.
type Fetch func(ctx context.Context, seq int64, buf []byte) (data []byte, found bool, err error)

// Open returns a reader of the object whose rows fetch reads, after
// checking that its row 0 exists (ErrNotExist otherwise). The reader
// fetches one row at a time, with ctx, and ends at the first missing row:
// an object deleted while it is read ends early, which the caller's length
// check catches.
func Open(ctx context.Context, fetch Fetch) (io.ReadCloser, error) {
	data, found, err := fetch(ctx, 0, nil)
	if err != nil {
		return nil, err
	}
	if !found {
		return nil, ErrNotExist
	}
	return &reader{ctx: ctx, fetch: fetch, buf: data, spare: data}, nil
}

// reader streams an object row by row. It keeps the ctx of Open, as an
// http.Request's Body does: the object is read within the caller's
// operation.
type reader struct {
	ctx   context.Context //nolint:containedctx // the reader's reads belong to the Open call's operation
	fetch Fetch
	seq   int64
	buf   []byte
	// spare is the whole of the row buf is a tail of, reused by the next fetch.
	spare  []byte
	done   bool
	closed bool
}

func (r *reader) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		if r.done || r.closed {
			return 0, io.EOF
		}
		r.seq++
		data, found, err := r.fetch(r.ctx, r.seq, r.spare)
		if err != nil {
			return 0, err
		}
		if !found {
			r.done = true
			return 0, io.EOF
		}
		r.buf, r.spare = data, data
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}

func (r *reader) Close() error {
	r.closed, r.buf, r.spare = true, nil, nil
	return nil
}

// List calls fn for each address page returns, page after page: page
// returns up to limit addresses greater than after (in order), so that the
// sweep never holds a cursor open while fn deletes.
func List(ctx context.Context, page func(ctx context.Context, after string, limit int) ([]string, error), fn func(string) error) error {
	const limit = 500
	after := ""
	for {
		addrs, err := page(ctx, after, limit)
		if err != nil {
			return err
		}
		for _, a := range addrs {
			if err := fn(a); err != nil {
				return err
			}
		}
		if len(addrs) < limit {
			return nil
		}
		after = addrs[len(addrs)-1]
	}
}
