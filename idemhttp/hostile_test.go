package idemhttp_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
)

// Scenario 4 of issue 6, hostile input at the HTTP layer: keys and bodies a
// client (or a proxy, or an attacker) may send, written byte for byte on a
// TCP connection to a real server, so nothing on the client side cleans
// them up. Every one must get a clear 4xx, in bounded time, reading a
// bounded part of the body, with no handler run and nothing stored.

// hostileLimit is MaxBodyBytes in these tests: the default, since the
// defaults are what most services run.
const hostileLimit = 1 << 20

// hostileTimeBound is how long one hostile request may take, race detector
// and a busy machine included; the requests take milliseconds normally.
const hostileTimeBound = 5 * time.Second

// hostileCase is one hostile request and the answer it must get.
type hostileCase struct {
	name string
	// key is the Idempotency-Key header lines, written as they are.
	key []string
	// fresh sends a new valid key instead, so that a record for it could
	// only come from this case.
	fresh bool
	// head is extra header lines ("Name: value"); Content-Type JSON, the
	// tenant and Content-Length (unless head sets Transfer-Encoding or
	// declared is set) are added.
	head []string
	body []byte
	// declared, when set, is the Content-Length sent instead of len(body).
	declared int
	// halfClose closes the client's side of the connection after the body,
	// as a client that dies mid-body does.
	halfClose bool
	status    int
	// code is the middleware's error code; "" when net/http itself refuses
	// the request before any handler runs (its 400 is plain text).
	code string
}

