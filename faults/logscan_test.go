//go:build faults

package faults

// The log scan: every log line the suite's services write (the in-process
// service's slog handlers, the orders processes' stderr) is checked against
// everything the suite sent them: idempotency keys, tenants, scopes and
// fragments of request bodies. A line that carries one fails the test that
// owns the service (docs: keys, scopes and bodies never reach logs raw).
//
// Lines and needles are compared as sequences of words (runs of letters and
// digits), so a key is found however a handler quoted or escaped it: the
// text handler's key="acme-1", the JSON handler's \"acme-1\", an error
// message's "lookup acme-1: ...". A needle must match whole words: the hex
// of a digest never contains a key's words by chance.
//
// TODO(lead): internal/logscan (branch validate) is the reusable scanner;
// this one can be folded into it.

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"unicode"
)

// logSecrets holds everything the suite sent, for every test of the run: a
// line that carries another test's key is as much a leak.
var logSecrets = newSecretSet()

// logScanned counts the lines scanned by the whole run.
var logScanned atomic.Int64

// secretSet is a set of needles, each a word sequence, indexed by its
// longest word.
type secretSet struct {
	mu    sync.RWMutex
	seen  map[string]bool
	index map[string][]secretNeedle
	n     int
}

type secretNeedle struct {
	words []string
	at    int    // the position of the index word in words
	kind  string // "key", "tenant", "scope", "body"
}

func newSecretSet() *secretSet {
	return &secretSet{seen: map[string]bool{}, index: map[string][]secretNeedle{}}
}

// logWords splits s into its runs of letters and digits.
func logWords(s string) []string {
	return strings.FieldsFunc(s, func(r rune) bool { return !unicode.IsLetter(r) && !unicode.IsDigit(r) })
}

// add registers raw as a needle of kind. Needles of fewer than 4 letters
// and digits are skipped: too short to tell from ordinary words.
func (s *secretSet) add(kind, raw string) {
	words := logWords(raw)
	letters, at := 0, 0
	for i, w := range words {
		letters += len(w)
		if len(w) > len(words[at]) {
			at = i
		}
	}
	if letters < 4 {
		return
	}
	joined := strings.Join(words, " ")
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seen[joined] {
		return
	}
	s.seen[joined] = true
	s.index[words[at]] = append(s.index[words[at]], secretNeedle{words: words, at: at, kind: kind})
	s.n++
}

// addRequest registers what one request sends: its tenant, key, scope and
// body (whole, and each member of a JSON object as "name value").
func (s *secretSet) addRequest(tenant, key, method, path, body string) {
	s.add("key", key)
	s.add("tenant", tenant)
	s.add("scope", tenant+" "+method+" "+path)
	s.add("body", body)
	var members map[string]json.RawMessage
	if json.Unmarshal([]byte(body), &members) == nil {
		for name, v := range members {
			s.add("body", name+" "+string(v))
			var str string
			if json.Unmarshal(v, &str) == nil {
				s.add("body", str)
			}
		}
	}
}

// find returns the kind and text of a needle line carries.
func (s *secretSet) find(line string) (kind, needle string, ok bool) {
	words := logWords(line)
	s.mu.RLock()
	defer s.mu.RUnlock()
	for i, w := range words {
		for _, n := range s.index[w] {
			start := i - n.at
			if start < 0 || start+len(n.words) > len(words) {
				continue
			}
			match := true
			for j, nw := range n.words {
				if words[start+j] != nw {
					match = false
					break
				}
			}
			if match {
				return n.kind, strings.Join(n.words, " "), true
			}
		}
	}
	return "", "", false
}

// Len is the number of needles.
func (s *secretSet) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.n
}

// logSink is an io.Writer that scans every line written to it against
// logSecrets. Safe for concurrent use.
type logSink struct {
	name string
	set  *secretSet

	mu    sync.Mutex
	part  []byte // an unfinished line
	lines int
	leaks []string
}

// newLogSink returns a sink whose leaks fail t when t ends. Register it
// before whatever writes to it is stopped in t.Cleanup, so that it checks
// after the last line.
func newLogSink(t *testing.T, name string) *logSink {
	s := &logSink{name: name, set: logSecrets}
	t.Cleanup(func() { s.check(t) })
	return s
}

func (s *logSink) Write(b []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.part = append(s.part, b...)
	for {
		i := strings.IndexByte(string(s.part), '\n')
		if i < 0 {
			break
		}
		s.scan(string(s.part[:i]))
		s.part = s.part[i+1:]
	}
	return len(b), nil
}

func (s *logSink) scan(line string) {
	s.lines++
	logScanned.Add(1)
	if kind, needle, ok := s.set.find(line); ok && len(s.leaks) < 10 {
		if len(line) > 300 {
			line = line[:300] + "…"
		}
		s.leaks = append(s.leaks, fmt.Sprintf("raw %s %q in: %s", kind, needle, line))
	}
}

// check scans an unfinished last line and fails t on every leak found.
func (s *logSink) check(t *testing.T) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.part) > 0 {
		s.scan(string(s.part))
		s.part = nil
	}
	for _, l := range s.leaks {
		t.Errorf("log scan, %s: %s", s.name, l)
	}
	if len(s.leaks) == 0 {
		t.Logf("log scan, %s: %d lines, no raw key, tenant, scope or body among %d needles", s.name, s.lines, s.set.Len())
	}
}

// logSinkLogger is a logger that writes every record, debug included, to
// a new sink of t's.
func logSinkLogger(t *testing.T, name string) *slog.Logger {
	return slog.New(slog.NewTextHandler(newLogSink(t, name), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

var _ io.Writer = (*logSink)(nil)

// TestLogScan checks the scanner itself: a leak in any quoting is found, a
// digest is not, and a clean run of the suite proves nothing unless this
// passes.
func TestLogScan(t *testing.T) {
	set := newSecretSet()
	set.addRequest("acme", "order-7f3a9c", "POST", "/orders", `{"sku":"sku-12","qty":1,"amount_cents":112}`)
	set.add("key", "ab") // too short to register
	leaks := []string{
		`time=x level=WARN msg="status check failed" error="lookup order-7f3a9c: not found"`,
		`{"level":"WARN","error":"lookup \"order-7f3a9c\""}`,
		`level=INFO msg=x scope="acme POST /orders"`,
		`level=INFO msg=x body="{\"sku\":\"sku-12\",\"qty\":1}"`,
		`level=INFO msg=x amount_cents=112`,
		`level=INFO msg=x tenant=acme`,
	}
	for _, l := range leaks {
		s := &logSink{name: "test", set: set}
		_, _ = io.WriteString(s, l+"\n")
		if len(s.leaks) != 1 {
			t.Errorf("not found in %q", l)
		}
	}
	clean := []string{
		`time=x level=INFO msg="idemhttp: request" outcome=created method=POST status=201 key=3f9a0c1d2e4b scope=9c1d2e latency=3ms`,
		`level=DEBUG msg="idem: created" dialect=postgres key=order7f3a9cX`,
		`level=INFO msg=x ab=1 qty=2`,
	}
	for _, l := range clean {
		s := &logSink{name: "test", set: set}
		_, _ = io.WriteString(s, l) // no newline: check scans the rest
		s.check(t)
		if s.lines != 1 {
			t.Errorf("scanned %d lines of %q, want 1", s.lines, l)
		}
	}
}
