package conformance

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

// ChildTestName is the test every dialect package defines for the suite's
// process cases; see [RunChild].
const ChildTestName = "TestConformanceChild"

// childSpecEnv carries the childSpec, as JSON, to a child process. Its
// absence means the test binary runs its tests normally.
const childSpecEnv = "IDEM_CONFORMANCE_CHILD"

// childReport prefixes the line a child prints on stdout once it holds the
// lease: "<childReport> token=<n> attempt=<n>".
const childReport = "idem-conformance-child: holding"

// Bounds on a child's life, so that none outlives a broken parent for long.
const (
	childStartLimit = time.Minute     // parent: from start to the report
	childHangLimit  = 2 * time.Minute // child: from the report to giving up on the kill
)

// RunChild is the body of the child process of the suite's process cases
// (a lease holder that the parent kills). Every dialect's test package must
// define, next to its conformance.Run:
//
//	func TestConformanceChild(t *testing.T) { conformance.RunChild(t, reopen) }
//
// RunChild returns at once, and the test passes without doing anything, in
// a normal test run: it never skips. In a child (the test binary
// re-executed by a process case with -test.run=^TestConformanceChild$ and
// the variable IDEM_CONFORMANCE_CHILD describing the work) it calls reopen,
// acquires a lease on the namespace with the parent's pinned clock, maybe
// does the outside effect, reports the lease on stdout and hangs until the
// parent kills it (giving up after two minutes).
//
// reopen runs in the child. Its environment holds the parent's plus the
// entries of the namespace's [Namespace.ChildEnv]; from those it must
// return a dialect on that same namespace, closed when t ends, without
// creating or migrating anything.
func RunChild[TTx any](t *testing.T, reopen func(ctx context.Context, t *testing.T) idem.Dialect[TTx]) {
	t.Helper()
	raw, ok := os.LookupEnv(childSpecEnv)
	if !ok {
		return // a normal run: this is no test of its own
	}
	var spec childSpec
	require.NoError(t, json.Unmarshal([]byte(raw), &spec), "%s", childSpecEnv)
	ctx := t.Context()
	dialect := reopen(ctx, t)
	now := spec.Now
	store, err := idem.New(dialect, &idem.Config{LeaseDuration: spec.LeaseDuration, Now: func() time.Time { return now }})
	require.NoError(t, err)

	l, err := store.Acquire(ctx, spec.Scope, spec.Key, fp(spec.Fingerprint))
	require.NoError(t, err)
	require.True(t, l.Acquired(), "the child must acquire the key")
	if spec.Effect {
		require.NoError(t, (&fileProvider{path: spec.EffectFile}).charge(spec.Key))
		// Completion starts inside the business transaction, which the kill
		// interrupts before it commits: the database must roll it back and
		// release whatever it locked.
		tx, err := dialect.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, l.CompleteTx(ctx, tx, killedResponse))
	}
	_, err = fmt.Fprintf(os.Stdout, "%s token=%d attempt=%d\n", childReport, l.Token(), l.Attempt())
	require.NoError(t, err)

	time.Sleep(childHangLimit)
	t.Fatalf("the child was not killed within %v", childHangLimit)
}

// killedResponse is what a killed child was completing with when it died;
// it must never be stored.
var killedResponse = &idem.Response{StatusCode: 500, Body: []byte("uncommitted completion of a killed holder")}

// childSpec tells a child what to do.
type childSpec struct {
	Scope, Key, Fingerprint string
	// Now pins the child's clock (the parent's pinned clock at start), and
	// LeaseDuration sets its store's lease.
	Now           time.Time
	LeaseDuration time.Duration
	// Effect: after acquiring, charge through the fileProvider at
	// EffectFile and start completing in an open business transaction.
	Effect     bool
	EffectFile string
}

// child is a running child process, killed when the test ends at the latest.
type child struct {
	cmd  *exec.Cmd
	out  *childOutput
	done chan struct{} // closed when the process has exited and its output is read
	err  error         // cmd.Wait's answer, once done is closed
}

