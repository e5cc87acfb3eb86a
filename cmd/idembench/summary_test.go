package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// writeReport writes a report of one dialect holding rows to a file of
// dir and returns its path.
func writeReport(t *testing.T, dir, dialect string, rows []row) string {
	t.Helper()
	b, err := json.Marshal(&report{Command: "idembench test", Dialects: []*dialectResult{{Dialect: dialect, Rows: rows}}})
	require.NoError(t, err)
	p := filepath.Join(dir, dialect+".json")
	require.NoError(t, os.WriteFile(p, b, 0o600))
	return p
}

func shaped(rtt, shape, scenario string, perRep ...float64) row {
	return row{RTT: rtt, Shape: shape, Scenario: scenario, Workers: 8, PerRep: perRep, OpsPerSec: median(perRep)}
}

// lineOf returns the line of out that contains every one of parts.
func lineOf(t *testing.T, out string, parts ...string) string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		ok := true
		for _, p := range parts {
			ok = ok && strings.Contains(l, p)
		}
		if ok {
			return l
		}
	}
	t.Fatalf("no line holds %q in:\n%s", parts, out)
	return ""
}

func TestSummarizeRatiosPerRepetition(t *testing.T) {
	dir := t.TempDir()
	// Per repetition do ÷ bare is 0.5, 0.25, 1: the median of the ratios
	// (0.5) is not the ratio of the medians (400/1000 = 0.4).
	mysql := writeReport(t, dir, "mysql", []row{
		shaped("direct", "small", "bare", 1000, 1600, 400),
		shaped("direct", "small", "do", 500, 400, 400),
		shaped("direct", "small", "floor", 400, 800, 200), // floor ÷ bare 0.4, 0.5, 0.5
		shaped("direct", "small", "tx", 500, 400, 400),
		shaped("direct", "small", "floortx", 600, 400, 400),
		{RTT: "direct", Scenario: "pkselect", Workers: 8, PerRep: []float64{100, 100, 100}, OpsPerSec: 100},
		shaped("direct", "small", "httppk", 300, 300, 300),
		{RTT: "direct", Shape: "small", Scenario: "httpreplay", Base: "httppk", Workers: 8, PerRep: []float64{270, 300, 330}, OpsPerSec: 300},
		{RTT: "direct", Scenario: "replay", Base: "pkselect", Workers: 8, PerRep: []float64{95, 91, 99}, OpsPerSec: 95},
		{RTT: "direct", Shape: "small", Scenario: "reaper", Base: "tx", Workers: 8, PerRep: []float64{1, 1}, OpsPerSec: 1,
			P99VsBase: 1.2, ExtraPerRep: map[string][]float64{"reaper_rows_per_s": {30000, 20000, 26000}}},
	})
	var out bytes.Buffer
	require.NoError(t, summarize([]string{mysql}, &out))
	s := out.String()

	require.Contains(t, lineOf(t, s, "| small", "| do "), "**0.50** [0.25–1.00]")
	require.Contains(t, lineOf(t, s, "| small", "| bare "), "1000/s")
	require.Contains(t, lineOf(t, s, "replay ÷ pkselect"), "**0.95** [0.91–0.99]")
	// A scenario another names as its base is a base: ops/s, not ÷ bare.
	require.Contains(t, lineOf(t, s, "| small", "| httppk "), "300/s")
	require.Contains(t, lineOf(t, s, "| small", "httpreplay ÷ httppk"), "**1.00** [0.90–1.10]")

	// Do ÷ bare 0.50 < 0.55 and floor ÷ bare 0.50 < 0.55: out of reach.
	require.Contains(t, lineOf(t, s, "MariaDB Do ≥ 0.55× bare"), "no: out of reach")
	// A floor idem beats in every repetition bounds nothing.
	require.Contains(t, verdict(spread{med: 0.8, n: 1}, spread{med: 0.6, lo: 0.5, hi: 0.7, n: 3}, 0.95), "not a bound")
	require.Contains(t, verdict(spread{med: 0.65, n: 1}, spread{med: 0.6, lo: 0.5, hi: 0.7, n: 3}, 0.95), "out of reach")
	// tx ÷ do is 1 in every repetition: met, whatever the floor says.
	require.Contains(t, lineOf(t, s, "ClaimTx+CompleteTx", "| mysql"), "yes")
	require.Contains(t, lineOf(t, s, "Do replay ≥ 0.9×", "| mysql"), "yes")
	// 26 000 rows/s (median) and p99 ×1.2: met.
	reaper := lineOf(t, s, "| mysql", "rows/s, p99")
	require.Contains(t, reaper, "26000 [20000–30000]")
	require.True(t, strings.HasSuffix(strings.TrimSpace(reaper), "| yes |"), reaper)
}