// hostileCases lists the scenario in a fixed order.
func hostileCases() []hostileCase {
	deepArrays := strings.Repeat("[", 100_000) + strings.Repeat("]", 100_000)
	deepObjects := strings.Repeat(`{"a":`, 100_000) + "1" + strings.Repeat("}", 100_000)
	order := gzipBytes([]byte(`{"amount":42}`))
	bomb := gzipBomb()
	return []hostileCase{
		{name: "key missing", status: http.StatusBadRequest, code: idemhttp.CodeKeyMissing},
		{name: "key with NUL", key: []string{"abcdefghij\x00kl"}, status: http.StatusBadRequest},
		{name: "key with C0 control", key: []string{"abcdefghij\x01kl"}, status: http.StatusBadRequest},
		{name: "key with DEL", key: []string{"abcdefghijkl\x7f"}, status: http.StatusBadRequest},
		{name: "key with tab inside", key: []string{"abcdef\tghijkl"}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "key with C1 control", key: []string{"abcdef\u0085ghijkl"}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "key with invalid UTF-8", key: []string{"abcdefghijkl\xff\xfe"}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "key in Cyrillic", key: []string{"ключ-идемпотентности"}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "key with emoji and RTL mark", key: []string{"order-\u200f-\U0001F4A9-123456"}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "key of 10 KB", key: []string{strings.Repeat("k", 10<<10)}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "key of 10 KB quoted", key: []string{`"` + strings.Repeat("k", 10<<10) + `"`}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "key on two lines", key: []string{"abcdefghijkl", "abcdefghijkm"}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "key on two identical lines", key: []string{"abcdefghijkl", "abcdefghijkl"}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "keys joined by a comma", key: []string{"abcdefghijkl, abcdefghijkm"}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "key as SQL injection", key: []string{"x'); DROP TABLE idempotency_keys; --"}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "key as quoted SQL injection", key: []string{`"abc' OR '1'='1"`}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},
		{name: "key as LIKE wildcard", key: []string{"%%%%%%%%%%%%"}, status: http.StatusBadRequest, code: idemhttp.CodeKeyInvalid},

		{name: "body of 2 MiB, declared", fresh: true, body: bytes.Repeat([]byte(" "), 2<<20),
			status: http.StatusRequestEntityTooLarge, code: idemhttp.CodeBodyTooLarge},
		{name: "body of 4 MiB, chunked", fresh: true, head: []string{"Transfer-Encoding: chunked"}, body: chunked(bytes.Repeat([]byte(" "), 4<<20)),
			status: http.StatusRequestEntityTooLarge, code: idemhttp.CodeBodyTooLarge},
		{name: "body shorter than Content-Length, connection closed", fresh: true, body: []byte(`{"amount":`), declared: 1000, halfClose: true,
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "chunked body cut off, connection closed", fresh: true, head: []string{"Transfer-Encoding: chunked"}, body: []byte("a\r\n{\"amount\":"), halfClose: true,
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "gzip that is not gzip", fresh: true, head: []string{"Content-Encoding: gzip"}, body: []byte(`{"amount":42}`),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "gzip cut in half", fresh: true, head: []string{"Content-Encoding: gzip"}, body: order[:len(order)/2],
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "gzip with a bad checksum", fresh: true, head: []string{"Content-Encoding: gzip"}, body: corruptCRC(order),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "gzip bomb, 64 MiB from 64 KB", fresh: true, head: []string{"Content-Encoding: gzip"}, body: bomb,
			status: http.StatusRequestEntityTooLarge, code: idemhttp.CodeBodyTooLarge},
		{name: "gzip bomb as x-gzip, chunked", fresh: true, head: []string{"Content-Encoding: x-gzip", "Transfer-Encoding: chunked"}, body: chunked(bomb),
			status: http.StatusRequestEntityTooLarge, code: idemhttp.CodeBodyTooLarge},
		{name: "invalid UTF-8 outside strings", fresh: true, body: []byte("\xff\xfe{\"amount\":1}"),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "Unicode space labelled JSON", fresh: true, body: []byte("\u00a0\u0085"),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "UTF-16 body labelled JSON", fresh: true, body: []byte("\xff\xfe{\x00\"\x00a\x00\"\x00:\x001\x00}\x00"),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "JSON arrays nested 100 000 deep", fresh: true, body: []byte(deepArrays),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "JSON objects nested 100 000 deep", fresh: true, body: []byte(deepObjects),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "JSON nested 100 000 deep, gzip", fresh: true, head: []string{"Content-Encoding: gzip"}, body: gzipBytes([]byte(deepArrays)),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "JSON number of 10 000 digits, cut", fresh: true, body: []byte(`{"amount":` + strings.Repeat("9", 10_000)),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "JSON number of 10 000 digits, malformed", fresh: true, body: []byte(`{"amount":` + strings.Repeat("9", 10_000) + `e}`),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "JSON with SQL injection, unterminated", fresh: true, body: []byte(`{"amount":1,"note":"'); DROP TABLE idempotency_keys; --}`),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
		{name: "two JSON values", fresh: true, body: []byte(`{"amount":1}{"amount":2}`),
			status: http.StatusBadRequest, code: idemhttp.CodeBodyInvalid},
	}
}

// TestHostileInput sends every hostile case to the middleware over a real
// server on every dialect, and prints the figures of docs/reliability.md
// (run with -v).
func TestHostileInput(t *testing.T) {
	t.Parallel()
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		testHostile(t, harness[*sqlTx](sqliteHarness{}))
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		testHostile(t, harness[pgxTx](newPGHarness(t)))
	})
	t.Run("mariadb", func(t *testing.T) {
		t.Parallel()
		testHostile(t, harness[*sqlTx](newMySQLHarness(t)))
	})
}

// bodyMeter counts, per request, the body bytes the middleware read from
// the connection by the time it answered: the measure of the memory a
// request can make it hold, which heap statistics would blur.
type bodyMeter struct {
	mu   sync.Mutex
	read map[string]int64 // by X-Case
}

// wrap counts what next reads of each request's body; the count is taken
// when next writes the response header, before the client can see it.
func (m *bodyMeter) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c := &countingReader{r: r.Body}
		r.Body = c
		next.ServeHTTP(&meteredWriter{ResponseWriter: w, onHeader: func() {
			m.mu.Lock()
			defer m.mu.Unlock()
			m.read[r.Header.Get("X-Case")] = c.n.Load()
		}}, r)
	})
}

