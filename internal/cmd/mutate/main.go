// Command mutate is a small mutation tester for idem's decision code: it
// generates operator mutants of the Go files that decide a claim's outcome
// (comparison flips, boolean negation, skipped if statements such as error
// returns, off-by-one constants) and SQL mutants of the dialects' query
// strings (<, <=, >, >= swapped, a WHERE conjunct dropped, FOR UPDATE or SKIP
// LOCKED removed), then runs the conformance suite once per mutant and
// records whether it was killed, survived or timed out.
//
// A mutant never touches the checkout: the mutated file is written to a
// temporary directory and handed to go test with -overlay, so the build
// sees it in place of the original and every other file as it is.
//
// Usage (from the repository root; see docs/reliability.md, "Mutation
// testing", and make mutation):
//
//	go run ./internal/cmd/mutate -sample 60 -seed 1
//	go run ./internal/cmd/mutate -list            # print every mutant, run nothing
//	go run ./internal/cmd/mutate -only store.go:412:cmp   # rerun chosen mutants
//
// The root package's files are tested on SQLite first and, when SQLite does
// not kill the mutant, on PostgreSQL; a dialect's own files are tested on
// that dialect's suite only (MySQL's only with -mysql). The server tests run
// with IDEM_TEST_REQUIRE_DB=1, so an unreachable server fails the run
// instead of letting every mutant survive on skips; a baseline run of the
// unmutated tree must pass first.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
)

// defaultFiles is the decision code: the Store's claim and completion logic,
// the lease, the reaper, and each dialect's claim and completion SQL.
var defaultFiles = []string{
	"store.go", "claim.go", "do.go", "config.go", "lease.go", "reaper.go",
	"postgres/queries.go", "postgres/postgres.go",
	"mysql/queries.go", "mysql/mysql.go",
	"sqlite/queries.go", "sqlite/sqlite.go",
}

type mutant struct {
	ID    string // file:line:op:n, stable across runs of the same tree
	File  string
	Line  int
	Op    string
	Desc  string
	start int // byte span of the original text replaced by repl
	end   int
	repl  string
}

type result struct {
	Mutant   *mutant
	Status   string // killed, survived, timeout, invalid (does not build)
	KilledBy string // the suite that killed it
	Detail   string // first failing test, when killed
	Elapsed  time.Duration
}

func main() {
	var (
		files   = flag.String("files", strings.Join(defaultFiles, ","), "comma-separated files to mutate, relative to the repository root")
		sample  = flag.Int("sample", 16, "number of Go operator mutants to run, chosen at random with -seed (-1: all)")
		sqlN    = flag.Int("sample-sql", 8, "number of SQL mutants to run, chosen at random with -seed (-1: all)")
		seed    = flag.Uint64("seed", 1, "seed of the sample")
		only    = flag.String("only", "", "comma-separated mutant IDs (or ID prefixes) to run instead of a sample")
		list    = flag.Bool("list", false, "print the mutants and exit")
		mysql   = flag.Bool("mysql", false, "also mutate the MySQL dialect's files and run its suite (MariaDB)")
		timeout = flag.Duration("timeout", 150*time.Second, "per suite run; a run that exceeds it counts as timed out (killed)")
		out     = flag.String("out", "", "also write the results as JSON lines to this file")
		run     = flag.String("run", "^TestConformance$", "the go test -run pattern")
	)
	flag.Parse()
	if err := mainErr(*files, *sample, *sqlN, *seed, *only, *list, *mysql, *timeout, *out, *run); err != nil {
		fmt.Fprintln(os.Stderr, "mutate:", err)
		os.Exit(1)
	}
}

