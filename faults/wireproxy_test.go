//go:build faults

package faults

// wireProxy is the fault-injecting TCP proxy of the wire scenarios: it sits
// between the service and its PostgreSQL or MariaDB server, reads the
// protocol in both directions (message by message, never changing a byte),
// and on command breaks one connection at a chosen point of a chosen
// transaction. A fault is armed with a marker, the raw idempotency key of one
// request: the first transaction whose client messages carry the marker
// (the claim sends the key as a bind parameter, or in the query text under
// interpolateParams) is the one hit. No maintained proxy could be used: one
// that reads the protocols (toxiproxy reads none) would need a module of its
// own, and the faults must land at protocol points (the COMMIT, the middle
// of a batch), not at byte counts.
//
// What it recognises:
//   - PostgreSQL: the startup packet (and an SSLRequest, refused by
//     sslmode=disable; a server that accepts TLS fails the test), then
//     typed messages. Statements execute at a simple Query ('Q') or at an
//     Execute ('E') of a portal bound ('B') to a statement parsed ('P')
//     earlier, possibly on an earlier transaction (pgx caches prepared
//     statements). pgx's Tx.Commit sends "commit" as a simple query; the
//     PostgreSQL dialect's completion sends COMMIT at the end of an
//     extended-protocol batch [complete; COMMIT].
//   - MySQL: packets (3-byte length, sequence number). A client packet with
//     sequence 0 is a command; go-sql-driver sends BEGIN as COM_QUERY
//     "START TRANSACTION" and Tx.Commit as COM_QUERY "COMMIT"; on a pool of
//     idemmysql.NewConnector, Do sends START TRANSACTION inside the claim's
//     compound statement (BEGIN NOT ATOMIC ... END) and COMMIT at the end of
//     the completion's, each one COM_QUERY. The first
//     server packet of sequence 1 answers the command (OK 0x00, ERR 0xFF).
//     A client that asks for TLS fails the test.

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// wireProto is the protocol a proxy reads.
type wireProto int

const (
	wirePostgres wireProto = iota
	wireMySQL
)

// wireFault is what an armed rule does to the transaction it hits.
type wireFault int

const (
	// wireDropAck forwards the COMMIT, waits for the server's answer,
	// swallows it and closes both sides: the commit happened (or failed)
	// and the service cannot know which.
	wireDropAck wireFault = iota
	// wireReset resets both sides (RST) once Rule.After client messages of
	// the transaction, counted from the one carrying the marker, were
	// forwarded, or at the COMMIT if the transaction gets there first (the
	// COMMIT is then not forwarded).
	wireReset
	// wireStall stops forwarding in both directions at the same point as
	// wireReset (or, with AtCommit, right after forwarding the COMMIT)
	// without closing anything: a half-open connection. After Rule.Stall
	// the server side is reset, as the server's keepalive would, and the
	// client side closed.
	wireStall
)

func (f wireFault) String() string {
	switch f {
	case wireDropAck:
		return "drop COMMIT ack"
	case wireReset:
		return "reset"
	case wireStall:
		return "stall"
	}
	return "?"
}

// wireRule is one armed fault.
type wireRule struct {
	Fault  wireFault
	Marker string
	// Skip is the number of transactions carrying the marker to let through
	// before the one hit (1: a leased payment's completion, not its claim).
	Skip     int
	After    int
	AtCommit bool
	Stall    time.Duration

	fired chan wireEvent // one event, once the fault was injected
}

// wireEvent is what a rule did.
type wireEvent struct {
	Fault wireFault
	// Forwarded is the number of the transaction's client messages, from
	// the one carrying the marker, forwarded before the fault.
	Forwarded int
	// AtCommit: the fault hit at the transaction's COMMIT.
	AtCommit bool
	// Committed: the server answered the forwarded COMMIT with success.
	Committed bool
	// Business: the transaction ran an INSERT into orders or payments.
	Business bool
	// MidBatch: the fault cut a client write of several messages (a pgx
	// batch) between two of them.
	MidBatch bool
	// Via is how the COMMIT was sent, for a fault at the COMMIT: "Query"
	// (PostgreSQL simple query), "Execute" (extended protocol, in a batch)
	// or "COM_QUERY".
	Via string
}

