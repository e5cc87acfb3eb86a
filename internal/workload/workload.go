// Package workload is the business request that the Go benchmarks
// (internal/benchkit) and the load tool (cmd/idembench) both send, so that
// their figures compare: the same stored response, fingerprint, tenants and
// keys.
package workload

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"net/http"

	"github.com/idemstore/idem"
)

// Tenants is the number of scopes requests spread over, as in the lab
// measurements of issue 5.
const Tenants = 100

// Response is the answer every completion stores: 194 B of JSON.
var Response = &idem.Response{
	StatusCode: http.StatusCreated,
	Header:     http.Header{"Content-Type": {"application/json"}},
	Body: []byte(`{"id":"ord_7GQ2V9X4KD8M3N5P","tenant":"tenant-42","status":"confirmed",` +
		`"amount":{"value":"1999","currency":"EUR"},"created_at":"2025-11-30T11:41:07.123456Z",` +
		`"items":[{"sku":"SKU-1234","qty":2}]}`),
}

// Fingerprint is the fingerprint of the request Response answers.
var Fingerprint = idem.NewFingerprint([]byte("POST /orders"), Response.Body)

// Scopes are the Tenants scopes, "tenant-00" to "tenant-99".
var Scopes = func() []string {
	s := make([]string, Tenants)
	for i := range s {
		s[i] = fmt.Sprintf("tenant-%02d", i)
	}
	return s
}()

// NewKey returns a fresh random 128-bit key in hex.
func NewKey() string {
	var raw [16]byte
	binary.LittleEndian.PutUint64(raw[:8], rand.Uint64()) //nolint:gosec // G404: keys only need to be distinct
	binary.LittleEndian.PutUint64(raw[8:], rand.Uint64()) //nolint:gosec // G404: keys only need to be distinct
	return hex.EncodeToString(raw[:])
}

// Complete completes n keys through s.Do from 8 goroutines, each inserting
// one business row with insert (for the key's scope) and answering with
// Response, and returns the first error. key returns the i-th key. It is
// how the Go benchmarks and the load tool seed the records that replays
// read.
func Complete[TTx any](ctx context.Context, s *idem.Store[TTx], insert func(context.Context, TTx, string) error,
	n int, key func(i int) (scope, key string),
) error {
	const workers = 8
	errs := make(chan error, workers)
	for w := range workers {
		go func() {
			for i := w; i < n; i += workers {
				scope, k := key(i)
				_, err := s.Do(ctx, scope, k, Fingerprint, func(ctx context.Context, tx TTx) (*idem.Response, error) {
					return Response, insert(ctx, tx, scope)
				})
				if err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	var first error
	for range workers {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}
