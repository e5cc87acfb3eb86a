// Package digest makes short, stable, non-reversible labels for keys and
// scopes, so logs and errors can tell records apart without revealing them.
package digest

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
)

// Size is the length of a key digest in bytes; its hex form has 2*Size characters.
const Size = 8

// Sum returns the first Size bytes of SHA-256(scope NUL key): the digest
// the databases store (migrations 00002 and 00003) and [Key] prints.
func Sum(scope, key string) [Size]byte {
	h := sha256.New()
	h.Write([]byte(scope))
	h.Write([]byte{0})
	h.Write([]byte(key))
	var out [Size]byte
	copy(out[:], h.Sum(nil))
	return out
}

// Key returns the first 8 bytes of SHA-256(scope NUL key) in hex (16 characters).
func Key(scope, key string) string {
	s := Sum(scope, key)
	return hex.EncodeToString(s[:])
}

// ErrMalformed is returned by [Parse] for anything but 16 hex digits.
var ErrMalformed = errors.New("a key digest is 16 hexadecimal digits")

// Parse reads a digest printed by [Key] (either case).
func Parse(s string) ([Size]byte, error) {
	var out [Size]byte
	if len(s) != 2*Size {
		return out, ErrMalformed
	}
	if _, err := hex.Decode(out[:], []byte(s)); err != nil {
		return out, ErrMalformed
	}
	return out, nil
}
