//go:build !linux

package main

import "time"

// waiter waits until a time: a timer for all but the last millisecond,
// which Go's timers may round up, then spinning.
type waiter struct{}

func newWaiter() *waiter { return &waiter{} }

func (*waiter) until(t time.Time) {
	if d := time.Until(t) - time.Millisecond; d > 0 {
		time.Sleep(d)
	}
	spinUntil(t)
}

func (*waiter) close() {}