// wireProxy listens on 127.0.0.1 and forwards every connection to upstream.
type wireProxy struct {
	t        *testing.T
	proto    wireProto
	upstream string
	ln       net.Listener
	wg       sync.WaitGroup
	delay    atomic.Int64 // nanoseconds added before each forwarded burst

	mu    sync.Mutex
	rules []*wireRule // armed, not yet hit
	conns map[*wireConn]struct{}
	errs  []string
	// Conns counts the connections accepted.
	accepted int
}

// newWireProxy starts a proxy to upstream (host:port), stopped when t ends.
func newWireProxy(t *testing.T, proto wireProto, upstream string) *wireProxy {
	t.Helper()
	ln, err := (&net.ListenConfig{}).Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("wire proxy: listen: %v", err)
	}
	p := &wireProxy{t: t, proto: proto, upstream: upstream, ln: ln, conns: map[*wireConn]struct{}{}}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

// Addr is the proxy's host:port.
func (p *wireProxy) Addr() string { return p.ln.Addr().String() }

// Arm adds r; its event arrives on the returned channel once it fired.
func (p *wireProxy) Arm(r wireRule) <-chan wireEvent {
	r.fired = make(chan wireEvent, 1)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rules = append(p.rules, &r)
	return r.fired
}

// Disarm removes the rule whose marker is m, if it has not fired.
func (p *wireProxy) Disarm(m string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, r := range p.rules {
		if r.Marker == m {
			p.rules = append(p.rules[:i], p.rules[i+1:]...)
			return
		}
	}
}

// SetDelay makes every forwarded burst, in both directions and on every
// connection, wait d first (0: no delay).
func (p *wireProxy) SetDelay(d time.Duration) { p.delay.Store(int64(d)) }

// Accepted is the number of connections accepted so far.
func (p *wireProxy) Accepted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.accepted
}

func (p *wireProxy) fail(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.errs) < 10 {
		p.errs = append(p.errs, fmt.Sprintf(format, args...))
	}
}

func (p *wireProxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	conns := make([]*wireConn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	for _, c := range conns {
		c.closeBoth(false)
	}
	p.wg.Wait()
	for _, e := range p.errs {
		p.t.Errorf("wire proxy: %s", e)
	}
}

func (p *wireProxy) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		server, err := net.DialTimeout("tcp", p.upstream, 5*time.Second)
		if err != nil {
			_ = client.Close()
			continue
		}
		c := &wireConn{p: p, client: client, server: server, done: make(chan struct{}),
			stmts: map[string]string{}, portals: map[string]string{}, seen: map[*wireRule]bool{}}
		p.mu.Lock()
		p.conns[c] = struct{}{}
		p.accepted++
		p.mu.Unlock()
		p.wg.Go(c.clientPump)
		p.wg.Go(c.serverPump)
	}
}

// match returns the rule the transaction's message msg hits, if any. seen
// holds the rules this transaction already counted against Skip.
func (p *wireProxy) match(msg []byte, seen map[*wireRule]bool) *wireRule {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, r := range p.rules {
		if seen[r] || !bytes.Contains(msg, []byte(r.Marker)) {
			continue
		}
		seen[r] = true
		if r.Skip > 0 {
			r.Skip--
			continue
		}
		p.rules = append(p.rules[:i], p.rules[i+1:]...)
		return r
	}
	return nil
}

// rearm puts back a rule whose transaction ended without reaching the
// fault (rolled back), for the next transaction carrying its marker.
func (p *wireProxy) rearm(r *wireRule) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rules = append(p.rules, r)
}

// wireConn is one proxied connection.
type wireConn struct {
	p              *wireProxy
	client, server net.Conn
	done           chan struct{}
	closeOnce      sync.Once

	// The client pump's protocol state.
	started bool              // PostgreSQL: past the startup packet
	stmts   map[string]string // PostgreSQL: prepared statement name → SQL
	portals map[string]string // PostgreSQL: portal → SQL
	inTx    bool
	seen    map[*wireRule]bool // rules this transaction counted
	txLog   strings.Builder    // SQL the transaction ran, for Business
	rule    *wireRule          // the rule this transaction hit
	count   int                // messages forwarded since the marker

	// awaitSSL: PostgreSQL's one-byte answer to an SSLRequest comes next.
	awaitSSL atomic.Bool
	// stalled: both pumps have stopped forwarding.
	stalled atomic.Bool

	mu sync.Mutex
	// pending is set once a COMMIT was forwarded under a wireDropAck or
	// an AtCommit wireStall: the server pump swallows the answer.
	pending *wirePending
}

