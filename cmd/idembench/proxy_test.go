package main

import (
	"bufio"
	"io"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// echoServer answers every chunk with itself until the client closes.
func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	t.Cleanup(func() { _ = ln.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return ln.Addr().String()
}

// pingTimes sends n one-byte pings over one connection to addr and
// returns each round trip's duration.
func pingTimes(t *testing.T, addr string, n int) []time.Duration {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.(*net.TCPConn).SetNoDelay(true))
	out := make([]time.Duration, n)
	var b [1]byte
	for i := range out {
		t0 := time.Now()
		_, err := c.Write(b[:])
		require.NoError(t, err)
		_, err = io.ReadFull(c, b[:])
		require.NoError(t, err)
		out[i] = time.Since(t0)
	}
	return out
}

func medianDur(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// TestProxyAddsTheRTT checks the delay the latency mode rests on: every
// ping through the proxy takes at least the RTT (each direction waits half
// of it after the data arrived), and the median takes no more than a
// tolerance above the proxy without delay, measured in alternating batches
// so that a change of the machine's load touches both alike. A wait
// rounded up to Go's timer granularity when idle (about a millisecond per
// direction) would exceed it at 200 µs.
func TestProxyAddsTheRTT(t *testing.T) {
	t.Parallel()
	echo := echoServer(t)
	zero, err := startProxy(echo, 0)
	require.NoError(t, err)
	defer zero.Close()
	for _, rtt := range []time.Duration{200 * time.Microsecond, time.Millisecond} {
		p, err := startProxy(echo, rtt)
		require.NoError(t, err)
		var base, times []time.Duration
		for range 6 {
			base = append(base, pingTimes(t, zero.Addr(), 50)...)
			times = append(times, pingTimes(t, p.Addr(), 50)...)
		}
		require.NoError(t, p.Close())
		require.GreaterOrEqual(t, slices.Min(times), rtt, "a ping through the %v proxy took less than the RTT", rtt)
		added := medianDur(times) - medianDur(base)
		t.Logf("rtt %v: median ping %v through the proxy without delay, %v added (%d pings each)", rtt, medianDur(base), added, len(times))
		require.LessOrEqual(t, added, rtt+rttTolerance(rtt), "the %v proxy added a median %v to a ping", rtt, added)
	}
}

// rttTolerance is how far above the asked RTT the median added RTT may be
// on a machine whose 2 cores other processes load: a wake-up of the
// waiting goroutine may wait for a core.
func rttTolerance(rtt time.Duration) time.Duration { return max(rtt/2, 250*time.Microsecond) }

// lineServer answers every line with "ok\n", as a database answers every
// complete statement however it was split into segments.
func lineServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	t.Cleanup(func() { _ = ln.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					if _, err := r.ReadString('\n'); err != nil {
						return
					}
					if _, err := c.Write([]byte("ok\n")); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// TestProxyCountsTurns checks the round-trip count: one turn per time the
// client waits for an answer, however its request was split into TCP
// segments, and one for requests pipelined in one write.
func TestProxyCountsTurns(t *testing.T) {
	t.Parallel()
	p, err := startProxy(lineServer(t), 0)
	require.NoError(t, err)
	defer p.Close()
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.(*net.TCPConn).SetNoDelay(true))
	exchange := func(answers int, parts ...string) {
		t.Helper()
		for _, s := range parts {
			_, err := c.Write([]byte(s))
			require.NoError(t, err)
			time.Sleep(2 * time.Millisecond) // separate segments
		}
		_, err := io.ReadFull(c, make([]byte, 3*answers))
		require.NoError(t, err)
	}
	for range 5 {
		exchange(1, "SELECT 1\n")
	}
	require.Equal(t, int64(5), p.Turns())
	exchange(1, "INSERT INTO orders ", "VALUES (1)", "\n") // one statement in three segments
	require.Equal(t, int64(6), p.Turns())
	exchange(3, "BEGIN\nINSERT\nCOMMIT\n") // three pipelined in one write
	require.Equal(t, int64(7), p.Turns())
}
