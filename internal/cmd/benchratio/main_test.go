package main

import (
	"math"
	"strings"
	"testing"
)

// sample is captured go test output (two runs of two packages, trimmed),
// with the noise a real run prints between results.
const sample = `goos: linux
goarch: amd64
pkg: github.com/idemstore/idem/postgres
cpu: Intel(R) Xeon(R) Processor
BenchmarkIdem/c=1/bare-2    	     639	    400000 ns/op	     496 B/op	      12 allocs/op
BenchmarkIdem/c=1/tx-2      	     177	    800000 ns/op	    6904 B/op	     149 allocs/op
BenchmarkIdem/c=1/replay-2  	    1321	    200000 ns/op	    6409 B/op	     145 allocs/op
BenchmarkIdem/c=1/pk_select-2	    5329	    100000 ns/op	    1060 B/op	      15 allocs/op
BenchmarkIdem/c=8/bare-2    	    1964	    100000 ns/op	     497 B/op	      12 allocs/op
BenchmarkIdem/c=8/tx-2      	     519	    250000 ns/op	    6822 B/op	     149 allocs/op
PASS
ok  	github.com/idemstore/idem/postgres	11.034s
goos: linux
goarch: amd64
pkg: github.com/idemstore/idem/sqlite
cpu: Intel(R) Xeon(R) Processor
BenchmarkIdem/c=1/bare-2    	     728	    300000 ns/op	     615 B/op	      17 allocs/op
BenchmarkIdem/c=1/tx-2      	     483	    400000 ns/op	    5207 B/op	     131 allocs/op
PASS
ok  	github.com/idemstore/idem/sqlite	6.537s
pkg: github.com/idemstore/idem/postgres
BenchmarkIdem/c=1/bare-2    	     639	    200000 ns/op	     496 B/op	      12 allocs/op
BenchmarkIdem/c=1/tx-2      	     177	    500000 ns/op	    6904 B/op	     151 allocs/op
BenchmarkIdem/c=1/replay-2  	    1321	    210000 ns/op	    6409 B/op	     145 allocs/op
BenchmarkIdem/c=1/pk_select-2	    5329	    105000 ns/op	    1060 B/op	      15 allocs/op
BenchmarkIdem/c=8/bare-2    	    1964	    120000 ns/op	     497 B/op	      12 allocs/op
BenchmarkIdem/c=8/tx-2      	     519	    240000 ns/op	    6822 B/op	     149 allocs/op
BenchmarkIdem/c=8/tx-2      	     519	    260000 ns/op	    6822 B/op	     149 allocs/op
BenchmarkLog starts a log line, not a result
`

func TestRows(t *testing.T) {
	t.Parallel()
	res, err := parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	o := options{base: "bare", readBase: "pk_select", reads: []string{"replay", "mismatch"}}
	type want struct {
		runs               int
		ns, spread, allocs float64
		vsBase, vsRead     float64 // -1: not applicable
	}
	tests := []struct {
		pkg, group string
		rows       map[string]want
	}{
		{"github.com/idemstore/idem/postgres", "BenchmarkIdem/c=1", map[string]want{
			// Per-run ratios 400/800 and 200/500: median 0.45.
			"bare":      {2, 300000, 2.0 / 3, 12, 1, -1},
			"tx":        {2, 650000, 300.0 / 650, 150, 0.45, -1},
			"replay":    {2, 205000, 10.0 / 205, 145, (2 + 200.0/210) / 2, (0.5 + 105.0/210) / 2},
			"pk_select": {2, 102500, 5.0 / 102.5, 15, (4 + 200.0/105) / 2, -1},
		}},
		// Three tx results (250, 240, 260) against two bare ones (100, 120):
		// the first two pair up, the third has no partner.
		{"github.com/idemstore/idem/postgres", "BenchmarkIdem/c=8", map[string]want{
			"bare": {2, 110000, 20.0 / 110, 12, 1, -1},
			"tx":   {3, 250000, 20.0 / 250, 149, (100.0/250 + 120.0/240) / 2, -1},
		}},
		{"github.com/idemstore/idem/sqlite", "BenchmarkIdem/c=1", map[string]want{
			"bare": {1, 300000, 0, 17, 1, -1},
			"tx":   {1, 400000, 0, 131, 0.75, -1},
		}},
	}
	if len(res.groups) != len(tests) {
		t.Fatalf("got %d groups, want %d", len(res.groups), len(tests))
	}
	for i, tt := range tests {
		g := res.groups[i]
		if g.pkg != tt.pkg || g.name != tt.group {
			t.Fatalf("group %d is %s %s, want %s %s", i, g.pkg, g.name, tt.pkg, tt.group)
		}
		rs := rows(g, o)
		if len(rs) != len(tt.rows) {
			t.Errorf("%s: %d rows, want %d", tt.group, len(rs), len(tt.rows))
		}
		for _, r := range rs {
			w, ok := tt.rows[r.scenario]
			if !ok {
				t.Errorf("%s: unexpected scenario %q", tt.group, r.scenario)
				continue
			}
			if r.runs != w.runs {
				t.Errorf("%s/%s: runs %d, want %d", tt.group, r.scenario, r.runs, w.runs)
			}
			for _, c := range []struct {
				what      string
				got, want float64
				has       bool
			}{
				{"ns/op", r.ns, w.ns, true},
				{"spread", r.spread, w.spread, true},
				{"allocs/op", r.allocs, w.allocs, true},
				{"÷ bare", r.vsBase, w.vsBase, r.hasBase},
				{"÷ pk_select", r.vsReadBase, w.vsRead, r.hasReadBase},
			} {
				if c.want < 0 {
					if c.has {
						t.Errorf("%s/%s: %s = %v, want none", tt.group, r.scenario, c.what, c.got)
					}
					continue
				}
				if !c.has || math.Abs(c.got-c.want) > 1e-9 {
					t.Errorf("%s/%s: %s = %v (present %v), want %v", tt.group, r.scenario, c.what, c.got, c.has, c.want)
				}
			}
		}
	}
}

func TestReport(t *testing.T) {
	t.Parallel()
	res, err := parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	report(&b, res, options{base: "bare", readBase: "pk_select", reads: []string{"replay"}})
	out := b.String()
	for _, want := range []string{
		"### postgres BenchmarkIdem/c=1\n",
		"| scenario | runs | ns/op | spread | ops/s | ÷ bare | ÷ pk_select | allocs/op | B/op |\n",
		"| tx | 2 | 650000 | 46% | 1538 | 0.45 |  | 150 | 6904 |\n",
		"| replay | 2 | 205000 | 5% | 4878 | 1.48 | 0.50 | 145 | 6409 |\n",
		"### sqlite BenchmarkIdem/c=1\n",
		"| tx | 1 | 400000 | 0% | 2500 | 0.75 |  | 131 | 5207 |\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

func TestParseRejectsBadNumber(t *testing.T) {
	t.Parallel()
	_, err := parse(strings.NewReader("BenchmarkX-2  10  abc ns/op\n"))
	if err == nil {
		t.Fatal("want an error for a malformed value")
	}
}
