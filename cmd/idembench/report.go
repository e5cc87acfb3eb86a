package main

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

type sampleKey struct {
	rtt      string // rttSetting.String()
	shape    string // "" for the reads
	scenario string
	workers  int
}

// dialectResult holds the measurements of one dialect.
type dialectResult struct {
	Dialect    string   `json:"dialect"`
	Server     string   `json:"server"`
	Namespaces []string `json:"namespaces"`
	Rows       []row    `json:"rows"`

	samples map[sampleKey][]*sample
	order   []sampleKey       // first measurement order
	base    map[string]string // scenario → its baseline besides bare
}

// row is one line of the table: the medians over the repetitions.
type row struct {
	RTT       string        `json:"rtt"` // direct, proxy0 (the proxy without delay) or the added RTT
	Shape     string        `json:"shape,omitempty"`
	Scenario  string        `json:"scenario"`
	Workers   int           `json:"workers"`
	Reps      int           `json:"reps"`
	OpsPerSec float64       `json:"ops_per_s"`
	P50       time.Duration `json:"p50_ns"`
	P99       time.Duration `json:"p99_ns"`
	P999      time.Duration `json:"p999_ns"`
	Spread    float64       `json:"spread"` // (max − min) ÷ median of ops/s
	VsBare    float64       `json:"vs_bare,omitempty"`
	Base      string        `json:"base,omitempty"`
	VsBase    float64       `json:"vs_base,omitempty"`
	// P99VsBase is the p99 latency ÷ that of Base in the same repetition
	// (median): for the reaper, how much a claim's tail grows while it runs.
	P99VsBase float64 `json:"p99_vs_base,omitempty"`
	// VsProxy0 is the throughput ÷ that of the same scenario through the
	// proxy without delay, same repetition (delayed RTTs only).
	VsProxy0 float64 `json:"vs_proxy0,omitempty"`
	// RoundTrips is request-response turns per operation through the
	// proxy (median; 0 when direct).
	RoundTrips float64            `json:"round_trips_per_op,omitempty"`
	Note       string             `json:"note,omitempty"`
	Extra      map[string]float64 `json:"extra,omitempty"`
	PerRep     []float64          `json:"ops_per_s_per_rep"`
	// ExtraPerRep is Extra for every repetition, in the order of PerRep
	// (Extra itself is the last repetition's).
	ExtraPerRep map[string][]float64 `json:"extra_per_rep,omitempty"`
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// ratio is the median over repetitions of the throughput of samples
// divided by that of base in the same repetition; 0 when never paired.
func ratio(samples, base []*sample) float64 {
	var r []float64
	for _, s := range samples {
		for _, b := range base {
			if b.rep == s.rep {
				r = append(r, s.opsPerSec()/b.opsPerSec())
			}
		}
	}
	return median(r)
}

// p99Ratio is the median over repetitions of the p99 latency of samples
// divided by that of base in the same repetition; 0 when never paired.
func p99Ratio(samples, base []*sample) float64 {
	var r []float64
	for _, s := range samples {
		for _, b := range base {
			if b.rep == s.rep && b.hist.quantile(0.99) > 0 {
				r = append(r, float64(s.hist.quantile(0.99))/float64(b.hist.quantile(0.99)))
			}
		}
	}
	return median(r)
}

// summarise fills d.Rows from the samples.
func (d *dialectResult) summarise() {
	d.Rows = nil
	for _, k := range d.order {
		ss := d.samples[k]
		var ops, p50, p99, p999, rts []float64
		for _, s := range ss {
			ops = append(ops, s.opsPerSec())
			rts = append(rts, s.roundTrips)
			p50 = append(p50, float64(s.hist.quantile(0.5)))
			p99 = append(p99, float64(s.hist.quantile(0.99)))
			p999 = append(p999, float64(s.hist.quantile(0.999)))
		}
		r := row{
			RTT: k.rtt, Shape: k.shape, RoundTrips: median(rts),
			Scenario: k.scenario, Workers: k.workers, Reps: len(ss), OpsPerSec: median(ops),
			P50: time.Duration(median(p50)), P99: time.Duration(median(p99)), P999: time.Duration(median(p999)),
			PerRep: ops, Note: ss[len(ss)-1].note, Extra: ss[len(ss)-1].extra,
		}
		r.Spread = (slices.Max(ops) - slices.Min(ops)) / r.OpsPerSec
		for _, s := range ss {
			for name, v := range s.extra {
				if r.ExtraPerRep == nil {
					r.ExtraPerRep = make(map[string][]float64)
				}
				r.ExtraPerRep[name] = append(r.ExtraPerRep[name], v)
			}
		}
		if k.scenario != "bare" && k.shape != "" {
			r.VsBare = ratio(ss, d.samples[sampleKey{k.rtt, k.shape, "bare", k.workers}])
		}
		if b := d.base[k.scenario]; b != "" {
			r.Base = b
			r.VsBase = ratio(ss, d.samples[sampleKey{k.rtt, k.shape, b, k.workers}])
			r.P99VsBase = p99Ratio(ss, d.samples[sampleKey{k.rtt, k.shape, b, k.workers}])
		}
		if k.rtt != "direct" && k.rtt != "proxy0" {
			r.VsProxy0 = ratio(ss, d.samples[sampleKey{"proxy0", k.shape, k.scenario, k.workers}])
		}
		d.Rows = append(d.Rows, r)
	}
}

// writeTable prints d as a Markdown table, padded so that it reads as
// well in a terminal as in docs/performance.md.
func (d *dialectResult) writeTable(w io.Writer) {
	fmt.Fprintf(w, "\n### %s (%s)\n\n", d.Dialect, d.Server)
	cells := [][]string{{"rtt", "shape", "scenario", "workers", "ops/s", "spread", "p50", "p99", "p999", "rt/op", "÷ bare", "÷ base", "÷ proxy0", "note"}}
	for _, r := range d.Rows {
		vsBare, vsBase, vsProxy0, rt := "", "", "", ""
		if r.VsBare != 0 {
			vsBare = fmt.Sprintf("%.2f", r.VsBare)
		}
		if r.VsBase != 0 {
			vsBase = fmt.Sprintf("%.2f ÷ %s", r.VsBase, r.Base)
			if r.P99VsBase != 0 {
				vsBase += fmt.Sprintf(", p99 ×%.2f", r.P99VsBase)
			}
		}
		if r.VsProxy0 != 0 {
			vsProxy0 = fmt.Sprintf("%.2f", r.VsProxy0)
		}
		if r.RoundTrips != 0 {
			rt = fmt.Sprintf("%.2f", r.RoundTrips)
		}
		cells = append(cells, []string{r.RTT, r.Shape, r.Scenario, strconv.Itoa(r.Workers), fmt.Sprintf("%.0f", r.OpsPerSec),
			fmt.Sprintf("%.0f%%", 100*r.Spread), fmtDur(r.P50), fmtDur(r.P99), fmtDur(r.P999), rt, vsBare, vsBase, vsProxy0, r.Note})
	}
	writeCells(w, cells, func(i int) bool { return i <= 2 || i == len(cells[0])-1 })
	d.writeMatrix(w)
}

// writeMatrix prints, per worker count, one line per shape and scenario
// and one column per RTT setting: the baselines' ops/s, every other
// scenario's throughput ÷ its base (÷ bare when it has none), and the
// round trips per operation in brackets. It is the layout of
// docs/performance.md's tables, read along a line: how a scenario fares
// as the network gets slower, each RTT against proxy0.
func (d *dialectResult) writeMatrix(w io.Writer) {
	var rtts []string
	var workers []int
	type line struct{ shape, scenario string }
	var lines []line
	cell := make(map[sampleKey]row)
	for _, r := range d.Rows {
		if !slices.Contains(rtts, r.RTT) {
			rtts = append(rtts, r.RTT)
		}
		if !slices.Contains(workers, r.Workers) {
			workers = append(workers, r.Workers)
		}
		if l := (line{r.Shape, r.Scenario}); !slices.Contains(lines, l) {
			lines = append(lines, l)
		}
		cell[sampleKey{r.RTT, r.Shape, r.Scenario, r.Workers}] = r
	}
	for _, n := range workers {
		fmt.Fprintf(w, "\n%s, %d workers: ops/s of the baselines, ÷ base (or ÷ bare) of the others, [round trips per operation]\n\n", d.Dialect, n)
		cells := [][]string{append([]string{"shape", "scenario"}, rtts...)}
		for _, l := range lines {
			c := []string{l.shape, l.scenario}
			seen := false
			for _, rtt := range rtts {
				r, ok := cell[sampleKey{rtt, l.shape, l.scenario, n}]
				s := ""
				switch {
				case !ok:
				case r.VsBase != 0:
					s = fmt.Sprintf("%.2f ÷ %s", r.VsBase, r.Base)
				case r.VsBare != 0:
					s = fmt.Sprintf("%.2f", r.VsBare)
				default:
					s = fmt.Sprintf("%.0f/s", r.OpsPerSec)
				}
				if ok && r.RoundTrips != 0 {
					s += fmt.Sprintf(" [%.1f]", r.RoundTrips)
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

// writeCells prints a Markdown table padded so that it reads as well in a
// terminal as in docs/performance.md; left says which columns are text
// (left-aligned), the others numbers (right-aligned).
func writeCells(w io.Writer, cells [][]string, left func(i int) bool) {
	width := make([]int, len(cells[0]))
	for _, c := range cells {
		for i, s := range c {
			width[i] = max(width[i], utf8.RuneCountInString(s))
		}
	}
	line := func(c []string) {
		var b strings.Builder
		for i, s := range c {
			pad := strings.Repeat(" ", width[i]-utf8.RuneCountInString(s))
			if left(i) {
				fmt.Fprintf(&b, "| %s%s ", s, pad)
			} else {
				fmt.Fprintf(&b, "| %s%s ", pad, s)
			}
		}
		fmt.Fprintln(w, strings.TrimRight(b.String(), " ")+" |")
	}
	line(cells[0])
	sep := make([]string, len(width))
	for i := range sep {
		if left(i) {
			sep[i] = strings.Repeat("-", width[i])
		} else {
			sep[i] = strings.Repeat("-", width[i]-1) + ":"
		}
	}
	line(sep)
	for _, c := range cells[1:] {
		line(c)
	}
}

// fmtDur prints d with three significant digits in µs or ms.
func fmtDur(d time.Duration) string {
	switch {
	case d < time.Millisecond:
		return fmt.Sprintf("%.0fµs", float64(d)/1e3)
	case d < 10*time.Millisecond:
		return fmt.Sprintf("%.2fms", float64(d)/1e6)
	case d < 100*time.Millisecond:
		return fmt.Sprintf("%.1fms", float64(d)/1e6)
	default:
		return fmt.Sprintf("%.0fms", float64(d)/1e6)
	}
}

// report is what -json writes.
type report struct {
	Command  string    `json:"command"`
	Machine  machine   `json:"machine"`
	Started  time.Time `json:"started"`
	Duration string    `json:"duration_per_measurement"`
	Warmup   string    `json:"warmup_per_measurement"`
	// Order is -order: alternate (every even repetition reversed) or fixed.
	Order    string           `json:"order"`
	Dialects []*dialectResult `json:"dialects"`
}

type machine struct {
	NumCPU     int    `json:"num_cpu"`
	GOMAXPROCS int    `json:"gomaxprocs"`
	Go         string `json:"go"`
	OS         string `json:"os"`
	Redis      string `json:"redis,omitempty"`
}

func (m machine) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "machine: %d CPUs, GOMAXPROCS %d, %s %s", m.NumCPU, m.GOMAXPROCS, m.Go, m.OS)
	if m.Redis != "" {
		fmt.Fprintf(&b, ", Redis %s", m.Redis)
	}
	return b.String()
}

func writeJSON(w io.Writer, r *report) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}