func mainErr(files string, sample, sqlN int, seed uint64, only string, list, mysql bool, timeout time.Duration, out, runPattern string) error {
	var all []*mutant
	perFile := map[string]int{}
	for _, f := range strings.Split(files, ",") {
		f = strings.TrimSpace(f)
		if f == "" || (!mysql && strings.HasPrefix(f, "mysql/")) {
			continue
		}
		ms, err := generate(f)
		if err != nil {
			return err
		}
		perFile[f] = len(ms)
		all = append(all, ms...)
	}
	chosen := all
	switch {
	case only != "":
		chosen = nil
		for _, m := range all {
			for _, id := range strings.Split(only, ",") {
				if id != "" && strings.HasPrefix(m.ID, id) {
					chosen = append(chosen, m)
					break
				}
			}
		}
	default:
		// Go and SQL mutants are sampled apart: the SQL ones are few and
		// each is a whole statement's decision, so they get a larger share.
		var goMs, sqlMs []*mutant
		for _, m := range all {
			if strings.HasPrefix(m.Op, "sql") {
				sqlMs = append(sqlMs, m)
			} else {
				goMs = append(goMs, m)
			}
		}
		chosen = append(pick(goMs, sample, seed), pick(sqlMs, sqlN, seed)...)
	}
	fmt.Printf("mutants: %d generated", len(all))
	for _, f := range sortedKeys(perFile) {
		fmt.Printf(" %s=%d", f, perFile[f])
	}
	fmt.Printf("; %d chosen\n", len(chosen))
	if list {
		for _, m := range chosen {
			fmt.Printf("%-34s %s\n", m.ID, m.Desc)
		}
		return nil
	}

	tmp, err := os.MkdirTemp("", "idem-mutate-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)

	// Baseline: a suite that fails unmutated would kill every mutant.
	for _, s := range []string{"sqlite", "postgres"} {
		st, detail, _ := runSuite(s, "", timeout, runPattern)
		if st != "survived" {
			return fmt.Errorf("baseline: the %s suite does not pass unmutated (%s): %s", s, st, detail)
		}
	}
	if mysql {
		if st, detail, _ := runSuite("mysql", "", timeout, runPattern); st != "survived" {
			return fmt.Errorf("baseline: the mysql suite does not pass unmutated (%s): %s", st, detail)
		}
	}
	fmt.Println("baseline: sqlite and postgres suites pass unmutated")

	var jsonOut *os.File
	if out != "" {
		if jsonOut, err = os.Create(out); err != nil {
			return err
		}
		defer jsonOut.Close()
	}
	counts := map[string]int{}
	var results []result
	for i, m := range chosen {
		res, err := runMutant(m, tmp, timeout, runPattern)
		if err != nil {
			return err
		}
		counts[res.Status]++
		results = append(results, res)
		fmt.Printf("[%d/%d] %-8s %-34s %s", i+1, len(chosen), res.Status, m.ID, m.Desc)
		if res.KilledBy != "" {
			fmt.Printf("  (%s: %s)", res.KilledBy, res.Detail)
		}
		fmt.Printf(" %s\n", res.Elapsed.Round(time.Second))
		if jsonOut != nil {
			b, _ := json.Marshal(map[string]any{
				"id": m.ID, "desc": m.Desc, "status": res.Status,
				"killed_by": res.KilledBy, "detail": res.Detail, "seconds": res.Elapsed.Seconds(),
			})
			fmt.Fprintln(jsonOut, string(b))
		}
	}
	valid := len(chosen) - counts["invalid"]
	killed := counts["killed"] + counts["timeout"]
	fmt.Printf("\nscore: %d/%d killed (%d by a failing test, %d by timeout), %d survived, %d did not build (not counted)\n",
		killed, valid, counts["killed"], counts["timeout"], counts["survived"], counts["invalid"])
	if counts["survived"] > 0 {
		fmt.Println("survivors:")
		for _, r := range results {
			if r.Status == "survived" {
				fmt.Printf("  %-34s %s\n", r.Mutant.ID, r.Mutant.Desc)
			}
		}
	}
	return nil
}

// pick returns n of ms chosen at random with seed (all when n < 0 or n
// >= len(ms)), in file order.
func pick(ms []*mutant, n int, seed uint64) []*mutant {
	if n < 0 || n >= len(ms) {
		return ms
	}
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	idx := r.Perm(len(ms))[:n]
	sort.Ints(idx)
	out := make([]*mutant, 0, n)
	for _, i := range idx {
		out = append(out, ms[i])
	}
	return out
}

// suitesFor lists the conformance runs that test a file, in order: the
// first that fails kills the mutant and the rest are not run.
func suitesFor(file string) []string {
	switch {
	case strings.HasPrefix(file, "postgres/"):
		return []string{"postgres"}
	case strings.HasPrefix(file, "mysql/"):
		return []string{"mysql"}
	case strings.HasPrefix(file, "sqlite/"):
		return []string{"sqlite"}
	default:
		return []string{"sqlite", "postgres"}
	}
}

func runMutant(m *mutant, tmp string, timeout time.Duration, runPattern string) (result, error) {
	start := time.Now()
	src, err := os.ReadFile(m.File)
	if err != nil {
		return result{}, err
	}
	mutated := string(src[:m.start]) + m.repl + string(src[m.end:])
	abs, err := filepath.Abs(m.File)
	if err != nil {
		return result{}, err
	}
	mfile := filepath.Join(tmp, "mutant.go")
	if err := os.WriteFile(mfile, []byte(mutated), 0o644); err != nil {
		return result{}, err
	}
	overlay := filepath.Join(tmp, "overlay.json")
	b, _ := json.Marshal(map[string]any{"Replace": map[string]string{abs: mfile}})
	if err := os.WriteFile(overlay, b, 0o644); err != nil {
		return result{}, err
	}
	res := result{Mutant: m, Status: "survived"}
	for _, s := range suitesFor(m.File) {
		st, detail, _ := runSuite(s, overlay, timeout, runPattern)
		if st != "survived" {
			res.Status, res.KilledBy, res.Detail = st, s, detail
			break
		}
	}
	res.Elapsed = time.Since(start)
	return res, nil
}

var (
	failLine  = regexp.MustCompile(`(?m)^\s*--- FAIL: (\S+)`)
	buildFail = regexp.MustCompile(`(?m)\[build failed\]|\[setup failed\]|^# github.com/idemstore`)
)

// runSuite runs one dialect's conformance test with overlay (none when
// empty) and classifies the outcome: survived (the suite passed), killed,
// timeout, or invalid (the mutant does not compile).
func runSuite(suite, overlay string, timeout time.Duration, runPattern string) (status, detail string, output []byte) {
	args := []string{"test", "-count=1", "-failfast", "-timeout", timeout.String(), "-run", runPattern}
	if overlay != "" {
		args = append(args, "-overlay", overlay)
	}
	args = append(args, "./"+suite+"/")
	// The go test -timeout makes a hung test binary panic with its stacks;
	// the context is a backstop for a hang outside the test binary.
	ctx, cancel := context.WithTimeout(context.Background(), timeout+60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Env = append(os.Environ(), "IDEM_TEST_REQUIRE_DB=1")
	// The test binary, a child of go, can outlive it and hold the output
	// pipe open; do not wait for it past the deadline.
	cmd.WaitDelay = 10 * time.Second
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	err := cmd.Run()
	output = buf.Bytes()
	if err == nil {
		return "survived", "", output
	}
	switch {
	case ctx.Err() != nil || bytes.Contains(output, []byte("panic: test timed out")):
		return "timeout", "", output
	case buildFail.Match(output):
		return "invalid", firstLines(output, 3), output
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return "invalid", err.Error(), output
	}
	fails := failLine.FindAllSubmatch(output, -1)
	if len(fails) > 0 {
		// The deepest failing subtest names the case; the last FAIL line
		// printed is its parent, so take the longest name.
		best := ""
		for _, f := range fails {
			if n := string(f[1]); len(n) > len(best) {
				best = n
			}
		}
		return "killed", best, output
	}
	return "killed", firstLines(output, 2), output
}

func firstLines(b []byte, n int) string {
	lines := strings.SplitN(strings.TrimSpace(string(b)), "\n", n+1)
	if len(lines) > n {
		lines = lines[:n]
	}
	return strings.Join(lines, " | ")
}

func sortedKeys(m map[string]int) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// generate lists every mutant of file.
func generate(file string) ([]*mutant, error) {
	src, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, file, src, parser.SkipObjectResolution)
	if err != nil {
		return nil, err
	}
	tf := fset.File(f.Pos())
	off := func(p token.Pos) int { return tf.Offset(p) }
	var ms []*mutant
	seen := map[string]int{}
	add := func(op string, start, end int, repl, desc string) {
		line := tf.Line(tf.Pos(start))
		base := fmt.Sprintf("%s:%d:%s", file, line, op)
		seen[base]++
		ms = append(ms, &mutant{
			ID: fmt.Sprintf("%s:%d", base, seen[base]), File: file, Line: line, Op: op,
			Desc: desc, start: start, end: end, repl: repl,
		})
	}
	text := func(n ast.Node) string { return string(src[off(n.Pos()):off(n.End())]) }

	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.GenDecl:
			// Type declarations and imports hold nothing to mutate; var and
			// const declarations do (the SQL strings, sizes).
			return n.Tok == token.CONST || n.Tok == token.VAR
		case *ast.BinaryExpr:
			if repl, ok := flips[n.Op]; ok {
				p := off(n.OpPos)
				add("cmp", p, p+len(n.Op.String()), repl.String(),
					fmt.Sprintf("%s: %s -> %s", short(text(n)), n.Op, repl))
			}
		case *ast.UnaryExpr:
			if n.Op == token.NOT {
				p := off(n.OpPos)
				add("not", p, p+1, "", fmt.Sprintf("%s: ! removed", short(text(n))))
			}
		case *ast.IfStmt:
			// Skipping the branch: a dropped error return, a dropped
			// check. An else branch then always runs.
			add("skipif", off(n.Cond.Pos()), off(n.Cond.End()), "false",
				fmt.Sprintf("if %s: never taken", short(text(n.Cond))))
		case *ast.BasicLit:
			switch n.Kind {
			case token.INT:
				if v, err := strconv.ParseInt(n.Value, 0, 64); err == nil {
					add("const", off(n.Pos()), off(n.End()), strconv.FormatInt(v+1, 10),
						fmt.Sprintf("constant %s -> %d", n.Value, v+1))
				}
			case token.STRING:
				sqlMutants(n.Value, off(n.Pos()), add)
			}
		}
		return true
	})
	return ms, nil
}

