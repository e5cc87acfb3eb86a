// Package logscan records every log line a test's code writes and finds
// secrets in them: the raw keys, scopes and body fragments the test used,
// which idem promises never to log (only their digests).
//
// A Recorder is an slog.Handler: give slog.New(rec) to the code under test
// (idem.Config.Logger, idemhttp.Config.Logger), register the secrets the test
// sends with Secret, and call Check (or Scan) when the test ends. Records are
// rendered whole, as JSON, with every attribute and group, so a secret hidden
// in any attribute, nested or not, is found. Secrets are matched as
// substrings, raw and in the escaped forms JSON and %q give them.
package logscan

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// MinSecretLength is the shortest secret Secret accepts: shorter strings
// ("a", "POST") turn up in log lines by chance and would make Scan fail
// for no reason.
const MinSecretLength = 6

// Recorder is an slog.Handler that records every line at every level. The
// zero value is not usable; make one with New. It is safe for concurrent
// use; handlers derived with WithAttrs and WithGroup share its lines.
type Recorder struct {
	*Scanner
	shared *shared
	attrs  []slog.Attr
	groups []string
}

type shared struct {
	mu    sync.Mutex
	lines []string
}

// Scanner knows the secrets a test used and finds them in log lines. It is
// safe for concurrent use.
type Scanner struct {
	mu       sync.Mutex
	secrets  map[string]string // secret -> what it is, for the failure message
	patterns []pattern
}

type pattern struct {
	what string
	re   *regexp.Regexp
}

// NewScanner returns a Scanner that knows no secret yet.
func NewScanner() *Scanner { return &Scanner{secrets: map[string]string{}} }

// Secret registers s, described by what (such as "key" or "body"), as a
// string no line may contain. Strings shorter than MinSecretLength are
// ignored (see there); empty ones always are.
func (s *Scanner) Secret(what, secret string) {
	if len(secret) < MinSecretLength {
		return
	}
	s.mu.Lock()
	s.secrets[secret] = what
	s.mu.Unlock()
}

// Pattern registers re as the shape of a secret (the keys a suite
// generates: a prefix and random hex): no line may match it. A pattern
// recognises secrets a test never registered one by one, such as the keys
// of a thousand concurrent claims.
func (s *Scanner) Pattern(what string, re *regexp.Regexp) {
	s.mu.Lock()
	s.patterns = append(s.patterns, pattern{what: what, re: re})
	s.mu.Unlock()
}

// ScanLines returns every line that holds a registered secret, in any of
// the forms a logger could render it in, or matches a registered pattern.
func (s *Scanner) ScanLines(lines []string) []Finding {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Finding
	for _, line := range lines {
		for secret, what := range s.secrets {
			if containsAnyForm(line, secret) {
				out = append(out, Finding{What: what, Line: line})
			}
		}
		for _, p := range s.patterns {
			if p.re.MatchString(line) {
				out = append(out, Finding{What: p.what, Line: line})
			}
		}
	}
	return out
}

// CheckLines fails t for each finding of ScanLines.
func (s *Scanner) CheckLines(t testing.TB, lines []string) {
	t.Helper()
	for _, f := range s.ScanLines(lines) {
		t.Errorf("logscan: a log line holds a raw %s: %s", f.What, f.Line)
	}
}

// New returns an empty Recorder.
func New() *Recorder {
	return &Recorder{Scanner: NewScanner(), shared: &shared{}}
}

// Logger returns a logger that writes to r.
func (r *Recorder) Logger() *slog.Logger { return slog.New(r) }

// Enabled reports true for every level: debug lines are where a careless
// attribute would hide.
func (*Recorder) Enabled(context.Context, slog.Level) bool { return true }

// Handle renders rec as one JSON line and records it.
func (r *Recorder) Handle(_ context.Context, rec slog.Record) error {
	var buf bytes.Buffer
	h := slog.Handler(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	if len(r.attrs) > 0 {
		h = h.WithAttrs(r.attrs)
	}
	for _, g := range r.groups {
		h = h.WithGroup(g)
	}
	if err := h.Handle(context.Background(), rec); err != nil {
		return err
	}
	r.shared.mu.Lock()
	r.shared.lines = append(r.shared.lines, strings.TrimSuffix(buf.String(), "\n"))
	r.shared.mu.Unlock()
	return nil
}

// WithAttrs returns a Recorder sharing r's lines whose records carry attrs.
func (r *Recorder) WithAttrs(attrs []slog.Attr) slog.Handler {
	c := *r
	c.attrs = append(append([]slog.Attr(nil), r.attrs...), attrs...)
	return &c
}

// WithGroup returns a Recorder sharing r's lines whose later attributes are
// in group name.
func (r *Recorder) WithGroup(name string) slog.Handler {
	c := *r
	c.groups = append(append([]string(nil), r.groups...), name)
	return &c
}

// Lines returns a copy of the recorded lines, in order.
func (r *Recorder) Lines() []string {
	r.shared.mu.Lock()
	defer r.shared.mu.Unlock()
	return append([]string(nil), r.shared.lines...)
}

// Finding is a secret found in a line.
type Finding struct {
	What string // what the secret is, as given to Secret
	Line string // the whole line
}

// Scan returns the findings of ScanLines over the recorded lines.
func (r *Recorder) Scan() []Finding { return r.ScanLines(r.Lines()) }

// Check fails t for each finding of Scan, and also when nothing was
// recorded at all (a logger that was never wired in would pass any scan).
func (r *Recorder) Check(t testing.TB) {
	t.Helper()
	if len(r.Lines()) == 0 {
		t.Errorf("logscan: no log line was recorded; is the Recorder wired in as the Logger?")
	}
	r.CheckLines(t, r.Lines())
}

// containsAnyForm reports whether line holds s raw, JSON-escaped or quoted
// by strconv.Quote (what %q and many handlers produce).
func containsAnyForm(line, s string) bool {
	if strings.Contains(line, s) {
		return true
	}
	if j, err := json.Marshal(s); err == nil && strings.Contains(line, string(j[1:len(j)-1])) {
		return true
	}
	q := strconv.Quote(s)
	return strings.Contains(line, q[1:len(q)-1])
}
