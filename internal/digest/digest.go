// Package digest makes short, stable, non-reversible labels for keys and
// scopes, so logs and errors can tell records apart without revealing them.
package digest

import (
	"crypto/sha256"
	"encoding/hex"
)

// Key returns the first 8 bytes of SHA-256(scope NUL key) in hex (16 characters).
func Key(scope, key string) string {
	h := sha256.New()
	h.Write([]byte(scope))
	h.Write([]byte{0})
	h.Write([]byte(key))
	return hex.EncodeToString(h.Sum(nil)[:8])
}