var flips = map[token.Token]token.Token{
	token.EQL: token.NEQ, token.NEQ: token.EQL,
	token.LSS: token.LEQ, token.LEQ: token.LSS,
	token.GTR: token.GEQ, token.GEQ: token.GTR,
	token.LAND: token.LOR, token.LOR: token.LAND,
}

var (
	sqlWord   = regexp.MustCompile(`\b(SELECT|INSERT|UPDATE|DELETE)\b`)
	sqlCmp    = regexp.MustCompile(` (<=|>=|<|>) `)
	sqlLock   = regexp.MustCompile(`\s(FOR UPDATE|SKIP LOCKED)\b`)
	sqlAnd    = regexp.MustCompile(`\bAND\b`)
	sqlNot    = regexp.MustCompile(`\bNOT `)
	conjunctE = regexp.MustCompile(`^(AND|OR|RETURNING|ORDER|LIMIT|FOR|GROUP|SET|WHEN|THEN|ELSE|END|UNION|ON)\b`)
	sqlSwap   = map[string]string{"<": "<=", "<=": "<", ">": ">=", ">=": ">"}
)

// sqlMutants adds the SQL mutants of one string literal (lit is its source
// text, at byte offset base in the file).
func sqlMutants(lit string, base int, add func(op string, start, end int, repl, desc string)) {
	if !sqlWord.MatchString(lit) {
		return
	}
	for _, m := range sqlCmp.FindAllStringSubmatchIndex(lit, -1) {
		op := lit[m[2]:m[3]]
		add("sqlcmp", base+m[2], base+m[3], sqlSwap[op],
			fmt.Sprintf("SQL %q: %s -> %s", around(lit, m[2]), op, sqlSwap[op]))
	}
	for _, m := range sqlLock.FindAllStringSubmatchIndex(lit, -1) {
		add("sqllock", base+m[2], base+m[3], "",
			fmt.Sprintf("SQL %q: %s removed", around(lit, m[2]), lit[m[2]:m[3]]))
	}
	for _, m := range sqlNot.FindAllStringIndex(lit, -1) {
		add("sqlnot", base+m[0], base+m[1], "", fmt.Sprintf("SQL %q: NOT removed", around(lit, m[0])))
	}
	for _, m := range sqlAnd.FindAllStringIndex(lit, -1) {
		end := conjunctEnd(lit, m[1])
		if end < 0 {
			continue
		}
		dropped := strings.Join(strings.Fields(lit[m[0]:end]), " ")
		add("sqldrop", base+m[0], base+end, "", fmt.Sprintf("SQL conjunct dropped: %q", short(dropped)))
	}
}

