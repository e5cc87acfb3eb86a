package main

// A minimal Redis client, for the redis scenario only.
//
// It speaks just enough RESP2 for the "SET NX" idempotency pattern (SET with
// NX and PX, GET, and INFO for the server version) over a small pool of
// net.Conn. It is written here, with the standard library, instead of
// importing a Redis client, because idem is a single module: a dependency of
// this tool would land in the go.mod that every user of the library
// resolves, for a benchmark baseline that the library itself never needs.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"
)

// redisError is an error reply of the server ("-ERR ...").
type redisError string

func (e redisError) Error() string { return "redis: " + string(e) }

// redisClient sends commands on pooled connections. It is safe for
// concurrent use: each command takes a connection from the pool, or dials a
// new one, and puts it back unless the exchange failed.
type redisClient struct {
	addr string
	idle chan *redisConn
}

type redisConn struct {
	nc  net.Conn
	r   *bufio.Reader
	buf []byte // the command being encoded, reused
}

// newRedisClient returns a client for addr keeping up to size idle
// connections. It dials nothing until the first command.
func newRedisClient(addr string, size int) *redisClient {
	return &redisClient{addr: addr, idle: make(chan *redisConn, size)}
}

// Close closes the idle connections.
func (c *redisClient) Close() {
	for {
		select {
		case rc := <-c.idle:
			_ = rc.nc.Close()
		default:
			return
		}
	}
}

// do sends one command and returns its reply: a simple or bulk string
// (nil for a nil bulk string), or the decimal text of an integer. An error
// reply is returned as a redisError, and leaves the connection usable.
func (c *redisClient) do(ctx context.Context, args ...string) ([]byte, error) {
	var rc *redisConn
	select {
	case rc = <-c.idle:
	default:
		var d net.Dialer
		nc, err := d.DialContext(ctx, "tcp", c.addr)
		if err != nil {
			return nil, fmt.Errorf("redis: dial: %w", err)
		}
		rc = &redisConn{nc: nc, r: bufio.NewReader(nc)}
	}
	// The deadline, not a goroutine watching ctx, bounds the exchange: the
	// cheapest way to honour a context deadline on a net.Conn.
	deadline, _ := ctx.Deadline()
	_ = rc.nc.SetDeadline(deadline)
	rc.buf = appendCommand(rc.buf[:0], args...)
	var reply []byte
	_, err := rc.nc.Write(rc.buf)
	if err == nil {
		reply, err = readReply(rc.r)
	}
	var re redisError
	if err != nil && !errors.As(err, &re) {
		_ = rc.nc.Close() // a half-read reply would poison the next command
		return nil, err
	}
	select {
	case c.idle <- rc:
	default:
		_ = rc.nc.Close()
	}
	return reply, err
}

// SetNX stores val at key with a time to live unless the key exists, and
// reports whether it did (SET key val NX PX ttl).
func (c *redisClient) SetNX(ctx context.Context, key string, val []byte, ttl time.Duration) (bool, error) {
	reply, err := c.do(ctx, "SET", key, string(val), "NX", "PX", strconv.FormatInt(ttl.Milliseconds(), 10))
	return reply != nil, err
}

// Set stores val at key with a time to live (SET key val PX ttl).
func (c *redisClient) Set(ctx context.Context, key string, val []byte, ttl time.Duration) error {
	_, err := c.do(ctx, "SET", key, string(val), "PX", strconv.FormatInt(ttl.Milliseconds(), 10))
	return err
}

// Get returns the value at key, or nil when there is none.
func (c *redisClient) Get(ctx context.Context, key string) ([]byte, error) {
	return c.do(ctx, "GET", key)
}

// appendCommand appends args to b as a RESP array of bulk strings.
func appendCommand(b []byte, args ...string) []byte {
	b = append(b, '*')
	b = strconv.AppendInt(b, int64(len(args)), 10)
	b = append(b, '\r', '\n')
	for _, a := range args {
		b = append(b, '$')
		b = strconv.AppendInt(b, int64(len(a)), 10)
		b = append(b, '\r', '\n')
		b = append(b, a...)
		b = append(b, '\r', '\n')
	}
	return b
}

// readReply reads one reply that is not an array (the commands above never
// get one).
func readReply(r *bufio.Reader) ([]byte, error) {
	line, err := r.ReadSlice('\n')
	if err != nil {
		return nil, fmt.Errorf("redis: read reply: %w", err)
	}
	if len(line) < 3 || line[len(line)-2] != '\r' {
		return nil, fmt.Errorf("redis: malformed reply line %q", line)
	}
	kind, body := line[0], line[1:len(line)-2]
	switch kind {
	case '+', ':':
		return append([]byte{}, body...), nil
	case '-':
		return nil, redisError(body)
	case '$':
		n, err := strconv.Atoi(string(body))
		if err != nil || n < -1 {
			return nil, fmt.Errorf("redis: malformed bulk length %q", body)
		}
		if n == -1 {
			return nil, nil
		}
		val := make([]byte, n+2)
		if _, err := io.ReadFull(r, val); err != nil {
			return nil, fmt.Errorf("redis: read bulk string: %w", err)
		}
		if val[n] != '\r' || val[n+1] != '\n' {
			return nil, errors.New("redis: bulk string not terminated by CRLF")
		}
		return val[:n:n], nil
	default:
		return nil, fmt.Errorf("redis: unsupported reply type %q", kind)
	}
}