type wirePending struct {
	rule *wireRule
	ev   wireEvent
}

// closeBoth closes both sides once, with RST when rst is set.
func (c *wireConn) closeBoth(rst bool) {
	c.closeOnce.Do(func() {
		for _, nc := range []net.Conn{c.client, c.server} {
			if tc, ok := nc.(*net.TCPConn); ok && rst {
				_ = tc.SetLinger(0)
			}
			_ = nc.Close()
		}
		close(c.done)
		c.p.mu.Lock()
		delete(c.p.conns, c)
		c.p.mu.Unlock()
	})
}

// stallFor stops both pumps, and after d resets the server side and closes
// the client side.
func (c *wireConn) stallFor(d time.Duration) {
	c.stalled.Store(true)
	time.AfterFunc(d, func() { c.closeBoth(true) })
}

// flush writes what w holds, after the proxy's current delay.
func (c *wireConn) flush(w *bufio.Writer) error {
	if w.Buffered() == 0 {
		return nil
	}
	if d := time.Duration(c.p.delay.Load()); d > 0 {
		select {
		case <-time.After(d):
		case <-c.done:
		}
	}
	return w.Flush()
}

// readMsg reads one message of the protocol from r. initial: a PostgreSQL
// message without a type byte (the startup packet and its kin).
func (c *wireConn) readMsg(r *bufio.Reader, initial bool) ([]byte, error) {
	var hdr []byte
	var n int
	switch {
	case c.p.proto == wireMySQL:
		hdr = make([]byte, 4)
		if _, err := io.ReadFull(r, hdr); err != nil {
			return nil, err
		}
		n = int(hdr[0]) | int(hdr[1])<<8 | int(hdr[2])<<16
	case initial:
		hdr = make([]byte, 4)
		if _, err := io.ReadFull(r, hdr); err != nil {
			return nil, err
		}
		n = int(binary.BigEndian.Uint32(hdr)) - 4
	default:
		hdr = make([]byte, 5)
		if _, err := io.ReadFull(r, hdr); err != nil {
			return nil, err
		}
		n = int(binary.BigEndian.Uint32(hdr[1:])) - 4
	}
	if n < 0 || n > 1<<30 {
		return nil, fmt.Errorf("message length %d", n)
	}
	msg := make([]byte, len(hdr)+n)
	copy(msg, hdr)
	if _, err := io.ReadFull(r, msg[len(hdr):]); err != nil {
		return nil, err
	}
	return msg, nil
}

// The statement classes the proxy acts on.
const (
	wireOther = iota
	wireBegin
	wireCommit
	wireRollback
	// wireBeginWith begins a transaction and runs a statement of it: a
	// compound statement carrying START TRANSACTION and the claim.
	wireBeginWith
)

func wireClassify(sql string) int {
	s := strings.ToLower(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(sql), ";")))
	switch {
	case strings.HasPrefix(s, "begin not atomic"):
		// A MariaDB compound statement of idemmysql.NewConnector's pools.
		words := strings.Join(strings.Fields(s), " ")
		switch {
		case strings.Contains(words, "start transaction"):
			return wireBeginWith
		case strings.HasSuffix(words, "commit; end"):
			return wireCommit
		}
		return wireOther
	case s == "begin" || strings.HasPrefix(s, "begin ") || strings.HasPrefix(s, "start transaction"):
		return wireBegin
	case s == "commit" || s == "end" || s == "commit work":
		return wireCommit
	case s == "rollback" || s == "rollback work" || s == "abort":
		return wireRollback
	}
	return wireOther
}

// cstring splits b at its first NUL.
func cstring(b []byte) (string, []byte) {
	i := bytes.IndexByte(b, 0)
	if i < 0 {
		return string(b), nil
	}
	return string(b[:i]), b[i+1:]
}

