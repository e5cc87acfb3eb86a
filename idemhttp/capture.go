package idemhttp

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
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
