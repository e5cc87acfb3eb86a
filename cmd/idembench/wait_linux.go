package main

import (
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// waiter waits until a time with a timerfd read through the runtime's
// network poller: it wakes within microseconds of the deadline, where Go's
// timers, when the process is otherwise idle, sleep in epoll_wait with a
// millisecond timeout and so round a 100 µs wait up to 1 ms.
type waiter struct {
	f  *os.File // nil: the timerfd could not be made; fall back to spinning
	fd int
}

func newWaiter() *waiter {
	fd, err := unix.TimerfdCreate(unix.CLOCK_MONOTONIC, unix.TFD_NONBLOCK|unix.TFD_CLOEXEC)
	if err != nil {
		return &waiter{}
	}
	return &waiter{f: os.NewFile(uintptr(fd), "timerfd"), fd: fd}
}

// until returns at t or soon after.
func (w *waiter) until(t time.Time) {
	d := time.Until(t)
	if d <= 0 {
		return
	}
	if w.f == nil {
		spinUntil(t)
		return
	}
	spec := unix.ItimerSpec{Value: unix.NsecToTimespec(d.Nanoseconds())}
	if err := unix.TimerfdSettime(w.fd, 0, &spec, nil); err != nil {
		spinUntil(t)
		return
	}
	var buf [8]byte
	if _, err := w.f.Read(buf[:]); err != nil {
		spinUntil(t)
	}
}

func (w *waiter) close() {
	if w.f != nil {
		_ = w.f.Close()
	}
}
