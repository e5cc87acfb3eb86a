package conformance

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// BodyStoreHarness gives the body-store cases ([RunBodyStore]) fresh body
// stores of one kind, with the hooks that play real faults on them. [Run]
// runs the cases on a DirBodyStore; an adapter in another module (an
// object store) runs them on its own with RunBodyStore.
type BodyStoreHarness interface {
	// Open returns a new, empty body store owned by t (registering its
	// cleanup on t), failing t on error.
	Open(ctx context.Context, t *testing.T) *BodyStoreFixture
}

// BodyStoreFixture is one body store opened by [BodyStoreHarness.Open].
type BodyStoreFixture struct {
	// Store is the body store the case's idem.Store is configured with.
	Store idem.BodyStore
	// Break makes Store fail every call, as a store that is down does (a
	// directory removed, a server's port closed), until Mend.
	Break func(t *testing.T)
	// Mend brings Store back after Break, with the objects it held.
	Mend func(t *testing.T)
	// Age makes List report every object Store holds now as written two
	// hours ago.
	Age func(t *testing.T)
	// Remove deletes the object at address by hand, bypassing idem.
	Remove func(ctx context.Context, t *testing.T, address string)
	// Rewrite replaces the object at address by hand, bypassing idem,
	// with edit's result on its bytes.
	Rewrite func(ctx context.Context, t *testing.T, address string, edit func([]byte) []byte)
	// PutBuffer is the memory one Put of Store holds by design, whatever
	// the body's size (an object store's multipart part): the large-body
	// case allows it on top of its bound. Zero for a store that streams.
	PutBuffer int64
}

// RunBodyStore runs the body-store cases, on h's dialect with the body
// stores of bh, as parallel subtests of t.
func RunBodyStore[TTx any](t *testing.T, h Harness[TTx], bh BodyStoreHarness) {
	t.Helper()
	run(t, h, bodyStoreCases[TTx](bh))
}

// dirBodyStores is the harness of DirBodyStore, the built-in store.
type dirBodyStores struct{}

func (dirBodyStores) Open(_ context.Context, t *testing.T) *BodyStoreFixture {
	t.Helper()
	bs, err := idem.NewDirBodyStore(t.TempDir())
	require.NoError(t, err)
	path := func(a string) string { return filepath.Join(bs.Dir(), a) }
	return &BodyStoreFixture{
		Store: bs,
		// The disk is gone.
		Break: func(t *testing.T) { require.NoError(t, os.RemoveAll(bs.Dir())) },
		Mend:  func(t *testing.T) { require.NoError(t, os.MkdirAll(bs.Dir(), 0o700)) },
		Age: func(t *testing.T) {
			old := time.Now().Add(-2 * time.Hour)
			for _, a := range listAll(t, bs) {
				require.NoError(t, os.Chtimes(path(a), old, old))
			}
		},
		Remove: func(_ context.Context, t *testing.T, a string) { require.NoError(t, os.Remove(path(a))) },
		Rewrite: func(_ context.Context, t *testing.T, a string, edit func([]byte) []byte) {
			data, err := os.ReadFile(path(a))
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(path(a), edit(data), 0o600))
		},
	}
}

// listAll returns every address bs lists.
func listAll(t *testing.T, bs idem.BodyStore) []string {
	t.Helper()
	var out []string
	require.NoError(t, bs.List(context.Background(), time.Now().Add(time.Hour), func(a string) error {
		out = append(out, a)
		return nil
	}))
	return out
}
