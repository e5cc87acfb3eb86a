// Package ordersproc runs examples/orders as a real process for the tests of
// retrying clients (idemclient, contrib/retryablehttp): built once per test
// into its temporary directory, started on a port and an SQLite file,
// killed with SIGKILL and restarted on the same port and file.
package ordersproc

import (
	"bufio"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	idemsqlite "github.com/idemstore/idem/sqlite"
)

// buildMu serialises builds within one test binary: the second build finds
// every package in the build cache and only links.
var buildMu sync.Mutex

// Build builds examples/orders of the module whose root directory is root
// into t's temporary directory and returns the binary's path. It is built
// without -race: the race detector belongs to the test process, and the
// service's own tests run it under -race.
func Build(t testing.TB, root string) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	bin := filepath.Join(t.TempDir(), "orders")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./examples/orders")
	cmd.Dir = root
	// The root module's own dependencies, whatever workspace the test
	// runs in.
	cmd.Env = append(os.Environ(), "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./examples/orders: %v\n%s", err, out)
	}
	return bin
}

// Server is one process of the orders service.
type Server struct {
	// URL is the base URL, http://127.0.0.1:port.
	URL string
	// Addr is the listen address, host:port: start the next process on it
	// to restart the service on the same port.
	Addr string

	cmd    *exec.Cmd
	stderr *lockedBuffer
	exited chan struct{}
	err    error // the process's exit, once exited is closed
}

var readyLine = regexp.MustCompile(`^orders: serving on (http://(\S+)) `)

// TokenSecret is the -token-secret Start gives the server, so that the
// tests can sign their own bearer tokens (Token).
const TokenSecret = "ordersproc-test-secret"

// Token returns the bearer token examples/orders (auth.go) accepts for
// tenant from a server started by Start: tenant "." hex(HMAC-SHA256).
func Token(tenant string) string {
	m := hmac.New(sha256.New, []byte(TokenSecret))
	m.Write([]byte(tenant))
	return tenant + "." + hex.EncodeToString(m.Sum(nil))
}

// Start runs bin on the SQLite file db, listening on addr (127.0.0.1:0 for a
// free port), with the extra flags args, and returns once it serves. The
// process is killed when t ends, if it is still running.
func Start(t testing.TB, bin, db, addr string, args ...string) *Server {
	t.Helper()
	//nolint:gosec // G204: the binary Build made, with the test's arguments
	cmd := exec.Command(bin, append([]string{"-addr", addr, "-db", db, "-token-secret", TokenSecret}, args...)...)
	orphanGuard(cmd)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := &lockedBuffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start orders: %v", err)
	}
	s := &Server{cmd: cmd, stderr: stderr, exited: make(chan struct{})}
	ready := make(chan string, 1)
	go func() {
		lines := bufio.NewScanner(stdout)
		if lines.Scan() {
			ready <- lines.Text()
		}
		close(ready)
		_, _ = io.Copy(io.Discard, stdout)
	}()
	go func() {
		s.err = cmd.Wait()
		close(s.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-s.exited
	})
	select {
	case line, ok := <-ready:
		m := readyLine.FindStringSubmatch(line)
		if !ok || m == nil {
			<-s.exited
			t.Fatalf("orders did not start (%v): %q\nstderr:\n%s", s.err, line, stderr.String())
		}
		s.URL, s.Addr = m[1], m[2]
	case <-time.After(time.Minute):
		t.Fatalf("orders printed no ready line within a minute; stderr:\n%s", stderr.String())
	}
	return s
}

// Stderr returns what the process wrote to its standard error so far: its
// log lines.
func (s *Server) Stderr() string { return s.stderr.String() }

// Kill sends SIGKILL to the process and waits for it to be gone.
func (s *Server) Kill(t testing.TB) {
	t.Helper()
	if err := s.cmd.Process.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, os.ErrProcessDone) {
		t.Fatalf("kill orders: %v", err)
	}
	<-s.exited
}

// Exited is closed when the process has ended, killed or crashed.
func (s *Server) Exited() <-chan struct{} { return s.exited }

// Killed reports whether the process ended by SIGKILL (a crash the
// -fault-injection hook caused, or Kill).
func (s *Server) Killed() bool {
	<-s.exited
	var exit *exec.ExitError
	if !errors.As(s.err, &exit) {
		return false
	}
	ws, ok := exit.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// Orders returns the orders of tenant, read through GET /orders with a
// plain client (never the client under test).
func Orders(t testing.TB, base, tenant string) []json.RawMessage {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodGet, base+"/orders", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+Token(tenant))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("GET /orders: %v", err)
	}
	defer resp.Body.Close()
	var list struct {
		Count  int               `json:"count"`
		Orders []json.RawMessage `json:"orders"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /orders: status %d, %v", resp.StatusCode, err)
	}
	if list.Count != len(list.Orders) {
		t.Fatalf("GET /orders: count %d for %d orders", list.Count, len(list.Orders))
	}
	return list.Orders
}

// Rows counts tenant's rows of table ("orders" or "payments", never input)
// in the service's SQLite file db, read directly rather than through the
// service.
func Rows(t testing.TB, db, table, tenant string) int {
	t.Helper()
	if table != "orders" && table != "payments" {
		t.Fatalf("unknown table %q", table)
	}
	conn, err := idemsqlite.Open(db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var n int
	//nolint:gosec // G202: table is one of two constants, checked above
	if err := conn.QueryRowContext(context.Background(), "SELECT COUNT(*) FROM "+table+" WHERE tenant = ?", tenant).Scan(&n); err != nil {
		t.Fatalf("count %s: %v", table, err)
	}
	return n
}

// CrashFirst is a RoundTripper under the client under test: it asks the
// service (run with -fault-injection) to SIGKILL itself at Stage on the
// first attempt only, so that the retries after the restart run normally.
// It counts the attempts it sent.
type CrashFirst struct {
	Base  http.RoundTripper
	Stage string // an X-Fault-Crash stage of examples/orders

	mu       sync.Mutex
	attempts int
	keys     []string
}

// RoundTrip implements http.RoundTripper.
func (c *CrashFirst) RoundTrip(req *http.Request) (*http.Response, error) {
	c.mu.Lock()
	c.attempts++
	first := c.attempts == 1
	c.keys = append(c.keys, req.Header.Get("Idempotency-Key"))
	c.mu.Unlock()
	if first && c.Stage != "" {
		req = req.Clone(req.Context())
		req.Header.Set("X-Fault-Crash", c.Stage)
	}
	base := c.Base
	if base == nil {
		base = http.DefaultTransport
	}
	return base.RoundTrip(req)
}

// Keys returns the idempotency key of every attempt sent, in order.
func (c *CrashFirst) Keys() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.keys...)
}

// lockedBuffer is a strings.Builder safe for the process's writes and the
// test's reads.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