func (m *bodyMeter) get(name string) (int64, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, ok := m.read[name]
	return n, ok
}

type countingReader struct {
	r io.ReadCloser
	n atomic.Int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n.Add(int64(n))
	return n, err
}

func (c *countingReader) Close() error { return c.r.Close() }

type meteredWriter struct {
	http.ResponseWriter
	once     sync.Once
	onHeader func()
}

func (w *meteredWriter) WriteHeader(code int) {
	w.once.Do(w.onHeader)
	w.ResponseWriter.WriteHeader(code)
}

func (w *meteredWriter) Write(p []byte) (int, error) {
	w.once.Do(w.onHeader)
	return w.ResponseWriter.Write(p)
}

// hostileFigures are one dialect's figures for docs/reliability.md.
type hostileFigures struct {
	requests, handlerRuns, records, orders int
	answers                                map[string]int // "400 idempotency_key_invalid"
	maxRead                                int64
	slowest                                time.Duration
}

func testHostile[TTx any](t *testing.T, h harness[TTx]) {
	meter := &bodyMeter{read: map[string]int64{}}
	b := setup(t, h, options[TTx]{outer: meter.wrap})
	ctx := t.Context()
	fig := hostileFigures{answers: map[string]int{}}
	for i, c := range hostileCases() {
		caseID := strconv.Itoa(i)
		key := c.key
		if c.fresh {
			key = []string{newKey()}
		}
		start := time.Now()
		rep, err := rawExchange(b.srv.Listener.Addr().String(), hostileRequest(c, caseID, key), c.halfClose)
		elapsed := time.Since(start)
		require.NoError(t, err, c.name)
		fig.requests++
		fig.slowest = max(fig.slowest, elapsed)

		require.Equal(t, c.status, rep.status, "%s: %s", c.name, rep.body)
		answer := strconv.Itoa(rep.status)
		if c.code != "" {
			require.Equal(t, c.code, rep.code(t), c.name)
			require.NotEmpty(t, rep.header.Get("X-Request-Id"), c.name)
			answer += " " + c.code
		} else {
			answer += " (net/http)"
		}
		fig.answers[answer]++
		require.Less(t, elapsed, hostileTimeBound, c.name)
		if n, ok := meter.get(caseID); ok { // net/http's own refusals never reach the middleware
			require.LessOrEqual(t, n, int64(hostileLimit+1), "%s: the middleware read more of the body than MaxBodyBytes", c.name)
			fig.maxRead = max(fig.maxRead, n)
		} else {
			require.Empty(t, c.code, "%s: the middleware answered without being metered", c.name)
		}
		require.Zero(t, b.calls.Load(), "%s: the handler ran", c.name)
		require.Zero(t, b.records(t), "%s: a record was stored", c.name)
		if len(key) == 1 && validKey(key[0]) {
			_, err := b.store.Get(ctx, "t1 POST /orders", key[0])
			require.ErrorIs(t, err, idem.ErrNotFound, c.name)
		}
	}
	fig.handlerRuns = int(b.calls.Load())
	fig.records = b.records(t)
	fig.orders = b.orders(t)

	// The server is still healthy: a valid request right after all that.
	r := b.post(t, newKey(), `{"amount":1}`)
	require.Equal(t, http.StatusCreated, r.status)
	require.Equal(t, 1, b.records(t))

	answers := make([]string, 0, len(fig.answers))
	for a, n := range fig.answers {
		answers = append(answers, fmt.Sprintf("%s: %d", a, n))
	}
	slices.Sort(answers)
	t.Logf("hostile-input figures: dialect=%s requests=%d handler_runs=%d records_stored=%d business_rows=%d duplicates=0 max_body_bytes_read=%d (limit %d) slowest=%s answers={%s}",
		h.name(), fig.requests, fig.handlerRuns, fig.records, fig.orders, fig.maxRead, hostileLimit, fig.slowest.Round(time.Millisecond), strings.Join(answers, ", "))
}

