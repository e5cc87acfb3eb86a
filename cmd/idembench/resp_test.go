package main

import (
	"bufio"
	"context"
	"errors"
	"github.com/idemstore/idem/internal/workload"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/internal/testdb"
)

func TestAppendCommand(t *testing.T) {
	t.Parallel()
	got := appendCommand(nil, "SET", "k", "a\r\nb", "NX", "PX", "30000")
	require.Equal(t, "*6\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n$2\r\nNX\r\n$2\r\nPX\r\n$5\r\n30000\r\n", string(got))
	require.Equal(t, "*1\r\n$0\r\n\r\n", string(appendCommand(nil, "")))
}

func TestReadReply(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in      string
		want    []byte
		wantErr string // "" for none; otherwise a substring of the error
		redis   bool   // the error is the server's (a redisError)
	}{
		{in: "+OK\r\n", want: []byte("OK")},
		{in: "+\r\n", want: []byte{}},
		{in: ":42\r\n", want: []byte("42")},
		{in: "$5\r\nhello\r\n", want: []byte("hello")},
		{in: "$4\r\na\r\nb\r\n", want: []byte("a\r\nb")},
		{in: "$0\r\n\r\n", want: []byte{}},
		{in: "$-1\r\n", want: nil},
		{in: "-ERR unknown command\r\n", wantErr: "ERR unknown command", redis: true},
		{in: "*1\r\n$1\r\na\r\n", wantErr: "unsupported reply type"},
		{in: "$5\r\nhel", wantErr: "read bulk string"},
		{in: "$3\r\nabcde", wantErr: "not terminated"},
		{in: "$x\r\n", wantErr: "malformed bulk length"},
		{in: "+OK\n", wantErr: "malformed reply line"},
		{in: "", wantErr: "read reply"},
	} {
		got, err := readReply(bufio.NewReader(strings.NewReader(tc.in)))
		if tc.wantErr != "" {
			require.ErrorContains(t, err, tc.wantErr, "%q", tc.in)
			var re redisError
			require.Equal(t, tc.redis, errors.As(err, &re), "%q", tc.in)
			continue
		}
		require.NoError(t, err, "%q", tc.in)
		require.Equal(t, tc.want, got, "%q", tc.in)
	}
}

// testRedisAddr returns IDEM_TEST_REDIS_ADDR or the local default.
func testRedisAddr() string {
	if addr := os.Getenv("IDEM_TEST_REDIS_ADDR"); addr != "" {
		return addr
	}
	return "127.0.0.1:6379"
}

// redisAddr returns the test Redis, after checking that it answers: it
// skips the test when Redis is down, or fails it under CI or
// IDEM_TEST_REQUIRE_DB=1, where a skipped check must not pass as green.
func redisAddr(t *testing.T) string {
	t.Helper()
	addr := testRedisAddr()
	d := net.Dialer{Timeout: 2 * time.Second}
	conn, err := d.DialContext(t.Context(), "tcp", addr)
	if err == nil {
		_ = conn.Close()
		return addr
	}
	if testdb.Required() {
		t.Fatalf("Redis at %s is unreachable and CI or IDEM_TEST_REQUIRE_DB=1 requires it: %v", addr, err)
	}
	t.Skipf("Redis at %s is unreachable (%v); set IDEM_TEST_REDIS_ADDR, or IDEM_TEST_REQUIRE_DB=1 to fail instead of skipping", addr, err)
	return ""
}

func TestRedisClient(t *testing.T) {
	t.Parallel()
	c := newRedisClient(redisAddr(t), 4)
	t.Cleanup(c.Close)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	prefix := "idembench-test:" + workload.NewKey() + ":"
	t.Cleanup(func() {
		for _, k := range []string{"a", "ttl", "race", "bin"} {
			_, _ = c.do(context.WithoutCancel(ctx), "DEL", prefix+k)
		}
	})

	// SET NX: the first claimer wins, the second sees the key taken.
	ok, err := c.SetNX(ctx, prefix+"a", []byte("processing"), time.Minute)
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = c.SetNX(ctx, prefix+"a", []byte("other"), time.Minute)
	require.NoError(t, err)
	require.False(t, ok)
	got, err := c.Get(ctx, prefix+"a")
	require.NoError(t, err)
	require.Equal(t, "processing", string(got))

	// SET replaces, and binary values with CRLF inside round-trip.
	bin := []byte("line1\r\nline2\x00\xff")
	require.NoError(t, c.Set(ctx, prefix+"bin", bin, time.Minute))
	got, err = c.Get(ctx, prefix+"bin")
	require.NoError(t, err)
	require.Equal(t, bin, got)
	require.NoError(t, c.Set(ctx, prefix+"a", response.Body, time.Minute))
	got, err = c.Get(ctx, prefix+"a")
	require.NoError(t, err)
	require.Equal(t, response.Body, got)

	// A missing key is nil; PX is in milliseconds and expires the key.
	got, err = c.Get(ctx, prefix+"missing")
	require.NoError(t, err)
	require.Nil(t, got)
	ok, err = c.SetNX(ctx, prefix+"ttl", []byte("x"), 100*time.Millisecond)
	require.NoError(t, err)
	require.True(t, ok)
	pttl, err := c.do(ctx, "PTTL", prefix+"ttl")
	require.NoError(t, err)
	require.Regexp(t, `^(100|[1-9][0-9]?)$`, string(pttl))
	require.Eventually(t, func() bool {
		v, err := c.Get(ctx, prefix+"ttl")
		return err == nil && v == nil
	}, 5*time.Second, 20*time.Millisecond)

	// An error reply is an error, and the connection stays usable.
	_, err = c.do(ctx, "NOSUCHCOMMAND", "x")
	var re redisError
	require.ErrorAs(t, err, &re)
	got, err = c.Get(ctx, prefix+"bin")
	require.NoError(t, err)
	require.Equal(t, bin, got)

	// Concurrent SET NX on one key from the pool: exactly one wins.
	var (
		wg   sync.WaitGroup
		wins atomic.Int32
	)
	for range 20 {
		wg.Go(func() {
			ok, err := c.SetNX(ctx, prefix+"race", []byte("p"), time.Minute)
			if err != nil {
				t.Error(err)
			}
			if ok {
				wins.Add(1)
			}
		})
	}
	wg.Wait()
	require.Equal(t, int32(1), wins.Load())
}

func TestRedisClientDialError(t *testing.T) {
	t.Parallel()
	// A port nothing listens on: the listener is closed before the dial.
	l, err := (&net.ListenConfig{}).Listen(t.Context(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	c := newRedisClient(addr, 1)
	_, err = c.Get(t.Context(), "k")
	require.ErrorContains(t, err, "redis: dial")
}