// executes returns the SQL msg runs, if it runs a statement, and records
// the statements and portals it defines.
func (c *wireConn) executes(msg []byte) (sql string, exec bool) {
	if c.p.proto == wireMySQL {
		if msg[3] != 0 || len(msg) < 5 { // not a command
			return "", false
		}
		switch msg[4] {
		case 0x03: // COM_QUERY
			return string(msg[5:]), true
		case 0x17: // COM_STMT_EXECUTE: its text was prepared earlier
			return "", true
		}
		return "", false
	}
	body := msg[5:]
	switch msg[0] {
	case 'Q':
		q, _ := cstring(body)
		return q, true
	case 'P':
		name, rest := cstring(body)
		q, _ := cstring(rest)
		c.stmts[name] = q
	case 'B':
		portal, rest := cstring(body)
		stmt, _ := cstring(rest)
		c.portals[portal] = c.stmts[stmt]
	case 'E':
		portal, _ := cstring(body)
		return c.portals[portal], true
	}
	return "", false
}

// The client pump's decisions for one message.
const (
	actForward = iota
	actReset
	actStall
	actCommitThenAwait // forward, then the server pump swallows the answer
)

func (c *wireConn) clientPump() {
	defer c.closeBoth(false)
	r := bufio.NewReaderSize(c.client, 64<<10)
	w := bufio.NewWriterSize(c.server, 64<<10)
	for {
		if r.Buffered() == 0 {
			if err := c.flush(w); err != nil {
				return
			}
		}
		initial := c.p.proto == wirePostgres && !c.started
		msg, err := c.readMsg(r, initial)
		if err != nil {
			if c.stalled.Load() {
				// The client gave up on a stalled connection: the server
				// must not hear of it (half-open) until the stall ends.
				<-c.done
				return
			}
			_ = c.flush(w)
			return
		}
		if c.stalled.Load() {
			<-c.done
			return
		}
		if initial {
			switch binary.BigEndian.Uint32(msg[4:8]) {
			case 80877103, 80877104: // SSLRequest, GSSENCRequest: the server answers one byte
				c.awaitSSL.Store(true)
			default:
				c.started = true
			}
			if _, err := w.Write(msg); err != nil {
				return
			}
			continue
		}
		if c.p.proto == wireMySQL && msg[3] == 1 && len(msg) >= 8 && binary.LittleEndian.Uint32(msg[4:8])&0x800 != 0 {
			c.p.fail("the MySQL client asked for TLS: the proxy cannot read the commands")
			return
		}
		switch act, ev := c.decide(msg); act {
		case actForward:
			if _, err := w.Write(msg); err != nil {
				return
			}
		case actReset:
			ev.MidBatch = r.Buffered() > 0
			_ = c.flush(w)
			c.fire(c.rule, ev)
			c.closeBoth(true)
			return
		case actStall:
			ev.MidBatch = r.Buffered() > 0
			_ = c.flush(w)
			c.fire(c.rule, ev)
			c.stallFor(c.rule.Stall)
			<-c.done
			return
		case actCommitThenAwait:
			c.mu.Lock()
			c.pending = &wirePending{rule: c.rule, ev: ev}
			c.mu.Unlock()
			c.rule = nil
			if _, err := w.Write(msg); err != nil {
				return
			}
			// Whatever follows in the burst (PostgreSQL's Sync) is
			// forwarded too: the server answers only after it.
		}
	}
}

// decide classifies msg and says what to do with it.
func (c *wireConn) decide(msg []byte) (int, wireEvent) {
	sql, exec := c.executes(msg)
	class := wireOther
	if exec {
		class = wireClassify(sql)
	}
	if class == wireBegin || class == wireBeginWith {
		c.inTx = true
		clear(c.seen)
		c.txLog.Reset()
	}
	if c.inTx && exec && c.txLog.Len() < 1<<16 {
		c.txLog.WriteString(sql)
		c.txLog.WriteByte('\n')
	}
	if c.inTx && c.rule == nil && (class == wireOther || class == wireBeginWith) {
		if r := c.p.match(msg, c.seen); r != nil {
			c.rule, c.count = r, 0
		}
	}
	act := actForward
	var ev wireEvent
	if r := c.rule; r != nil {
		ev = wireEvent{Fault: r.Fault, Forwarded: c.count, AtCommit: class == wireCommit, Business: c.business()}
		if ev.AtCommit {
			ev.Via = map[byte]string{'Q': "Query", 'E': "Execute"}[msg[0]]
			if c.p.proto == wireMySQL {
				ev.Via = "COM_QUERY"
			}
		}
		switch {
		case class == wireRollback:
			// The transaction ended before the fault's point: the next one
			// carrying the marker gets it.
			c.p.rearm(r)
			c.rule = nil
		case r.Fault == wireDropAck && class == wireCommit,
			r.Fault == wireStall && r.AtCommit && class == wireCommit:
			act = actCommitThenAwait
		case r.Fault == wireReset && (class == wireCommit || c.count >= r.After):
			act = actReset
		case r.Fault == wireStall && !r.AtCommit && (class == wireCommit || c.count >= r.After):
			act = actStall
		}
		c.count++
	}
	if class == wireCommit || class == wireRollback {
		c.inTx = false
	}
	return act, ev
}

