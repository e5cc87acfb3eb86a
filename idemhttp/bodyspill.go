package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"

	"github.com/idemstore/idem"
)

// spill streams a response body that outgrew the store's inline limit to
// the store's BodyStore (idem.Store.PutBody) while the handler writes it,
// through a pipe read by a goroutine of its own, so that memory stays
// bounded by the pipe whatever the response's size.
//
// A BodyStore that writes inside the completion's transaction (a table
// store, idem.Store.BodyStoreInTx) cannot be fed while the handler runs:
// the handler may be using the transaction, even reading a cursor on it.
// The body is then spooled to a temporary file (os.CreateTemp in the
// default directory, $TMPDIR), and put, from the file, once the handler
// returned (finish), in the transaction; the file is removed at once.
type spill struct {
	pw   *io.PipeWriter
	done chan struct{}
	ref  *idem.BodyRef
	err  error
	n    int64
	// aborted is set once the response outgrew the limit.
	aborted bool
	// file is the spool, and put the put finish makes from it, when
	// spooling.
	file *os.File
	put  func(r io.Reader) (*idem.BodyRef, error)
}

// startSpill starts putting a body: put is idem.Store.PutBody (or
// PutBodyTx) bound to the attempt's claim. With spool, the body goes to a
// temporary file, and put runs at finish.
func startSpill(put func(r io.Reader) (*idem.BodyRef, error), spool bool) *spill {
	if spool {
		return startSpool(put)
	}
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

// startSpool starts a spill to a temporary file; a failure to make it
// fails the first write.
func startSpool(put func(r io.Reader) (*idem.BodyRef, error)) *spill {
	done := make(chan struct{})
	close(done) // no goroutine: spillFailed reads err at once
	s := &spill{done: done, put: put}
	f, err := os.CreateTemp("", "idemhttp-body-*")
	if err != nil {
		s.err = spoolError(err)
		return s
	}
	s.file = f
	return s
}

// spoolError is a failure of the spool's disk: the body cannot be stored,
// so the request is refused as with a body store that is down (503).
func spoolError(err error) error {
	return fmt.Errorf("idemhttp: spooling the response body to a temporary file: %w: %w", idem.ErrBodyUnavailable, err)
}

func (s *spill) write(p []byte) error {
	if s.file == nil && s.pw == nil {
		return s.err
	}
	var (
		n   int
		err error
	)
	if s.file != nil {
		n, err = s.file.Write(p)
		if err != nil {
			s.err = spoolError(err)
		}
	} else {
		n, err = s.pw.Write(p)
	}
	s.n += int64(n)
	return err
}

// finish ends the body and waits for the put's reference; a spooled body
// is put now, from its file.
func (s *spill) finish() (*idem.BodyRef, error) {
	if s.pw == nil {
		return s.putSpooled()
	}
	_ = s.pw.Close()
	<-s.done
	return s.ref, s.err
}

func (s *spill) putSpooled() (*idem.BodyRef, error) {
	if s.err != nil || s.file == nil {
		s.removeSpool()
		return nil, s.err
	}
	defer s.removeSpool()
	if _, err := s.file.Seek(0, io.SeekStart); err != nil {
		return nil, spoolError(err)
	}
	return s.put(s.file)
}

func (s *spill) removeSpool() {
	if s.file != nil {
		_ = s.file.Close()
		_ = os.Remove(s.file.Name())
		s.file = nil
	}
}

// abort ends a put whose response will not be stored; its object, if any
// was made, is an orphan for the sweep (a spool has made none).
func (s *spill) abort() {
	if s.pw == nil {
		s.removeSpool()
		return
	}
	_ = s.pw.CloseWithError(errors.New("idemhttp: response not stored"))
	<-s.done
}

// putFunc returns the capture's spill hook for the Do callback's ctx (the
// claim comes from idem.DoClaim), or nil when the store keeps every body
// inline: a put inside *tx when tx is set (it runs once the handler
// returned, see spill), on the pool otherwise.
func (m *middleware[TTx]) putFunc(ctx context.Context, c *idem.Claim, tx *TTx) func(io.Reader) (*idem.BodyRef, error) {
	if m.store.BodyStoreThreshold() < 0 || c == nil {
		return nil
	}
	if tx != nil {
		t := *tx
		return func(r io.Reader) (*idem.BodyRef, error) { return m.store.PutBodyTx(ctx, t, c, r) }
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

// spillTo lets cw stream a body over the store's inline limit through put,
// spooled first when the store writes bodies in the transaction.
func (m *middleware[TTx]) spillTo(cw *capture, put func(io.Reader) (*idem.BodyRef, error)) {
	if put != nil {
		cw.put, cw.inline, cw.spool = put, m.store.BodyStoreThreshold(), m.store.BodyStoreInTx()
	}
}

// putLater replaces the put of a spooled body, which has not run yet: a
// leased handler's transaction, begun after the capture started, is where
// its body then goes.
func (c *capture) putLater(put func(io.Reader) (*idem.BodyRef, error)) {
	if !c.spool || put == nil {
		return
	}
	c.put = put
	if c.spilled != nil {
		c.spilled.put = put
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