// startChild re-executes the test binary as a child that holds a lease on
// ns as spec says.
func startChild[TTx any](t *testing.T, ns *Namespace[TTx], spec childSpec) *child {
	t.Helper()
	require.NotEmpty(t, ns.ChildEnv, "the harness must set Namespace.ChildEnv for the process cases")
	raw, err := json.Marshal(spec)
	require.NoError(t, err)
	exe, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.CommandContext(t.Context(), exe, "-test.run=^"+ChildTestName+"$", "-test.count=1",
		"-test.timeout="+(childStartLimit+childHangLimit).String())
	cmd.Env = append(os.Environ(), ns.ChildEnv...)
	cmd.Env = append(cmd.Env, childSpecEnv+"="+string(raw))
	out := &childOutput{report: make(chan string, 1)}
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())

	c := &child{cmd: cmd, out: out, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		close(c.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill() // fails once it has exited
		<-c.done
	})
	return c
}

// waitHolding waits for the child's report and returns its lease's token
// and attempt.
func (c *child) waitHolding(t *testing.T) (token int64, attempt int) {
	t.Helper()
	select {
	case line := <-c.out.report:
		_, err := fmt.Sscanf(line, childReport+" token=%d attempt=%d", &token, &attempt)
		require.NoError(t, err, "child report %q", line)
		return token, attempt
	case <-c.done:
		t.Fatalf("the child exited (%v) before it held the lease; does the dialect's test package define %s calling conformance.RunChild? Its output:\n%s",
			c.err, ChildTestName, c.out.String())
	case <-time.After(childStartLimit):
		t.Fatalf("the child did not hold the lease within %v; its output:\n%s", childStartLimit, c.out.String())
	}
	return 0, 0
}

// kill sends SIGKILL (os.Process.Kill) and waits until the child is gone.
func (c *child) kill(t *testing.T) {
	t.Helper()
	require.NoError(t, c.cmd.Process.Kill())
	select {
	case <-c.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the killed child did not exit within 30s")
	}
	require.False(t, c.cmd.ProcessState.Exited(), "the child must die of the kill, not exit (%v); its output:\n%s", c.err, c.out.String())
}

// childOutput collects a child's stdout and stderr and hands the first
// report line over once it is complete.
type childOutput struct {
	mu       sync.Mutex
	buf      bytes.Buffer
	reported bool
	report   chan string // buffered: receives one line
}

func (o *childOutput) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.buf.Write(p)
	if !o.reported { // the line is written in one piece; wait for its end
		b := o.buf.Bytes()
		if i := bytes.Index(b, []byte(childReport)); i >= 0 {
			if n := bytes.IndexByte(b[i:], '\n'); n >= 0 {
				o.reported = true
				o.report <- string(b[i : i+n])
			}
		}
	}
	return len(p), nil
}

func (o *childOutput) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.String()
}

// fileProvider fakes an outside system, like [provider], whose memory is a
// file: a child process charges through it, dies, and the parent's status
// check reads what it did. Each charge appends a line holding the key.
type fileProvider struct {
	path string

	mu     sync.Mutex
	checks int
}

func newFileProvider(t *testing.T) *fileProvider {
	t.Helper()
	return &fileProvider{path: filepath.Join(t.TempDir(), "provider.log")}
}

func (p *fileProvider) charge(key string) error {
	f, err := os.OpenFile(p.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(key + "\n"); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

func (p *fileProvider) count(key string) (int, error) {
	data, err := os.ReadFile(p.path)
	if os.IsNotExist(err) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	n := 0
	for _, line := range strings.Split(string(data), "\n") {
		if line == key {
			n++
		}
	}
	return n, nil
}

func (p *fileProvider) checked() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.checks
}

// check answers from the provider's file.
func (p *fileProvider) check(_ context.Context, rec idem.Record) (idem.Verdict, error) {
	p.mu.Lock()
	p.checks++
	p.mu.Unlock()
	n, err := p.count(rec.Key)
	switch {
	case err != nil:
		return idem.Unknown(), err
	case n > 0:
		return idem.Committed(chargedResponse(rec.Key)), nil
	default:
		return idem.NotCommitted(), nil
	}
}
