package sqlite_test

import (
	"math/rand/v2"
	"net/http"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/conformance"
	idemsqlite "github.com/idemstore/idem/sqlite"
)

// FuzzStoreBoundary puts arbitrary responses through Complete and replay
// (conformance.RoundTripResponse): each is either refused with
// idem.ErrInvalidResponse, storing nothing, or replayed exactly. The seed
// corpus runs as a normal test; go test -fuzz=FuzzStoreBoundary ./sqlite
// explores further.
func FuzzStoreBoundary(f *testing.F) {
	for _, seed := range []struct {
		status      int
		name, value string
		body        []byte
	}{
		{201, "Content-Type", "application/json", []byte(`{"id":1}`)},
		{200, "", "", nil},
		{0, "Location", "/orders/1", nil}, // the poisoned-key report
		{42, "X", "y", nil},
		{100, "X", "y", nil},
		{599, "X-Obs", "caf\xc3\xa9", []byte{0, 1, 2, 255}},
		{600, "X", "y", nil},
		{303, "Bad Name", "x", nil},
		{303, "X-Inject", "a\r\nSet-Cookie: s=1", nil},
		{303, "X-Nul", "a\x00b", nil},
		{303, "X-Latin1", "caf\xe9", nil},
		{303, "X-Sep", "\u2028<>&\"\\", nil},
		{200, "X-Big", "v", make([]byte, 4097)},
	} {
		f.Add(seed.status, seed.name, seed.value, seed.body, uint8(1), int64(0))
	}
	f.Add(201, "X", "v", []byte("x"), uint8(3), int64(7))

	ctx := f.Context()
	db, err := idemsqlite.Open(filepath.Join(f.TempDir(), "idem.db"))
	require.NoError(f, err)
	f.Cleanup(func() { _ = db.Close() })
	require.NoError(f, idemsqlite.Migrate(ctx, db))
	store, err := idem.New(idemsqlite.New(db), &idem.Config{MaxResponseBytes: 4096, MaxResponseHeaderBytes: 2048})
	require.NoError(f, err)

	f.Fuzz(func(t *testing.T, status int, name, value string, body []byte, repeat uint8, seed int64) {
		resp := &idem.Response{StatusCode: status, Body: body}
		if name != "" || value != "" {
			resp.Header = http.Header{name: {value}}
			for i := range int(repeat % 4) {
				resp.Header[name] = append(resp.Header[name], value[:len(value)*i/4])
			}
		}
		conformance.RoundTripResponse(t.Context(), t, store, "fuzz/op", resp)
		if seed != 0 {
			r := rand.New(rand.NewPCG(uint64(seed), 0)) //nolint:gosec // test data
			conformance.RoundTripResponse(t.Context(), t, store, "fuzz/op", conformance.RandomResponse(r, 4096))
		}
	})
}