// conjunctEnd finds where the conjunct that starts after an AND at i ends:
// at the next keyword that ends an expression at the same parenthesis
// depth, a closing parenthesis, or the end of the literal. -1 when the AND
// is not a WHERE conjunct we can drop cleanly (BETWEEN ... AND ...).
func conjunctEnd(lit string, i int) int {
	depth := 0
	for j := i; j < len(lit); j++ {
		c := lit[j]
		switch {
		case c == '(':
			depth++
		case c == ')':
			if depth == 0 {
				return trimBack(lit, i, j)
			}
			depth--
		case c == '`' || c == '"':
			if depth == 0 {
				return trimBack(lit, i, j)
			}
		case depth == 0 && (j == 0 || !isWord(lit[j-1])) && conjunctE.MatchString(lit[j:]):
			if j > i+1 {
				return trimBack(lit, i, j)
			}
		}
	}
	return trimBack(lit, i, len(lit))
}

func trimBack(lit string, i, j int) int {
	for j > i && (lit[j-1] == ' ' || lit[j-1] == '\n' || lit[j-1] == '\t') {
		j--
	}
	if j <= i {
		return -1
	}
	return j
}

func isWord(c byte) bool {
	return c == '_' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}

func around(s string, i int) string {
	lo, hi := max(0, i-30), min(len(s), i+30)
	return strings.Join(strings.Fields(s[lo:hi]), " ")
}

func short(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 60 {
		return s[:57] + "..."
	}
	return s
}