func validKey(k string) bool { return idemhttp.DefaultKeyFormat.MatchString(k) }

// hostileRequest writes c as an HTTP/1.1 request, byte for byte.
func hostileRequest(c hostileCase, caseID string, key []string) []byte {
	var buf bytes.Buffer
	buf.WriteString("POST /orders HTTP/1.1\r\nHost: idem.test\r\nConnection: close\r\nContent-Type: application/json\r\nX-Tenant: t1\r\n")
	buf.WriteString("X-Case: " + caseID + "\r\n")
	for _, k := range key {
		buf.WriteString("Idempotency-Key: " + k + "\r\n")
	}
	te := false
	for _, h := range c.head {
		buf.WriteString(h + "\r\n")
		te = te || strings.HasPrefix(h, "Transfer-Encoding:")
	}
	switch {
	case c.declared > 0:
		buf.WriteString("Content-Length: " + strconv.Itoa(c.declared) + "\r\n")
	case !te:
		buf.WriteString("Content-Length: " + strconv.Itoa(len(c.body)) + "\r\n")
	}
	buf.WriteString("\r\n")
	buf.Write(c.body)
	return buf.Bytes()
}

// rawExchange writes req on a new connection to addr (from another
// goroutine, since a server that refuses a large body stops reading it) and
// reads the response. halfClose shuts the writing side after the request.
func rawExchange(addr string, req []byte, halfClose bool) (*reply, error) {
	conn, err := (&net.Dialer{}).DialContext(context.Background(), "tcp", addr)
	if err != nil {
		return nil, err
	}
	if err := conn.SetDeadline(time.Now().Add(20 * time.Second)); err != nil {
		_ = conn.Close()
		return nil, err
	}
	written := make(chan struct{})
	go func() {
		defer close(written)
		if _, err := conn.Write(req); err != nil {
			return // the server answered and closed before reading it all
		}
		if halfClose {
			_ = conn.(*net.TCPConn).CloseWrite()
		}
	}()
	defer func() { _ = conn.Close(); <-written }()
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) {
		return nil, err
	}
	return &reply{status: resp.StatusCode, header: resp.Header, body: body}, nil
}

// chunked encodes data with Transfer-Encoding chunked, in 32 KiB chunks.
func chunked(data []byte) []byte {
	var buf bytes.Buffer
	for len(data) > 0 {
		n := min(len(data), 32<<10)
		fmt.Fprintf(&buf, "%x\r\n", n)
		buf.Write(data[:n])
		buf.WriteString("\r\n")
		data = data[n:]
	}
	buf.WriteString("0\r\n\r\n")
	return buf.Bytes()
}

// corruptCRC returns a gzip stream whose trailer checksum is wrong.
func corruptCRC(z []byte) []byte {
	out := bytes.Clone(z)
	out[len(out)-8] ^= 0xff
	return out
}

// gzipBomb is 64 MiB of zeros in about 64 KB: 64 gzip members of 1 MiB
// each, one after the other, which a gzip reader decodes as one stream
// (RFC 1952 section 2.2), so it is cheap to build.
var gzipBomb = sync.OnceValue(func() []byte {
	return bytes.Repeat(gzipBytes(make([]byte, 1<<20)), 64)
})

// TestHostileKeysAreDataNotSQL: with a KeyFormat that lets anything
// through, keys and bodies that look like SQL are stored and matched as the
// bytes they are, on every dialect: the statements are parameterised.
func TestHostileKeysAreDataNotSQL(t *testing.T) {
	t.Parallel()
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		testKeysAreData(t, harness[*sqlTx](sqliteHarness{}))
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		testKeysAreData(t, harness[pgxTx](newPGHarness(t)))
	})
	t.Run("mariadb", func(t *testing.T) {
		t.Parallel()
		testKeysAreData(t, harness[*sqlTx](newMySQLHarness(t)))
	})
}

