package conformance

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"net/http"
	"regexp"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/logscan"
)

// bundle is what most cases need: a store on a fresh namespace.
type bundle[TTx any] struct {
	ns    *Namespace[TTx]
	store *idem.Store[TTx]
	feat  Features
}

// setup opens a fresh namespace and a store over it. cfg may be nil. Unless
// cfg sets a Logger, the store logs to a recorder whose lines are scanned
// for the suite's raw keys, scopes and bodies when t ends (see scanLogs).
func setup[TTx any](t *testing.T, h Harness[TTx], cfg *idem.Config) (context.Context, *bundle[TTx]) {
	t.Helper()
	ctx := t.Context()
	ns := h.Open(ctx, t)
	c := idem.Config{}
	if cfg != nil {
		c = *cfg
	}
	if c.Logger == nil {
		c.Logger = scannedLogger(t)
	}
	store, err := idem.New(ns.Dialect, &c)
	require.NoError(t, err)
	return ctx, &bundle[TTx]{ns: ns, store: store, feat: h.Features()}
}

// begin starts a transaction through the dialect and rolls it back at the
// end of the test if the case did not finish it.
func (b *bundle[TTx]) begin(ctx context.Context, t *testing.T) TTx {
	t.Helper()
	tx, err := b.ns.Dialect.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.ns.Dialect.Rollback(context.WithoutCancel(ctx), tx) })
	return tx
}

func (b *bundle[TTx]) orders(ctx context.Context, t *testing.T, ref string) int {
	t.Helper()
	n, err := b.ns.CountOrders(ctx, ref)
	require.NoError(t, err)
	return n
}

func (b *bundle[TTx]) records(ctx context.Context, t *testing.T) int {
	t.Helper()
	n, err := b.ns.CountRecords(ctx)
	require.NoError(t, err)
	return n
}

// orderFn is a Do callback that writes one business row for ref and answers
// 201 with a body naming it. calls counts executions.
func orderFn[TTx any](ns *Namespace[TTx], ref string, calls *counter) func(context.Context, TTx) (*idem.Response, error) {
	return func(ctx context.Context, tx TTx) (*idem.Response, error) {
		calls.inc()
		if err := ns.InsertOrder(ctx, tx, ref); err != nil {
			return nil, err
		}
		return orderResponse(ref), nil
	}
}

func orderResponse(ref string) *idem.Response {
	// The body mixes text with every byte value, so replay must be byte exact.
	body := []byte(`{"order":"` + ref + `"}` + "\n")
	for i := range 256 {
		body = append(body, byte(i))
	}
	return &idem.Response{
		StatusCode: http.StatusCreated,
		Header: http.Header{
			"Content-Type": {"application/json"},
			"Location":     {"/orders/" + ref},
			"X-Multi":      {"one", "two"},
		},
		Body: body,
	}
}

type counter struct {
	mu sync.Mutex
	n  int
}

func (c *counter) inc() {
	c.mu.Lock()
	c.n++
	c.mu.Unlock()
}

func (c *counter) get() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

// newKey returns a fresh key that is valid everywhere.
func newKey(prefix string) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

func fp(s string) idem.Fingerprint { return idem.NewFingerprint([]byte(s)) }

// clock is a pinned test clock.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func newClock() *clock {
	// Microsecond resolution and UTC, so stored times compare exactly.
	return &clock{now: time.Date(2030, 1, 2, 3, 4, 5, 678901000, time.UTC)}
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func requireSameResponse(t *testing.T, want, got *idem.Response) {
	t.Helper()
	require.NotNil(t, got)
	require.Equal(t, want.StatusCode, got.StatusCode)
	require.Equal(t, want.Header, got.Header)
	require.Equal(t, want.Body, got.Body, "body must replay byte for byte")
}

// loggedLines counts the lines every scanned logger of the process
// recorded, so that Run can tell a scan that saw nothing from a clean one.
var loggedLines atomic.Int64

// suiteSecrets recognises what the suite sends that idem must never log:
// the keys newKey makes (a prefix, "-", 16 hex digits; the digests idem
// logs are 16 hex digits with no prefix), the suite's scopes, and the
// bodies orderResponse builds.
var suiteSecrets = []struct {
	what string
	re   *regexp.Regexp
}{
	{"key", regexp.MustCompile(`[A-Za-z0-9]-[0-9a-f]{16}`)},
	{"scope", regexp.MustCompile(`t1/[a-z]+|SECRET-SCOPE|tenant[_%]/op`)},
	{"body", regexp.MustCompile(`\\?"order\\?"|/orders/`)},
}

// scannedLogger returns a logger that records every line at every level
// and fails t, when it ends, for any line holding a raw key, scope or body
// of the suite.
func scannedLogger(t *testing.T) *slog.Logger {
	rec := logscan.New()
	for _, s := range suiteSecrets {
		rec.Pattern(s.what, s.re)
	}
	t.Cleanup(func() {
		lines := rec.Lines()
		loggedLines.Add(int64(len(lines)))
		rec.CheckLines(t, lines)
	})
	return rec.Logger()
}