func TestSummarizeShortOfTheTargetWithAFloorAbove(t *testing.T) {
	dir := t.TempDir()
	pg := writeReport(t, dir, "postgres", []row{
		shaped("direct", "order", "do", 90, 90),
		shaped("direct", "order", "floor", 200, 200),
		shaped("direct", "order", "redis", 100, 100),
		shaped("1ms", "order", "do", 100, 100),
		shaped("1ms", "order", "redis", 100, 100),
	})
	var out bytes.Buffer
	require.NoError(t, summarize([]string{pg}, &out))
	s := out.String()
	// 0.90 < 0.95 but the floor (2.00) is above: reachable, so only "no".
	l := lineOf(t, s, "Do ≥ 0.95× Redis on order", "| postgres")
	require.Contains(t, l, "**0.90** [0.90–0.90]")
	require.True(t, strings.HasSuffix(strings.TrimSpace(l), "| no |"), l)
	// At 1 ms there is no floor cell: "–", and 1.00 < 1.1 is not met.
	l = lineOf(t, s, "Do ≥ 1.1× Redis", "1ms")
	require.Contains(t, l, " – |")
	require.True(t, strings.HasSuffix(strings.TrimSpace(l), "| no |"), l)
}

func TestSummarizeRefusesNoFilesAndBadJSON(t *testing.T) {
	var out bytes.Buffer
	require.Error(t, summarize(nil, &out))
	p := filepath.Join(t.TempDir(), "bad.json")
	require.NoError(t, os.WriteFile(p, []byte("{"), 0o600))
	require.ErrorContains(t, summarize([]string{p}, &out), "bad.json")
}

func TestSummarizeOptimisticMiddlewareWithHTTPTakenOut(t *testing.T) {
	dir := t.TempDir()
	// Per repetition (httpopt ÷ httpplain) ÷ (doopt ÷ bare) is
	// (180/400) ÷ (500/1000) = 0.90 and (150/400) ÷ (500/1000) = 0.75.
	mysql := writeReport(t, dir, "mysql", []row{
		shaped("direct", "small", "bare", 1000, 1000, 1000),
		shaped("direct", "small", "doopt", 500, 500, 500),
		shaped("direct", "small", "httpplain", 400, 400, 400),
		shaped("direct", "small", "httpopt", 180, 150, 180),
	})
	var out bytes.Buffer
	require.NoError(t, summarize([]string{mysql}, &out))
	s := out.String()
	l := lineOf(t, s, "optimistic, HTTP's own cost taken out ((httpopt÷httpplain) ÷ (doopt÷bare))", "small c=8")
	require.Contains(t, l, "**0.90** [0.75–0.90]")
	require.True(t, strings.HasSuffix(strings.TrimSpace(l), "| yes |"), l)
	// httpopt ÷ doopt itself: 0.36 [0.30–0.36], with httpplain ÷ bare (0.40) as its floor.
	l = lineOf(t, s, "optimistic (httpopt ÷ doopt)", "small c=8")
	require.Contains(t, l, "**0.36** [0.30–0.36]")
	require.Contains(t, l, "out of reach")
}
