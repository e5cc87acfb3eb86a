package idemhttp

import (
	"context"
	"errors"
	"io"
	"net/http"

	"github.com/idemstore/idem"
)

// spill streams a response body that outgrew the store's inline limit to
// the store's BodyStore (idem.Store.PutBody) while the handler writes it,
// through a pipe read by a goroutine of its own, so that memory stays
// bounded by the pipe whatever the response's size.
type spill struct {
	pw   *io.PipeWriter
	done chan struct{}
	ref  *idem.BodyRef
	err  error
	n    int64
	// aborted is set once the response outgrew the limit.
	aborted bool
}

// startSpill starts putting a body: put is idem.Store.PutBody bound to the
// attempt's claim.
func startSpill(put func(r io.Reader) (*idem.BodyRef, error)) *spill {
	pr, pw := io.Pipe()
	s := &spill{pw: pw, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		s.ref, s.err = put(pr)
		// Unblocks a Write waiting on a Put that gave up early.
		_ = pr.CloseWithError(errSpillEnded)
	}()
	return s
}

var errSpillEnded = errors.New("idemhttp: body store put ended")

func (s *spill) write(p []byte) error {
	n, err := s.pw.Write(p)
	s.n += int64(n)
	return err
}

// finish ends the body and waits for the put's reference.
func (s *spill) finish() (*idem.BodyRef, error) {
	_ = s.pw.Close()
	<-s.done
	return s.ref, s.err
}

// abort ends a put whose response will not be stored; its object, if any
// was made, is an orphan for the sweep.
func (s *spill) abort() {
	_ = s.pw.CloseWithError(errors.New("idemhttp: response not stored"))
	<-s.done
}

// putFunc returns the capture's spill hook for the Do callback's ctx (the
// claim comes from idem.DoClaim), or nil when the store keeps every body
// inline.
func (m *middleware[TTx]) putFunc(ctx context.Context, c *idem.Claim) func(io.Reader) (*idem.BodyRef, error) {
	if m.store.BodyStoreThreshold() < 0 || c == nil {
		return nil
	}
	return func(r io.Reader) (*idem.BodyRef, error) { return m.store.PutBody(ctx, c, r) }
}

// sendBody writes the body of a stored response (resp.BodyRef set) to w,
// after the status and headers, reading it from the body store. writeHead
// writes them; it is called only once the body is known to be readable, so
// a missing or damaged object answers an error instead of a wrong body.
// A failure after the first byte aborts the connection.
func (m *middleware[TTx]) sendBody(ctx context.Context, w http.ResponseWriter, rq *request, resp *idem.Response, writeHead func()) {
	rc, err := m.store.OpenBody(ctx, resp)
	if err != nil {
		m.failClaim(w, rq, err)
		return
	}
	defer rc.Close()
	writeHead()
	if _, err := io.Copy(w, rc); err != nil {
		var corrupt *idem.CorruptRecordError
		if errors.As(err, &corrupt) || errors.Is(err, idem.ErrBodyUnavailable) {
			// Never finish a body that is not the stored one: the client
			// sees a broken response, not a complete wrong one.
			panic(http.ErrAbortHandler)
		}
	}
}

// spillTo lets cw stream a body over the store's inline limit through put.
func (m *middleware[TTx]) spillTo(cw *capture, put func(io.Reader) (*idem.BodyRef, error)) {
	if put != nil {
		cw.put, cw.inline = put, m.store.BodyStoreThreshold()
	}
}

// abortSpill stops a put still running (after a panic of the handler), so
// its goroutine ends.
func (c *capture) abortSpill() {
	if c.spilled != nil {
		c.spilled.abort()
		c.spilled = nil
	}
}
