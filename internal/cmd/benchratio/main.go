// Command benchratio reads `go test -bench` output on stdin and prints, per
// package and benchmark group, the median ns/op, ops/s and allocations of
// each sub-benchmark and its throughput relative to a baseline measured in
// the same run: every scenario against "bare", and the read scenarios
// (replay, mismatch) also against "pk_select". With several runs of a
// benchmark (-count, or repeated invocations appended to one file), the
// i-th result of a scenario is paired with the i-th result of its baseline
// and the ratio is the median of those per-run ratios.
//
//	go test -run '^$' -bench BenchmarkIdem ./postgres/ ./mysql/ ./sqlite/ | go run ./internal/cmd/benchratio
//
// Output is Markdown, one table per package and group (such as
// BenchmarkIdem/c=8). Only the standard library is used.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

func main() {
	base := flag.String("base", "bare", "scenario every other is compared with")
	readBase := flag.String("read-base", "pk_select", "scenario the read scenarios are also compared with")
	reads := flag.String("reads", "replay,mismatch", "comma-separated read scenarios")
	flag.Parse()
	runs, err := parse(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchratio:", err)
		os.Exit(1)
	}
	if len(runs.groups) == 0 {
		fmt.Fprintln(os.Stderr, "benchratio: no benchmark results on stdin")
		os.Exit(1)
	}
	report(os.Stdout, runs, options{base: *base, readBase: *readBase, reads: strings.Split(*reads, ",")})
}

// result is one benchmark line's metrics.
type result struct {
	ns, bytes, allocs float64
}

// group is the sub-benchmarks sharing a parent, in order of appearance.
type group struct {
	pkg, name string
	order     []string
	results   map[string][]result
}

type results struct {
	groups []*group
}

// procsSuffix is the -GOMAXPROCS suffix go test appends to names.
var procsSuffix = regexp.MustCompile(`-\d+$`)

// parse reads benchmark lines ("BenchmarkX/a/b-2  N  v ns/op  v B/op ...")
// and the "pkg:" lines that say which package they belong to.
func parse(r io.Reader) (*results, error) {
	out := &results{}
	index := map[string]*group{}
	pkg := ""
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if p, ok := strings.CutPrefix(line, "pkg: "); ok {
			pkg = strings.TrimSpace(p)
			continue
		}
		f := strings.Fields(line)
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") {
			continue
		}
		if _, err := strconv.Atoi(f[1]); err != nil {
			continue // not a result line (a log line starting with Benchmark)
		}
		var res result
		for i := 2; i+1 < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				return nil, fmt.Errorf("%q: %w", line, err)
			}
			switch f[i+1] {
			case "ns/op":
				res.ns = v
			case "B/op":
				res.bytes = v
			case "allocs/op":
				res.allocs = v
			}
		}
		if res.ns == 0 {
			continue
		}
		name := procsSuffix.ReplaceAllString(f[0], "")
		parent, scenario := "", name
		if i := strings.LastIndexByte(name, '/'); i >= 0 {
			parent, scenario = name[:i], name[i+1:]
		}
		key := pkg + "\x00" + parent
		g := index[key]
		if g == nil {
			g = &group{pkg: pkg, name: parent, results: map[string][]result{}}
			index[key] = g
			out.groups = append(out.groups, g)
		}
		if _, seen := g.results[scenario]; !seen {
			g.order = append(g.order, scenario)
		}
		g.results[scenario] = append(g.results[scenario], res)
	}
	return out, sc.Err()
}

type options struct {
	base, readBase string
	reads          []string
}

// row is one scenario's line of a table.
type row struct {
	scenario             string
	runs                 int
	ns, spread           float64 // median ns/op; (max-min)/median
	allocs, bytes        float64 // medians
	vsBase, vsReadBase   float64 // throughput ratios; 0 when not applicable
	hasBase, hasReadBase bool
}

func rows(g *group, o options) []row {
	var out []row
	for _, s := range g.order {
		rs := g.results[s]
		ns := pluck(rs, func(r result) float64 { return r.ns })
		r := row{
			scenario: s,
			runs:     len(rs),
			ns:       median(ns),
			allocs:   median(pluck(rs, func(r result) float64 { return r.allocs })),
			bytes:    median(pluck(rs, func(r result) float64 { return r.bytes })),
		}
		r.spread = (slices.Max(ns) - slices.Min(ns)) / r.ns
		if b, ok := g.results[o.base]; ok {
			r.vsBase, r.hasBase = ratio(b, rs), true
		}
		if b, ok := g.results[o.readBase]; ok && slices.Contains(o.reads, s) {
			r.vsReadBase, r.hasReadBase = ratio(b, rs), true
		}
		out = append(out, r)
	}
	return out
}

// ratio is the throughput of rs relative to base: the median over runs i
// of base[i].ns / rs[i].ns.
func ratio(base, rs []result) float64 {
	n := min(len(base), len(rs))
	rr := make([]float64, n)
	for i := range n {
		rr[i] = base[i].ns / rs[i].ns
	}
	return median(rr)
}

func report(w io.Writer, res *results, o options) {
	for _, g := range res.groups {
		fmt.Fprintf(w, "### %s %s\n\n", path.Base(g.pkg), g.name)
		fmt.Fprintf(w, "| scenario | runs | ns/op | spread | ops/s | ÷ %s | ÷ %s | allocs/op | B/op |\n", o.base, o.readBase)
		fmt.Fprintln(w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
		for _, r := range rows(g, o) {
			vs, vsRead := "", ""
			if r.hasBase {
				vs = fmt.Sprintf("%.2f", r.vsBase)
			}
			if r.hasReadBase {
				vsRead = fmt.Sprintf("%.2f", r.vsReadBase)
			}
			fmt.Fprintf(w, "| %s | %d | %.0f | %.0f%% | %.0f | %s | %s | %.0f | %.0f |\n",
				r.scenario, r.runs, r.ns, 100*r.spread, 1e9/r.ns, vs, vsRead, r.allocs, r.bytes)
		}
		fmt.Fprintln(w)
	}
}

func pluck(rs []result, f func(result) float64) []float64 {
	out := make([]float64, len(rs))
	for i, r := range rs {
		out[i] = f(r)
	}
	return out
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}