func (c *wireConn) business() bool {
	return wireBusinessInsert.MatchString(c.txLog.String())
}

// wireBusinessInsert finds an insert into the business tables, named bare
// (MariaDB, a private PostgreSQL) or quoted and schema-qualified
// (PostgreSQL's fresh schemas, pgTable).
var wireBusinessInsert = regexp.MustCompile(`(?i)insert into ("[a-z0-9_]+"\.)?"?(orders|payments)"?[\s(]`)

func (c *wireConn) fire(r *wireRule, ev wireEvent) {
	select {
	case r.fired <- ev:
	default:
	}
}

func (c *wireConn) serverPump() {
	defer c.closeBoth(false)
	r := bufio.NewReaderSize(c.server, 64<<10)
	w := bufio.NewWriterSize(c.client, 64<<10)
	for {
		if r.Buffered() == 0 {
			if err := c.flush(w); err != nil {
				return
			}
		}
		if c.awaitSSL.Load() {
			b, err := r.ReadByte()
			if err != nil {
				return
			}
			c.awaitSSL.Store(false)
			if b != 'N' {
				c.p.fail("the PostgreSQL server accepted encryption (%q): the proxy cannot read the messages; use sslmode=disable", b)
				return
			}
			if err := w.WriteByte(b); err != nil {
				return
			}
			continue
		}
		msg, err := c.readMsg(r, false)
		if err != nil {
			if c.stalled.Load() {
				<-c.done
				return
			}
			_ = c.flush(w)
			return
		}
		if c.stalled.Load() {
			<-c.done
			return
		}
		c.mu.Lock()
		pend := c.pending
		c.mu.Unlock()
		if pend == nil {
			if _, err := w.Write(msg); err != nil {
				return
			}
			continue
		}
		// The answer to the COMMIT, or what precedes it in the batch's
		// answer: swallowed until the COMMIT's own.
		committed, end := c.commitAnswer(msg)
		if !end {
			continue
		}
		pend.ev.Committed = committed
		c.fire(pend.rule, pend.ev)
		if pend.rule.Fault == wireStall {
			c.stallFor(pend.rule.Stall)
			<-c.done
			return
		}
		c.closeBoth(true)
		return
	}
}

// commitAnswer reads msg, a server message after a forwarded COMMIT: end
// once the COMMIT's outcome is known.
func (c *wireConn) commitAnswer(msg []byte) (committed, end bool) {
	if c.p.proto == wireMySQL {
		if msg[3] != 1 || len(msg) < 5 {
			return false, false
		}
		return msg[4] == 0x00, true
	}
	switch msg[0] {
	case 'C': // CommandComplete
		tag, _ := cstring(msg[5:])
		switch tag {
		case "COMMIT":
			return true, true
		case "ROLLBACK":
			return false, true
		}
	case 'E', 'Z': // an error skips the COMMIT; ReadyForQuery ends the answer
		return false, true
	}
	return false, false
}

// errWireNoFault is returned when an armed fault did not fire in time.
var errWireNoFault = errors.New("the armed wire fault did not fire")

// wait returns the rule's event, or errWireNoFault after d.
func wireWait(ch <-chan wireEvent, d time.Duration) (wireEvent, error) {
	select {
	case ev := <-ch:
		return ev, nil
	default:
	}
	select {
	case ev := <-ch:
		return ev, nil
	case <-time.After(d):
		return wireEvent{}, errWireNoFault
	}
}
