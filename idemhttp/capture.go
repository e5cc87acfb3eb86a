package idemhttp

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/idemstore/idem"
)

// ErrResponseTooLarge is returned by the handler's ResponseWriter.Write once
// a response that would be stored (a 2xx or 3xx, or a failure marked final)
// grows past Config.MaxResponseBytes: it cannot be stored, so the middleware
// will roll the transaction back and answer 500 with CodeResponseTooLarge.
// The handler may stop writing.
var ErrResponseTooLarge = errors.New("idemhttp: response larger than Config.MaxResponseBytes")

// capture is the ResponseWriter the handler writes to: it keeps the response
// in memory until the transaction's outcome decides what the client gets.
// It supports neither Flush nor Hijack: nothing reaches the client before
// the commit, except the tail of a failure response that will not be stored
// (see Write).
type capture struct {
	header http.Header
	// sent is the header as it was when the status was written, as a
	// server would have sent it.
	sent   http.Header
	status int
	body   bytes.Buffer
	// limit bounds the buffered body of every response; beyond it a
	// response that would be stored is dropped and overflow set, and a
	// failure that will not be stored is streamed.
	limit    int
	overflow bool
	// spill, when set, is asked to start streaming a failure response that
	// outgrew limit: it reports false if the response may still be stored
	// (marked final, or its attempt is to be retried), and otherwise sends
	// the status and headers to the client and reports true.
	spill func(c *capture) bool
	// out receives the rest of the body once streamed is set.
	out      http.ResponseWriter
	streamed bool
	// put, when set, streams a response that may be stored and outgrows
	// inline bytes to the store's BodyStore (see bodyspill.go); spilled is
	// that put while it runs, ref its result.
	put    func(io.Reader) (*idem.BodyRef, error)
	inline int
	// spool is set when put must run after the handler (bodyspill.go).
	spool   bool
	spilled *spill
	ref     *idem.BodyRef
	putErr  error
	// unwritten is set by finish when the handler wrote neither a status
	// nor a body.
	unwritten bool
}

func newCapture(limit int) *capture {
	return &capture{header: http.Header{}, limit: limit}
}

func (c *capture) Header() http.Header { return c.header }

// WriteHeader records the status; informational (1xx) statuses are ignored,
// as nothing can be sent before the commit. Like net/http, it panics on a
// code that is not a 3-digit status, here while the transaction can still
// roll back.
func (c *capture) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("idemhttp: invalid WriteHeader code %v", code))
	}
	if c.status != 0 || code < 200 {
		return
	}
	c.status = code
	c.sent = c.header.Clone()
}

// Write buffers p. The buffer never holds more than limit bytes: a response
// that would be stored fails with ErrResponseTooLarge beyond it, and a 4xx
// or 5xx that is not final switches to streaming, so that a large error
// page costs no more memory than the limit. A failure that is not stored
// gives the client nothing to replay and leaves nothing committed, so
// sending it before the rollback ends is harmless: a retry waits for the
// rollback like any duplicate in flight.
func (c *capture) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	switch {
	case c.streamed:
		return c.out.Write(p)
	case c.overflow:
		return 0, ErrResponseTooLarge
	case c.spilled != nil || (c.put != nil && c.status < 400 && c.body.Len()+len(p) > c.inline):
		return c.writeSpill(p)
	case c.body.Len()+len(p) <= c.limit:
		return c.body.Write(p)
	case c.status >= 400 && c.spill != nil && c.spill(c):
		c.streamed = true
		if _, err := c.out.Write(c.body.Bytes()); err != nil {
			return 0, err
		}
		c.body = bytes.Buffer{}
		return c.out.Write(p)
	default:
		c.overflow = true
		c.body = bytes.Buffer{}
		return 0, ErrResponseTooLarge
	}
}

// finish completes the response after the handler returned: status 200 if
// none was written, and a sniffed Content-Type if the handler set none (as
// the server would have, so that the original and its replays agree).
func (c *capture) finish() {
	if c.status == 0 {
		c.unwritten = true
		c.WriteHeader(http.StatusOK)
	}
	c.sniff()
}

// sniff sets the Content-Type the server would have sniffed from the
// buffered body, if the handler set none.
func (c *capture) sniff() {
	if _, ok := c.sent["Content-Type"]; !ok && c.body.Len() > 0 && !c.streamed {
		c.sent.Set("Content-Type", http.DetectContentType(c.body.Bytes()))
	}
}

// tooLarge reports whether the response cannot be stored.
func (c *capture) tooLarge() bool { return c.overflow || c.body.Len() > c.limit }

// writeSpill writes p to the body store's put, starting it with what was
// buffered so far. Past limit, or when the put fails, the response cannot
// be stored: overflow, as for a buffered response (endSpill then reports
// a failed put as such).
func (c *capture) writeSpill(p []byte) (int, error) {
	if c.spilled == nil {
		c.sniff() // from the head of the body, as the server would
		c.spilled = startSpill(c.put, c.spool)
		err := c.spilled.write(c.body.Bytes())
		c.body = bytes.Buffer{}
		if err != nil {
			return 0, c.spillFailed()
		}
	}
	if c.spilled.n+int64(len(p)) > int64(c.limit) {
		c.overflow = true
		c.spilled.abort()
		c.spilled.aborted = true
		return 0, ErrResponseTooLarge
	}
	if err := c.spilled.write(p); err != nil {
		return 0, c.spillFailed()
	}
	return len(p), nil
}

// spillFailed records the error of a put that ended while the handler
// wrote (the pipe's reader is closed once the put returns).
func (c *capture) spillFailed() error {
	<-c.spilled.done
	c.overflow = true
	if !errors.Is(c.spilled.err, idem.ErrInvalidResponse) {
		c.putErr = c.spilled.err
		if c.putErr == nil {
			c.putErr = errors.New("idemhttp: the body store's put ended before the body")
		}
	}
	return ErrResponseTooLarge
}

// endSpill ends a spilled body once the handler returned. With keep it
// waits for the put and sets ref; otherwise (a response that will not be
// stored) it aborts the put, whose object, if any, is an orphan for the
// sweep. It returns the error of a put that failed (idem.ErrBodyUnavailable),
// which is not a response too large: the caller must refuse with it.
func (c *capture) endSpill(keep bool) error {
	s := c.spilled
	if s == nil {
		return nil
	}
	c.spilled = nil
	switch {
	case c.putErr != nil:
		c.overflow = false
		return c.putErr
	case s.aborted || !keep:
		s.abort()
		return nil
	}
	ref, err := s.finish()
	switch {
	case errors.Is(err, idem.ErrInvalidResponse):
		c.overflow = true
		return nil
	case err != nil:
		return err
	}
	c.ref = ref
	return nil
}
