package idemclient

import (
	"context"
	"crypto/rand"
	"fmt"
)

// keyContextKey is the context key of WithKey.
type keyContextKey struct{}

// WithKey returns a context that makes the [Transport] send key as the
// idempotency key of the request made with it, instead of a new random key.
// Use it when the key must outlive the process (stored with the business
// intent, so that a restarted caller retries with the same key), or when it
// is derived from something the caller already has (an order number).
// A key set in the request's header takes precedence.
func WithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyContextKey{}, key)
}

// KeyFromContext returns the key WithKey put in ctx, if any.
func KeyFromContext(ctx context.Context) (string, bool) {
	key, ok := ctx.Value(keyContextKey{}).(string)
	return key, ok && key != ""
}

// NewKey returns a new random key: a version 4 UUID in its usual text form
// (36 characters of hex digits and hyphens), which idemhttp's default key
// format accepts, as do other servers of the protocol. It fails only if the
// system's random source does.
func NewKey() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("idemclient: new key: %w", err)
	}
	b[6] = b[6]&0x0f | 0x40 // version 4
	b[8] = b[8]&0x3f | 0x80 // RFC 9562 variant
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}
