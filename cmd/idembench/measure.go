package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemstore/idem/internal/workload"
)

// writeKind says what a scenario writes, for the exactly-once check.
type writeKind int

const (
	writesNothing   writeKind = iota // reads: not checked
	writesPlain                      // an order per operation, no idempotency record
	writesIdem                       // an order and a completed record per operation
	writesRedis                      // an order and a Redis key holding the response per operation
	writesFloor                      // an order and a finished row of floorTable per operation
	writesFloorLock                  // an order, a processing row of floorTable and a row of floorResponsesTable per operation
	writesFloorResp                  // an order, a processing row of floorTable and a row of floorRespTable per operation
)

// scenario is one kind of operation the tool measures.
type scenario struct {
	name string
	// shape is the business shape of a writing scenario ("" for reads).
	shape  workload.Shape
	writes writeKind
	// expect, when set, returns the orders and completed records the
	// measurement should have written, from its successful operations
	// (default: one of each per operation, as writes says).
	expect func(ops int64) (orders, keys int64)
	// redisKeys counts the measurement's Redis keys holding the response
	// and holding anything else (writesRedis).
	redisKeys func(ctx context.Context) (done, pending int64, err error)
	// base names the scenario whose throughput, measured in the same
	// repetition at the same worker count, this one is compared with
	// besides bare ("" for none).
	base string
	// workers, when not zero, replaces the worker count of the run: the
	// scenario then runs once per repetition (hotkeys).
	workers int
	// setup, when set, runs first and opens what the scenario alone needs
	// (its own pools); teardown releases it after the measurement.
	setup func(ctx context.Context) (teardown func(), err error)
	// admin resets the namespace before the measurement (nil: the main one).
	admin func() admin
	// prepare runs before the measurement, after the namespace was reset.
	prepare func(ctx context.Context) error
	// op performs one operation for worker w.
	op func(ctx context.Context, w int) error
	// during, when set, runs next to the workers (the reaper); the
	// measurement ends with the duration or when during returns,
	// whichever comes first. Its note is reported with the result.
	during func(ctx context.Context) (note string, extra map[string]float64, err error)
	// check runs after the measurement, to verify and count what it did.
	check func(ctx context.Context) (note string, extra map[string]float64, err error)
}

// sample is one measurement of one scenario.
type sample struct {
	rep     int
	ops     uint64 // in the recorded window
	total   int64  // successful operations, warm-up and tail included
	elapsed time.Duration
	// roundTrips is the request-response turns per operation on the
	// proxied connections (0: not measured, the servers were direct).
	roundTrips float64
	hist       *histogram
	note       string
	extra      map[string]float64
}

func (s *sample) opsPerSec() float64 { return float64(s.ops) / s.elapsed.Seconds() }

// measure runs sc's op from workers goroutines for warmup, unrecorded
// (connections prepare their statements, caches fill), then for d or until
// sc.during returns, and returns what they did then. The first error of an
// op stops the measurement and is returned. turns, when not nil, counts
// the round trips so far: those made after the warm-up, divided by the
// operations recorded, are the sample's round trips per operation (the
// operations in flight when the warm-up ends make it off by at most one
// operation's round trips per worker, over the whole window).
func measure(ctx context.Context, sc *scenario, workers int, warmup, d time.Duration, turns func() int64) (*sample, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg       sync.WaitGroup
		stop     = make(chan struct{})
		errOnce  sync.Once
		firstErr error
		hists    = make([]*histogram, workers)
		counts   = make([]uint64, workers)
		totals   = make([]int64, workers)
	)
	fail := func(err error) {
		errOnce.Do(func() { firstErr = err })
		cancel()
	}
	start := make(chan struct{})
	var from time.Time // when recording starts; set before start is closed
	for w := range workers {
		hists[w] = new(histogram)
		wg.Go(func() {
			h := hists[w]
			<-start
			for {
				select {
				case <-stop:
					return
				case <-ctx.Done():
					return
				default:
				}
				t0 := time.Now()
				err := sc.op(ctx, w)
				if err != nil {
					if ctx.Err() != nil && errors.Is(err, context.Canceled) {
						return // stopped by another worker's failure
					}
					fail(fmt.Errorf("%s: %w", sc.name, err))
					return
				}
				totals[w]++
				if t0.After(from) {
					h.record(time.Since(t0))
					counts[w]++
				}
			}
		})
	}
	var (
		bgDone          = make(chan struct{})
		bgNote          string
		bgExtra         map[string]float64
		bgErr           error
		timer           = time.NewTimer(warmup + d)
		elapsed         time.Duration
		stoppedByDuring bool
	)
	from = time.Now().Add(warmup)
	close(start)
	if sc.during != nil {
		go func() {
			defer close(bgDone)
			select {
			case <-time.After(warmup):
			case <-ctx.Done():
				return
			}
			bgNote, bgExtra, bgErr = sc.during(ctx)
		}()
	}
	var turnsFrom int64
	if turns != nil {
		select {
		case <-time.After(time.Until(from)):
		case <-ctx.Done():
		}
		turnsFrom = turns()
	}
	select {
	case <-timer.C:
	case <-bgDone:
		stoppedByDuring = true
	case <-ctx.Done():
	}
	close(stop)
	wg.Wait() // operations in flight finish and count, so their time counts too
	elapsed = time.Since(from)
	timer.Stop()
	if sc.during != nil {
		if !stoppedByDuring {
			cancel()
			<-bgDone
		}
		if bgErr != nil && !errors.Is(bgErr, context.Canceled) {
			return nil, fmt.Errorf("%s: %w", sc.name, bgErr)
		}
	}
	if firstErr != nil {
		return nil, firstErr
	}
	s := &sample{elapsed: elapsed, hist: new(histogram), note: bgNote, extra: bgExtra}
	for w := range workers {
		s.hist.merge(hists[w])
		s.ops += counts[w]
		s.total += totals[w]
	}
	if s.ops == 0 {
		return nil, fmt.Errorf("%s: no operation completed in %v", sc.name, elapsed)
	}
	if turns != nil {
		s.roundTrips = float64(turns()-turnsFrom) / float64(s.ops)
	}
	return s, nil
}
