package idemgrpc_test

import (
	"database/sql"
	"os"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemstore/idem"
)

// TestReplayFromBodyStore: with every stored message kept in a BodyStore,
// a replay answers the stored message (read back and checked), not the
// empty inline body; an object deleted by hand answers Internal.
func TestReplayFromBodyStore(t *testing.T) {
	dialects(t, testReplayFromBodyStore[*sql.Tx], testReplayFromBodyStore[pgx.Tx])
}

func testReplayFromBodyStore[TTx any](t *testing.T, h harness[TTx]) {
	dir := t.TempDir()
	bs, err := idem.NewDirBodyStore(dir)
	require.NoError(t, err)
	b := setup(t, h, options{idemCfg: &idem.Config{BodyStore: bs, InlineBodyMax: 1}})
	key := newKey()
	first := b.call(t, methodCreate, key, map[string]any{"amount": 42}, "x-tenant", "tenant-secret")
	require.NoError(t, first.err)
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "the message is in the body store")

	again := b.call(t, methodCreate, key, map[string]any{"amount": 42}, "x-tenant", "tenant-secret")
	require.NoError(t, again.err)
	require.True(t, again.replayed())
	require.True(t, proto.Equal(first.resp, again.resp), "the replay is the stored message: %v vs %v", first.resp, again.resp)

	require.NoError(t, os.Remove(filepath.Join(dir, entries[0].Name())))
	gone := b.call(t, methodCreate, key, map[string]any{"amount": 42}, "x-tenant", "tenant-secret")
	require.Equal(t, codes.Internal, status.Code(gone.err))
	require.EqualValues(t, 1, b.calls.Load())
}
