package main

import (
	"math"
	"math/bits"
	"time"
)

// histogram counts durations in log-linear buckets, as HDR histograms do:
// every power of two is split into subBuckets equal buckets, so a recorded
// value is known to within 1/subBuckets (1.6%) of itself, whatever its
// magnitude. Recording is an index computation and an increment, with no
// allocation, which keeps the measuring cost out of the measured latencies.
// A histogram is not safe for concurrent use: each worker has its own, and
// they are merged at the end.
type histogram struct {
	counts [histBuckets]uint64
	total  uint64
	max    int64
}

const (
	subBits    = 6
	subBuckets = 1 << subBits // buckets per power of two
	// Values up to 2^maxBits ns (about 18 minutes) have a bucket; larger
	// ones are counted in the last.
	maxBits     = 40
	histBuckets = (maxBits - subBits + 1) * subBuckets
)

// bucketOf returns the index of the bucket holding v nanoseconds. Values
// below subBuckets have a bucket each; above, the bucket of v is set by its
// highest subBits+1 bits.
func bucketOf(v int64) int {
	if v < subBuckets {
		if v < 0 {
			return 0
		}
		return int(v)
	}
	shift := bits.Len64(uint64(v)) - subBits - 1
	i := (shift+1)*subBuckets + int(v>>shift) - subBuckets
	if i >= histBuckets {
		return histBuckets - 1
	}
	return i
}

// bucketRange returns the smallest value of bucket i and its width.
func bucketRange(i int) (lo, width int64) {
	if i < subBuckets {
		return int64(i), 1
	}
	shift := i/subBuckets - 1
	return int64(i%subBuckets+subBuckets) << shift, 1 << shift
}

// record counts one duration.
func (h *histogram) record(d time.Duration) {
	v := int64(d)
	h.counts[bucketOf(v)]++
	h.total++
	if v > h.max {
		h.max = v
	}
}

// merge adds o's counts to h.
func (h *histogram) merge(o *histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.total += o.total
	h.max = max(h.max, o.max)
}

// quantile returns the duration below which a fraction q (0 < q <= 1) of
// the recorded values lie: the middle of the bucket holding the value of
// rank ceil(q × total), never more than the largest value recorded. It
// returns 0 for an empty histogram.
func (h *histogram) quantile(q float64) time.Duration {
	if h.total == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(h.total)))
	rank = min(max(rank, 1), h.total)
	if rank == h.total {
		return time.Duration(h.max) // the maximum is known exactly
	}
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			lo, w := bucketRange(i)
			return time.Duration(min(lo+w/2, h.max))
		}
	}
	return time.Duration(h.max)
}
