package main

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// rttSetting is one value of -rtt: the servers reached directly, or
// through a proxy adding rtt to every round trip (0: the proxy's own cost,
// the column every delay is read against).
type rttSetting struct {
	direct bool
	rtt    time.Duration
}

func (r rttSetting) String() string {
	switch {
	case r.direct:
		return "direct"
	case r.rtt == 0:
		return "proxy0"
	default:
		return r.rtt.String() // as given: 200µs, 1ms
	}
}

// parseRTTs parses -rtt: comma-separated "direct" or durations ("0",
// "200us", "1ms").
func parseRTTs(list string) ([]rttSetting, error) {
	var out []rttSetting
	for _, f := range strings.Split(list, ",") {
		f = strings.TrimSpace(f)
		var r rttSetting
		switch f {
		case "direct":
			r.direct = true
		case "0":
		default:
			d, err := time.ParseDuration(f)
			if err != nil || d < 0 || d > time.Second {
				return nil, fmt.Errorf("-rtt: %q is neither direct nor a duration from 0 to 1s", f)
			}
			r.rtt = d
		}
		for _, seen := range out {
			if seen == r {
				return nil, fmt.Errorf("-rtt: %q given twice", f)
			}
		}
		out = append(out, r)
	}
	return out, nil
}

// proxy is a TCP proxy on loopback in front of one server, adding a fixed
// round-trip time: every chunk read from either side is written to the
// other half the RTT after it arrived, without holding back the chunks
// behind it (a link's latency, not a bandwidth limit). Both directions of
// a connection run in goroutines of their own, with and without a delay
// alike, so that the proxy with no delay costs the CPU the delayed ones
// do, and the difference between them is the delay alone.
//
// It counts round trips: request-response turns, a turn being data from
// the client after data from the server (or the connection's first), so
// that a statement split into several TCP segments, or several statements
// pipelined in one write, still count as what they are on the network.
type proxy struct {
	ln     net.Listener
	target string
	half   time.Duration

	turns atomic.Int64

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// startProxy listens on a free loopback port and proxies to target,
// adding rtt to each round trip.
func startProxy(target string, rtt time.Duration) (*proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("proxy: %w", err)
	}
	p := &proxy{ln: ln, target: target, half: rtt / 2, conns: make(map[net.Conn]struct{})}
	p.wg.Go(p.accept)
	return p, nil
}

// Addr is the address clients dial instead of the target's.
func (p *proxy) Addr() string { return p.ln.Addr().String() }

// HostPort splits Addr.
func (p *proxy) HostPort() (string, uint16) {
	host, port, _ := net.SplitHostPort(p.Addr())
	n, _ := strconv.ParseUint(port, 10, 16)
	return host, uint16(n)
}

// Turns is the number of round trips so far, over all connections.
func (p *proxy) Turns() int64 { return p.turns.Load() }

// Close stops accepting, closes every connection and waits for the
// proxy's goroutines.
func (p *proxy) Close() error {
	err := p.ln.Close()
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
	return err
}

func (p *proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

func (p *proxy) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		p.wg.Go(func() { p.serve(client) })
	}
}

// serve proxies one connection until either side closes it.
func (p *proxy) serve(client net.Conn) {
	if !p.track(client) {
		_ = client.Close()
		return
	}
	defer p.untrack(client)
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		_ = client.Close()
		return
	}
	if !p.track(server) {
		_ = client.Close()
		_ = server.Close()
		return
	}
	defer p.untrack(server)
	for _, c := range []net.Conn{client, server} {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetNoDelay(true)
		}
	}
	var serverSpoke atomic.Bool
	serverSpoke.Store(true) // the client's first data opens a turn
	var wg sync.WaitGroup
	wg.Go(func() {
		p.pipe(server, client, func() {
			if serverSpoke.Swap(false) {
				p.turns.Add(1)
			}
		})
	})
	wg.Go(func() { p.pipe(client, server, func() { serverSpoke.Store(true) }) })
	wg.Wait()
}

// chunk is data read at a time, to be written half an RTT later.
type chunk struct {
	buf  *[]byte
	n    int
	read time.Time
}

var chunkBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// pipe copies src to dst, each chunk half an RTT after it was read, and
// calls onRead for each chunk read. When either side fails, both close.
func (p *proxy) pipe(dst, src net.Conn, onRead func()) {
	queue := make(chan chunk, 256)
	var wg sync.WaitGroup
	wg.Go(func() {
		defer close(queue)
		for {
			buf := chunkBufs.Get().(*[]byte)
			n, err := src.Read(*buf)
			if n > 0 {
				onRead()
				queue <- chunk{buf: buf, n: n, read: time.Now()}
			} else {
				chunkBufs.Put(buf)
			}
			if err != nil {
				return
			}
		}
	})
	w := newWaiter()
	defer w.close()
	failed := false
	for c := range queue {
		if !failed {
			if p.half > 0 {
				w.until(c.read.Add(p.half))
			}
			if _, err := dst.Write((*c.buf)[:c.n]); err != nil {
				failed = true
				_ = src.Close() // unblocks the reader
			}
		}
		chunkBufs.Put(c.buf)
	}
	wg.Wait()
	// One side is gone: the database clients here never half-close, so
	// the connection ends, and the other direction's reader with it.
	_ = dst.Close()
	_ = src.Close()
}
