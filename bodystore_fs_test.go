package idem_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// TestDirBodyStore: Put is content-addressed under idem's name, Open reads
// it back, an address from a damaged record cannot reach outside the
// directory, a failed Put leaves nothing List reports, and Delete of a
// missing object is not an error.
func TestDirBodyStore(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	bs, err := idem.NewDirBodyStore(filepath.Join(dir, "bodies"))
	require.NoError(t, err)

	addr, err := bs.Put(ctx, "0123456789abcdef-42", strings.NewReader("hello"))
	require.NoError(t, err)
	require.Equal(t, "0123456789abcdef-42.2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824", addr)
	rc, err := bs.Open(ctx, addr)
	require.NoError(t, err)
	got, err := io.ReadAll(rc)
	require.NoError(t, err)
	require.NoError(t, rc.Close())
	require.Equal(t, "hello", string(got))

	require.NoError(t, os.WriteFile(filepath.Join(dir, "secret"), []byte("x"), 0o600))
	for _, bad := range []string{"../secret", "/etc/passwd", ".tmp-x", "", "a b"} {
		_, err := bs.Open(ctx, bad)
		require.ErrorIs(t, err, fs.ErrNotExist, bad)
	}
	_, err = bs.Put(ctx, "../escape", strings.NewReader("x"))
	require.Error(t, err)

	boom := errors.New("reader failed")
	_, err = bs.Put(ctx, "0123456789abcdef-43", io.MultiReader(strings.NewReader("part"), errReader{boom}))
	require.ErrorIs(t, err, boom)
	var listed []string
	require.NoError(t, bs.List(ctx, time.Now().Add(time.Hour), func(a string) error { listed = append(listed, a); return nil }))
	require.Equal(t, []string{addr}, listed, "a failed put leaves no object")

	require.NoError(t, bs.Delete(ctx, addr))
	require.NoError(t, bs.Delete(ctx, addr))
	_, err = bs.Open(ctx, addr)
	require.ErrorIs(t, err, fs.ErrNotExist)
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// TestBodyStoreConfig: InlineBodyMax must lie within MaxResponseBytes, and
// a BodyRef is refused without a BodyStore.
func TestBodyStoreConfig(t *testing.T) {
	t.Parallel()
	d := newSQLiteDialect(t)
	bs, err := idem.NewDirBodyStore(t.TempDir())
	require.NoError(t, err)
	_, err = idem.New(d, &idem.Config{BodyStore: bs, InlineBodyMax: 2 << 20, MaxResponseBytes: 1 << 20})
	require.Error(t, err)
	_, err = idem.New(d, &idem.Config{BodyStore: bs, InlineBodyMax: -1})
	require.Error(t, err)
	s, err := idem.New(d, &idem.Config{BodyStore: bs, MaxResponseBytes: 1 << 10})
	require.NoError(t, err)
	require.Equal(t, 1<<10, s.BodyStoreThreshold(), "the default is clamped to MaxResponseBytes")
	plain, err := idem.New(d, nil)
	require.NoError(t, err)
	require.Equal(t, -1, plain.BodyStoreThreshold())
	rc, err := plain.OpenBody(context.Background(), &idem.Response{StatusCode: 200, Body: []byte("inline")})
	require.NoError(t, err)
	b, _ := io.ReadAll(rc)
	require.True(t, bytes.Equal([]byte("inline"), b))
}
