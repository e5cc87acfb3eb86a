package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
)

// summarize is `idembench summarize a.json [b.json …]`: it reads the -json
// reports of earlier runs and prints what docs/performance.md shows, with
// the spread the run's own table hides: per dialect and worker count, a
// matrix of median [min–max] of the per-repetition ratios (each
// repetition's cell ÷ its base of the same repetition), then issue 17's
// targets with their floors, then the reaper. Ratios are only ever taken
// within one report, never across files: two runs on this machine differ
// more than most of what they measure.
func summarize(paths []string, w io.Writer) error {
	if len(paths) == 0 {
		return errors.New("summarize: name the -json reports to read")
	}
	var runs []*runIndex
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			return fmt.Errorf("summarize: %w", err)
		}
		var rep report
		if err := json.Unmarshal(b, &rep); err != nil {
			return fmt.Errorf("summarize: %s: %w", p, err)
		}
		for _, d := range rep.Dialects {
			runs = append(runs, indexRun(p, &rep, d))
		}
	}
	for _, r := range runs {
		r.writeMatrices(w)
	}
	writeTargets(w, runs)
	writeReaper(w, runs)
	return nil
}

// runIndex is one dialect of one report, its rows by cell.
type runIndex struct {
	file, dialect, command string
	rows                   []row
	cell                   map[sampleKey]row
	rtts                   []string
	workers                []int
	isBase                 map[string]bool
}

func indexRun(file string, rep *report, d *dialectResult) *runIndex {
	r := &runIndex{file: file, dialect: d.Dialect, command: rep.Command, rows: d.Rows, cell: make(map[sampleKey]row), isBase: make(map[string]bool)}
	for _, x := range d.Rows {
		if x.Base != "" {
			r.isBase[x.Base] = true
		}
		r.cell[sampleKey{x.RTT, x.Shape, x.Scenario, x.Workers}] = x
		if !slices.Contains(r.rtts, x.RTT) {
			r.rtts = append(r.rtts, x.RTT)
		}
		if !slices.Contains(r.workers, x.Workers) {
			r.workers = append(r.workers, x.Workers)
		}
	}
	return r
}

// term is one factor of a ratio: the throughput of a scenario raised to
// exp (1 above the fraction bar, −1 below it).
type term struct {
	scenario string
	exp      float64
}

func over(num, den string) []term { return []term{{num, 1}, {den, -1}} }

// spread is a ratio over the repetitions: its median, min and max.
type spread struct {
	med, lo, hi float64
	n           int
}

func (s spread) ok() bool { return s.n > 0 }

func (s spread) String() string {
	if !s.ok() {
		return "–"
	}
	if s.n == 1 {
		return fmt.Sprintf("**%.2f**", s.med)
	}
	return fmt.Sprintf("**%.2f** [%.2f–%.2f]", s.med, s.lo, s.hi)
}

