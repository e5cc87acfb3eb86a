package idemhttp

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
)

// ErrResponseTooLarge is returned by the handler's ResponseWriter.Write once
// a 2xx or 3xx response grows past Config.MaxResponseBytes: it cannot be
// stored, so the middleware will roll the transaction back and answer 500
// with CodeResponseTooLarge. The handler may stop writing.
var ErrResponseTooLarge = errors.New("idemhttp: response larger than Config.MaxResponseBytes")

// capture is the ResponseWriter the handler writes to: it keeps the response
// in memory until the transaction's outcome decides what the client gets.
// It supports neither Flush nor Hijack: nothing reaches the client before
// the commit.
type capture struct {
	header http.Header
	// sent is the header as it was when the status was written, as a
	// server would have sent it.
	sent   http.Header
	status int
	body   bytes.Buffer
	// limit bounds the body of a storable (2xx or 3xx) response; beyond it
	// the body is dropped and overflow set.
	limit    int
	overflow bool
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

func (c *capture) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if c.overflow {
		return 0, ErrResponseTooLarge
	}
	if c.status < 400 && c.body.Len()+len(p) > c.limit {
		c.overflow = true
		c.body = bytes.Buffer{}
		return 0, ErrResponseTooLarge
	}
	return c.body.Write(p)
}

// finish completes the response after the handler returned: status 200 if
// none was written, and a sniffed Content-Type if the handler set none (as
// the server would have, so that the original and its replays agree).
func (c *capture) finish() {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if _, ok := c.sent["Content-Type"]; !ok && c.body.Len() > 0 {
		c.sent.Set("Content-Type", http.DetectContentType(c.body.Bytes()))
	}
}

// tooLarge reports whether the response cannot be stored.
func (c *capture) tooLarge() bool { return c.overflow || c.body.Len() > c.limit }
