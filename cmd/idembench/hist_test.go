package main

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestBucketsCoverValuesWithoutGaps(t *testing.T) {
	t.Parallel()
	// Every value falls in the bucket whose range holds it, and the
	// buckets follow each other with no gap or overlap.
	next := int64(0)
	for i := range histBuckets - 1 {
		lo, w := bucketRange(i)
		require.Equal(t, next, lo, "bucket %d", i)
		require.Equal(t, i, bucketOf(lo))
		require.Equal(t, i, bucketOf(lo+w-1))
		next = lo + w
	}
	require.Equal(t, histBuckets-1, bucketOf(1<<62), "values past the range go to the last bucket")
	require.Equal(t, 0, bucketOf(-5))
}

func TestQuantileAgainstSortedValues(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		gen  func(r *rand.Rand) time.Duration
	}{
		{"uniform 0-2ms", func(r *rand.Rand) time.Duration { return time.Duration(r.Int64N(int64(2 * time.Millisecond))) }},
		{"exponential around 300µs", func(r *rand.Rand) time.Duration {
			return time.Duration(r.ExpFloat64() * float64(300*time.Microsecond))
		}},
		{"bimodal 50µs and 40ms", func(r *rand.Rand) time.Duration {
			if r.IntN(100) == 0 {
				return 40*time.Millisecond + time.Duration(r.Int64N(int64(time.Millisecond)))
			}
			return 50*time.Microsecond + time.Duration(r.Int64N(int64(5*time.Microsecond)))
		}},
		{"tiny values", func(r *rand.Rand) time.Duration { return time.Duration(r.IntN(40)) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := rand.New(rand.NewPCG(1, 2)) //nolint:gosec // G404: deterministic test data, not a secret
			var h histogram
			vals := make([]time.Duration, 100_000)
			for i := range vals {
				vals[i] = tc.gen(r)
				h.record(vals[i])
			}
			slices.Sort(vals)
			for _, q := range []float64{0.5, 0.9, 0.99, 0.999, 1} {
				want := vals[int(q*float64(len(vals)))-1] // the value of rank ceil(q×n)
				got := h.quantile(q)
				// One bucket is 1/64 of its power of two wide: the answer
				// is within 1/64 of the exact value (or 1 ns below 64 ns).
				require.InDelta(t, float64(want), float64(got), max(float64(want)/64, 1), "q=%v", q)
			}
			require.Equal(t, vals[len(vals)-1], h.quantile(1), "the maximum is exact")
		})
	}
}

func TestMergeAndEmpty(t *testing.T) {
	t.Parallel()
	var a, b, all histogram
	require.Zero(t, a.quantile(0.99))
	for i := range 1000 {
		d := time.Duration(i) * time.Microsecond
		all.record(d)
		if i%2 == 0 {
			a.record(d)
		} else {
			b.record(d)
		}
	}
	a.merge(&b)
	require.Equal(t, all, a)
	require.InDelta(t, float64(500*time.Microsecond), float64(a.quantile(0.5)), float64(500*time.Microsecond)/64)
}

func TestRecordDoesNotAllocate(t *testing.T) {
	// Not parallel: AllocsPerRun counts the whole process's allocations.
	var h histogram
	allocs := testing.AllocsPerRun(1000, func() { h.record(123 * time.Microsecond) })
	require.Zero(t, allocs)
}