// ratio computes, for every repetition the cells of terms all have, the
// product of their throughputs raised to their exponents; the shape ""
// cells (the reads) stand in for a missing shaped one.
func (r *runIndex) ratio(rtt, shape string, workers int, terms []term) spread {
	var perRep [][]float64
	for _, t := range terms {
		c, ok := r.cell[sampleKey{rtt, shape, t.scenario, workers}]
		if !ok {
			c, ok = r.cell[sampleKey{rtt, "", t.scenario, workers}]
		}
		if !ok || len(c.PerRep) == 0 {
			return spread{}
		}
		perRep = append(perRep, c.PerRep)
	}
	n := len(perRep[0])
	for _, p := range perRep {
		n = min(n, len(p))
	}
	var v []float64
	for i := range n {
		x := 1.0
		for j, t := range terms {
			x *= math.Pow(perRep[j][i], t.exp)
		}
		if !math.IsInf(x, 0) && !math.IsNaN(x) {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return spread{}
	}
	return spread{med: median(v), lo: slices.Min(v), hi: slices.Max(v), n: len(v)}
}

// baseOf is the scenario a line of the matrix is divided by: the row's own
// base, or bare for a shaped scenario; "" for the baselines themselves
// (bare, and every scenario another row names as its base, such as httppk).
func (r *runIndex) baseOf(x row) string {
	switch {
	case x.Base != "":
		return x.Base
	case r.isBase[x.Scenario]:
		return ""
	case x.Shape != "" && x.Scenario != "bare":
		return "bare"
	}
	return ""
}

func (r *runIndex) writeMatrices(w io.Writer) {
	type line struct{ shape, scenario, base string }
	var lines []line
	for _, x := range r.rows {
		l := line{x.Shape, x.Scenario, r.baseOf(x)}
		if !slices.Contains(lines, l) {
			lines = append(lines, l)
		}
	}
	for _, n := range r.workers {
		fmt.Fprintf(w, "\n**%s, %d workers** (%s; ops/s for the bases; the others ÷ their base of the same repetition, median [min–max]; round trips per operation in brackets where a proxy counted them)\n\n", r.dialect, n, r.file)
		cells := [][]string{append([]string{"shape", "scenario"}, r.rtts...)}
		for _, l := range lines {
			name := l.scenario
			if l.base != "" && l.base != "bare" {
				name += " ÷ " + l.base
			}
			c := []string{l.shape, name}
			seen := false
			for _, rtt := range r.rtts {
				x, ok := r.cell[sampleKey{rtt, l.shape, l.scenario, n}]
				s := ""
				switch {
				case !ok:
				case l.base == "":
					s = fmt.Sprintf("%.0f/s", x.OpsPerSec)
				default:
					s = r.ratio(rtt, l.shape, n, over(l.scenario, l.base)).String()
				}
				if ok && x.RoundTrips != 0 {
					s += fmt.Sprintf(" [%.1f]", x.RoundTrips)
				}
				seen = seen || ok
				c = append(c, s)
			}
			if seen {
				cells = append(cells, c)
			}
		}
		writeCells(w, cells, func(i int) bool { return i <= 1 })
	}
}

// goal is one of issue 17's targets: on dialects, at rtts, for shapes,
// value ≥ least; floor, when set, is the same ratio with the least any
// design must do in place of idem (the floor scenarios), measured in the
// same run: a floor below least shows the target out of reach.
type goal struct {
	name     string
	dialects []string
	rtts     []string
	shapes   []string
	value    []term
	floor    []term
	least    float64
}

var (
	allDialects = []string{"postgres", "mysql", "sqlite"}
	pgMySQL     = []string{"postgres", "mysql"}
	bothShapes  = []string{"small", "order"}
	delayed     = []string{"200µs", "1ms"}
)

var goals = []goal{
	{name: "ClaimTx+CompleteTx ≥ 0.95× Do", dialects: allDialects, rtts: []string{"direct"}, shapes: bothShapes,
		value: over("tx", "do"), floor: over("floortx", "do"), least: 0.95},
	{name: "Do replay ≥ 0.9× PK SELECT", dialects: allDialects, rtts: []string{"direct"}, shapes: []string{""},
		value: over("replay", "pkselect"), least: 0.9},
	{name: "optional: cached replay ≥ 2× PK SELECT (Config.ReplayCache)", dialects: allDialects, rtts: []string{"direct"}, shapes: []string{""},
		value: over("cachedreplay", "pkselect"), least: 2},
	{name: "middleware replay ≥ 0.9× PK SELECT (httpreplay ÷ httppk)", dialects: allDialects, rtts: []string{"direct"}, shapes: bothShapes,
		value: over("httpreplay", "httppk"), least: 0.9},
	{name: "MariaDB Do ≥ 0.55× bare", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"small"},
		value: over("do", "bare"), floor: over("floor", "bare"), least: 0.55},
	{name: "MariaDB Do ≥ 0.80× bare", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"order"},
		value: over("do", "bare"), floor: over("floor", "bare"), least: 0.80},
	// The two MariaDB targets round 10 left unmet (0.55× bare on small,
	// 0.80× Redis on order), beside the floor of a Do that holds the key
	// before its callback runs (floorlock): Do's default claim cannot
	// write less.
	{name: "MariaDB Do ≥ 0.55× bare, beside the floor of a claim that locks (floorlock)", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"small"},
		value: over("do", "bare"), floor: over("floorlock", "bare"), least: 0.55},
	{name: "MariaDB Do ≥ 0.80× Redis on order, RTT 0, beside the floor of a claim that locks (floorlock)", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"order"},
		value: over("do", "redis"), floor: over("floorlock", "redis"), least: 0.80},
	// The same two, beside floorlockbound: the lock, the wait bound and
	// the database clock that Do's claim owes its contract.
	{name: "MariaDB Do ≥ 0.55× bare, beside a locking claim's floor with its wait bound and the database clock (floorlockbound)", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"small"},
		value: over("do", "bare"), floor: over("floorlockbound", "bare"), least: 0.55},
	{name: "MariaDB Do ≥ 0.80× Redis on order, RTT 0, beside a locking claim's floor with its wait bound and the database clock (floorlockbound)", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"order"},
		value: over("do", "redis"), floor: over("floorlockbound", "redis"), least: 0.80},
	// The same two, beside the floor of a schema of two tables that keeps
	// Do's contract (floorresp).
	{name: "MariaDB Do ≥ 0.55× bare, beside a two-table schema's floor (floorresp)", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"small"},
		value: over("do", "bare"), floor: over("floorresp", "bare"), least: 0.55},
	{name: "MariaDB Do ≥ 0.80× Redis on order, RTT 0, beside a two-table schema's floor (floorresp)", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"order"},
		value: over("do", "redis"), floor: over("floorresp", "redis"), least: 0.80},
	// The same two targets met by Do with idemmysql.WithOptimisticDo.
	{name: "MariaDB Do ≥ 0.55× bare, optimistic (doopt)", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"small"},
		value: over("doopt", "bare"), floor: over("floor", "bare"), least: 0.55},
	{name: "MariaDB Do ≥ 0.80× bare, optimistic (doopt)", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"order"},
		value: over("doopt", "bare"), floor: over("floor", "bare"), least: 0.80},
	{name: "MariaDB Do ≥ 0.80× Redis on order, RTT 0, optimistic (doopt)", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"order"},
		value: over("doopt", "redis"), floor: over("floor", "redis"), least: 0.80},
	{name: "MariaDB Do ≥ 1.1× Redis, optimistic (doopt)", dialects: []string{"mysql"}, rtts: delayed, shapes: bothShapes,
		value: over("doopt", "redis"), floor: over("floor", "redis"), least: 1.1},
	// A middleware at the floor is httpplain × floor ÷ bare, beside Do at its floor.
	{name: "MariaDB middleware ≥ 0.9× Do (http ÷ do)", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: bothShapes,
		value: over("http", "do"), floor: over("httpplain", "bare"), least: 0.9},
	{name: "MariaDB middleware ≥ 0.9× Do, HTTP's own cost taken out ((http÷httpplain) ÷ (do÷bare))", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: bothShapes,
		value: []term{{"http", 1}, {"httpplain", -1}, {"do", -1}, {"bare", 1}}, least: 0.9},
	// The same with the optimistic Store under the middleware.
	{name: "MariaDB middleware ≥ 0.9× Do, optimistic (httpopt ÷ doopt)", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: bothShapes,
		value: over("httpopt", "doopt"), floor: over("httpplain", "bare"), least: 0.9},
	{name: "MariaDB middleware ≥ 1.1× Redis, optimistic (httpopt ÷ redis)", dialects: []string{"mysql"}, rtts: delayed, shapes: bothShapes,
		value: over("httpopt", "redis"), floor: []term{{"httpplain", 1}, {"floor", 1}, {"bare", -1}, {"redis", -1}}, least: 1.1},
	{name: "MariaDB middleware ≥ 0.9× Do, optimistic, HTTP's own cost taken out ((httpopt÷httpplain) ÷ (doopt÷bare))", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: bothShapes,
		value: []term{{"httpopt", 1}, {"httpplain", -1}, {"doopt", -1}, {"bare", 1}}, least: 0.9},
	{name: "MariaDB middleware ≥ 1.1× Redis, optimistic, HTTP's own cost taken out ((httpopt÷httpplain) ÷ (redis÷bare))", dialects: []string{"mysql"}, rtts: delayed, shapes: bothShapes,
		value: []term{{"httpopt", 1}, {"httpplain", -1}, {"redis", -1}, {"bare", 1}}, floor: over("floor", "redis"), least: 1.1},
	{name: "Do ≥ 0.95× Redis on order, RTT 0", dialects: []string{"postgres", "sqlite"}, rtts: []string{"direct"}, shapes: []string{"order"},
		value: over("do", "redis"), floor: over("floor", "redis"), least: 0.95},
	{name: "Do ≥ 0.80× Redis on order, RTT 0", dialects: []string{"mysql"}, rtts: []string{"direct"}, shapes: []string{"order"},
		value: over("do", "redis"), floor: over("floor", "redis"), least: 0.80},
	{name: "Do ≥ 1.1× Redis", dialects: pgMySQL, rtts: delayed, shapes: bothShapes,
		value: over("do", "redis"), floor: over("floor", "redis"), least: 1.1},
	// PostgreSQL's Do beside the floor with the key's lock (floorlock):
	// floor takes none, and Do's claim does.
	{name: "Do ≥ 1.1× Redis, beside the floor of a claim that locks (floorlock)", dialects: []string{"postgres"}, rtts: delayed, shapes: bothShapes,
		value: over("do", "redis"), floor: over("floorlock", "redis"), least: 1.1},
	{name: "Do ≥ 0.95× Redis on order, RTT 0, beside the floor of a claim that locks (floorlock)", dialects: []string{"postgres"}, rtts: []string{"direct"}, shapes: []string{"order"},
		value: over("do", "redis"), floor: over("floorlock", "redis"), least: 0.95},
	// The middleware's floor is a handler whose protection costs what
	// floor does: httpplain × floor ÷ bare.
	{name: "middleware ≥ 1.1× Redis (http ÷ redis)", dialects: pgMySQL, rtts: delayed, shapes: bothShapes,
		value: over("http", "redis"), floor: []term{{"httpplain", 1}, {"floor", 1}, {"bare", -1}, {"redis", -1}}, least: 1.1},
	{name: "middleware ≥ 1.1× Redis, HTTP's own cost taken out ((http÷httpplain) ÷ (redis÷bare))", dialects: pgMySQL, rtts: delayed, shapes: bothShapes,
		value: []term{{"http", 1}, {"httpplain", -1}, {"redis", -1}, {"bare", 1}}, floor: over("floor", "redis"), least: 1.1},
}