func testKeysAreData[TTx any](t *testing.T, h harness[TTx]) {
	b := setup(t, h, options[TTx]{})
	anything := b.with(idemhttp.Config{KeyFormat: regexp.MustCompile(`^.+$`)}, nil)
	body := `{"amount":7,"note":"'); DELETE FROM orders; --"}`
	keys := []string{
		"x'); DROP TABLE idempotency_keys; --",
		`x" OR "1"="1`,
		"%",
		"_",
		`\`,
		"ключ-идемпотентности",
		strings.Repeat("k", idem.MaxKeyLength),
	}
	for _, k := range keys {
		r := b.direct(t, anything, k, body)
		require.Equal(t, http.StatusCreated, r.status, "%q: %s", k, r.body)
		again := b.direct(t, anything, k, body)
		require.True(t, again.replayed(), "%q", k)
		require.Equal(t, r.body, again.body)
		rec, err := b.store.Get(t.Context(), "t1 POST /orders", k)
		require.NoError(t, err, "%q", k)
		require.Equal(t, k, rec.Key, "stored byte for byte")
	}
	// The wildcards matched nothing but themselves.
	require.Equal(t, len(keys), b.records(t))
	require.Equal(t, len(keys), b.orders(t))
	r := b.direct(t, anything, strings.Repeat("k", idem.MaxKeyLength+1), body)
	require.Equal(t, http.StatusBadRequest, r.status, "longer than idem.MaxKeyLength, whatever the format")
	require.Equal(t, idemhttp.CodeKeyInvalid, r.code(t))
	assert.Equal(t, len(keys), b.records(t))
}

// TestHostileInputMemory measures the bytes the middleware allocates for a
// request whose body is endless or a gzip bomb: bounded by MaxBodyBytes
// (plus buffer growth), not by what the client sends. Allocation counts are
// process-wide, so this test does not run in parallel with the others;
// TotalAlloc only grows, so a garbage collection cannot hide anything.
func TestHostileInputMemory(t *testing.T) { // not parallel: it measures process-wide allocations
	store := newSQLiteStore(t)
	var calls atomic.Int64
	mw := mustNew(t, store, &idemhttp.Config{Tenant: testTenant}).Wrap(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { calls.Add(1); w.WriteHeader(http.StatusNoContent) }))
	const sent = 64 << 20
	for _, c := range []struct {
		name   string
		body   func() io.Reader
		coding string
	}{
		{"64 MiB sent, no Content-Length", func() io.Reader { return io.LimitReader(zeros{}, sent) }, ""},
		{"gzip bomb decoding to 64 MiB", func() io.Reader { return bytes.NewReader(gzipBomb()) }, "gzip"},
	} {
		r := httptest.NewRequestWithContext(t.Context(), http.MethodPost, "/orders", c.body())
		r.ContentLength = -1
		r.Header.Set("Idempotency-Key", newKey())
		r.Header.Set("X-Tenant", "t1")
		r.Header.Set("Content-Type", "application/json")
		if c.coding != "" {
			r.Header.Set("Content-Encoding", c.coding)
		}
		rec := httptest.NewRecorder()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		mw.ServeHTTP(rec, r)
		runtime.ReadMemStats(&after)
		allocated := after.TotalAlloc - before.TotalAlloc
		require.Equal(t, http.StatusRequestEntityTooLarge, rec.Code, c.name)
		// io.ReadAll doubles its buffer: reading MaxBodyBytes+1 allocates
		// about 2-3 times the limit in all (twice that under the race
		// detector). Unbounded, it would be 64 MiB and more.
		require.Less(t, allocated, uint64(12*hostileLimit), "%s: the middleware allocated %d bytes", c.name, allocated)
		t.Logf("%s: %d bytes allocated (MaxBodyBytes %d)", c.name, allocated, hostileLimit)
	}
	require.Zero(t, calls.Load())
}

// zeros is an endless body.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}
