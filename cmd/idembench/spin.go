package main

import (
	"runtime"
	"time"
)

// spinUntil yields the processor until t: exact, at the cost of CPU.
func spinUntil(t time.Time) {
	for time.Now().Before(t) {
		runtime.Gosched()
	}
}