func writeTargets(w io.Writer, runs []*runIndex) {
	cells := [][]string{{"target", "dialect", "where", "value", "floor", "met"}}
	for _, g := range goals {
		for _, r := range runs {
			if !slices.Contains(g.dialects, r.dialect) {
				continue
			}
			for _, n := range r.workers {
				for _, rtt := range g.rtts {
					if !slices.Contains(r.rtts, rtt) {
						continue
					}
					for _, shape := range g.shapes {
						v := r.ratio(rtt, shape, n, g.value)
						if !v.ok() {
							continue
						}
						var f spread
						if g.floor != nil {
							f = r.ratio(rtt, shape, n, g.floor)
						}
						where := strings.TrimSpace(fmt.Sprintf("%s c=%d %s", shape, n, rtt))
						cells = append(cells, []string{g.name, r.dialect, where, v.String(), f.String(), verdict(v, f, g.least)})
					}
				}
			}
		}
	}
	if len(cells) == 1 {
		return
	}
	fmt.Fprintf(w, "\n**Against the targets of issue 17** (median [min–max] over the repetitions; floor: the same ratio with the floor scenario in idem's place, same run)\n\n")
	writeCells(w, cells, func(i int) bool { return i <= 2 || i == 5 })
}

// verdict reads a target: met on the median; otherwise out of reach when
// even the floor's median falls short, unless idem's median beats every
// repetition of its floor: then that floor is no bound (it does something
// idem avoids) and proves nothing.
func verdict(v, floor spread, least float64) string {
	switch {
	case v.med >= least:
		return "yes"
	case floor.ok() && floor.med < least && v.med > floor.hi:
		return "no (floor not a bound: idem above it)"
	case floor.ok() && floor.med < least:
		return "no: out of reach (floor below)"
	default:
		return "no"
	}
}

func writeReaper(w io.Writer, runs []*runIndex) {
	least := map[string]float64{"postgres": 50000, "mysql": 25000, "sqlite": 25000}
	cells := [][]string{{"dialect", "where", "rows/s (median [min–max])", "claim p99 ÷ without the reaper", "target", "met"}}
	for _, r := range runs {
		for _, x := range r.rows {
			if x.Scenario != "reaper" {
				continue
			}
			rates := perRepExtra(x)
			if len(rates) == 0 {
				continue
			}
			rate := spread{med: median(rates), lo: slices.Min(rates), hi: slices.Max(rates), n: len(rates)}
			met := "no"
			if rate.med >= least[r.dialect] && x.P99VsBase <= 1.3 {
				met = "yes"
			}
			cells = append(cells, []string{r.dialect, strings.TrimSpace(fmt.Sprintf("%s c=%d %s", x.Shape, x.Workers, x.RTT)),
				fmt.Sprintf("%.0f [%.0f–%.0f]", rate.med, rate.lo, rate.hi), fmt.Sprintf("×%.2f", x.P99VsBase),
				fmt.Sprintf("≥ %.0f rows/s, p99 ≤ ×1.3", least[r.dialect]), met})
		}
	}
	if len(cells) == 1 {
		return
	}
	fmt.Fprintf(w, "\n**The reaper** (while tx runs; p99 of a claim ÷ that of tx without the reaper, same repetition)\n\n")
	writeCells(w, cells, func(i int) bool { return i <= 1 || i >= 4 })
}

// perRepExtra is the reaper's rate per repetition; reports written before
// ExtraPerRep existed kept the last repetition's only.
func perRepExtra(x row) []float64 {
	if v := x.ExtraPerRep["reaper_rows_per_s"]; len(v) > 0 {
		return v
	}
	if v, ok := x.Extra["reaper_rows_per_s"]; ok {
		return []float64{v}
	}
	return nil
}
