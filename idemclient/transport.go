package idemclient

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"
)

// Config configures a [Transport]. The zero value is usable: every field has
// a default.
type Config struct {
	// Base sends each attempt. Defaults to [http.DefaultTransport].
	Base http.RoundTripper

	// Header is the name of the key's header. Defaults to
	// "Idempotency-Key".
	Header string

	// Methods are the methods whose requests get a key and are retried.
	// Requests of other methods are sent once, unchanged. Defaults to POST
	// and PATCH, the methods idemhttp protects by default.
	Methods []string

	// NewKey makes the key of a request that has none (neither in its
	// header nor through [WithKey]). Defaults to [NewKey].
	NewKey func() (string, error)

	// MaxAttempts bounds the attempts of one request, the first included;
	// 1 sends the request with a key but never retries it. Defaults to 10.
	MaxAttempts int

	// AttemptTimeout bounds how long one attempt waits for the response
	// headers. An attempt that runs out is abandoned and retried with the
	// same key: the server finishes the original (idemhttp detaches the
	// handler from the client) and the retry gets its stored answer, or
	// 409 in progress until then. It does not bound reading the body of
	// the response returned. Defaults to 30s, idemhttp's default
	// Config.Timeout: by then the server has answered or given up.
	AttemptTimeout time.Duration

	// MinBackoff is the first retry's delay when the response gives no
	// Retry-After; each further retry doubles it, up to MaxBackoff. The
	// delay actually waited is drawn between half of it and all of it,
	// so that many clients that failed together do not retry together.
	// Defaults to 100ms.
	MinBackoff time.Duration

	// MaxBackoff caps the backoff delay. Defaults to 10s.
	MaxBackoff time.Duration

	// MaxRetryAfter caps the Retry-After delay honoured: a server asking
	// for more is retried after MaxRetryAfter. Defaults to 10s.
	MaxRetryAfter time.Duration
}

const (
	defaultHeader         = "Idempotency-Key"
	defaultMaxAttempts    = 10
	defaultAttemptTimeout = 30 * time.Second
	defaultMinBackoff     = 100 * time.Millisecond
	defaultMaxBackoff     = 10 * time.Second
	defaultMaxRetryAfter  = 10 * time.Second
)

// Transport is an [http.RoundTripper] that sends each request of a
// protected method with one idempotency key, and retries it with the same
// key and body as the package documentation describes. Use it as an
// [http.Client]'s Transport; it is safe for concurrent use.
type Transport struct {
	cfg     Config
	methods map[string]bool
}

// New returns a Transport configured by cfg (nil: the defaults). It
// refuses negative durations or attempts, MinBackoff above MaxBackoff, and
// a header name that is not a valid HTTP field name.
func New(cfg *Config) (*Transport, error) {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Base == nil {
		c.Base = http.DefaultTransport
	}
	if c.Header == "" {
		c.Header = defaultHeader
	}
	if c.Methods == nil {
		c.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	if c.NewKey == nil {
		c.NewKey = NewKey
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = defaultMaxAttempts
	}
	if c.AttemptTimeout == 0 {
		c.AttemptTimeout = defaultAttemptTimeout
	}
	if c.MinBackoff == 0 {
		c.MinBackoff = defaultMinBackoff
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = max(defaultMaxBackoff, c.MinBackoff)
	}
	if c.MaxRetryAfter == 0 {
		c.MaxRetryAfter = defaultMaxRetryAfter
	}
	switch {
	case !validFieldName(c.Header):
		return nil, fmt.Errorf("idemclient: Header %q is not a valid header field name", c.Header)
	case c.MaxAttempts < 0:
		return nil, fmt.Errorf("idemclient: MaxAttempts %d is negative", c.MaxAttempts)
	case c.AttemptTimeout < 0:
		return nil, fmt.Errorf("idemclient: AttemptTimeout %s is negative", c.AttemptTimeout)
	case c.MinBackoff < 0:
		return nil, fmt.Errorf("idemclient: MinBackoff %s is negative", c.MinBackoff)
	case c.MaxBackoff < c.MinBackoff:
		return nil, fmt.Errorf("idemclient: MaxBackoff %s is below MinBackoff %s", c.MaxBackoff, c.MinBackoff)
	case c.MaxRetryAfter < 0:
		return nil, fmt.Errorf("idemclient: MaxRetryAfter %s is negative", c.MaxRetryAfter)
	}
	t := &Transport{cfg: c, methods: map[string]bool{}}
	for _, m := range c.Methods {
		t.methods[strings.ToUpper(m)] = true
	}
	return t, nil
}

// validFieldName reports whether s is an RFC 9110 token.
func validFieldName(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// errAttemptTimeout is the cause of an attempt abandoned after
// Config.AttemptTimeout.
var errAttemptTimeout = errors.New("idemclient: no response within AttemptTimeout")

// RoundTrip implements [http.RoundTripper]. For a protected method it sends
// the request with its key, retrying as the package documentation says,
// and returns the last response (or error) once an answer is final, the
// attempts are spent, or the context's deadline leaves no time for another
// attempt. It never modifies req: each attempt is a clone with the key set.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if !t.methods[req.Method] {
		return t.cfg.Base.RoundTrip(req)
	}
	key := req.Header.Get(t.cfg.Header)
	if key == "" {
		key, _ = KeyFromContext(req.Context())
	}
	if key == "" {
		var err error
		if key, err = t.cfg.NewKey(); err != nil {
			closeBody(req)
			return nil, err
		}
	}
	body, err := replayableBody(req)
	if err != nil {
		return nil, err
	}

	ctx := req.Context()
	for attempt := 1; ; attempt++ {
		areq := req.Clone(ctx)
		areq.Header.Set(t.cfg.Header, key)
		if body != nil {
			if areq.Body, err = body(attempt); err != nil {
				return nil, fmt.Errorf("idemclient: rewind the body for attempt %d: %w", attempt, err)
			}
		}
		resp, retry, err := t.attempt(ctx, areq)
		if !retry || attempt >= t.cfg.MaxAttempts {
			if err != nil && attempt > 1 {
				err = fmt.Errorf("idemclient: attempt %d of %d: %w", attempt, t.cfg.MaxAttempts, err)
			}
			return resp, err
		}
		wait := t.delay(attempt, resp)
		if deadline, ok := ctx.Deadline(); ok && time.Now().Add(wait).After(deadline) {
			// The next attempt could not start in time: the answer in
			// hand is more useful to the caller than a deadline error.
			return resp, err
		}
		if resp != nil {
			drainAndClose(resp)
		}
		timer := time.NewTimer(wait)
		select {
		case <-timer.C:
		case <-ctx.Done():
			timer.Stop()
			last := err
			if last == nil {
				last = fmt.Errorf("status %d", resp.StatusCode)
			}
			return nil, fmt.Errorf("idemclient: waiting to retry after attempt %d (%v): %w", attempt, last, context.Cause(ctx))
		}
	}
}

// attempt sends one attempt, bounded by AttemptTimeout until its response
// headers arrive, and reports whether it may be retried.
func (t *Transport) attempt(ctx context.Context, req *http.Request) (resp *http.Response, retry bool, err error) {
	actx, cancel := context.WithCancelCause(ctx)
	timer := time.AfterFunc(t.cfg.AttemptTimeout, func() { cancel(errAttemptTimeout) })
	resp, err = t.cfg.Base.RoundTrip(req.WithContext(actx))
	timedOut := !timer.Stop()
	if timedOut && ctx.Err() == nil {
		// The timer fired: whatever the base transport answered, the
		// attempt is abandoned (a body it returned would read as
		// cancelled).
		if resp != nil {
			drainAndClose(resp)
		}
		cancel(nil)
		return nil, true, fmt.Errorf("%w (%s)", errAttemptTimeout, t.cfg.AttemptTimeout)
	}
	if err != nil {
		cancel(nil)
		return nil, ctx.Err() == nil && Retryable(nil, err), err
	}
	// The caller reads the body after RoundTrip returns: the attempt's
	// context ends when the body is closed.
	resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: func() { cancel(nil) }}
	return resp, Retryable(resp, nil), nil
}

// delay is how long to wait before the attempt after attempt number n:
// the response's Retry-After (capped at MaxRetryAfter, plus up to a tenth
// as jitter) if it has one, else the jittered exponential backoff.
func (t *Transport) delay(n int, resp *http.Response) time.Duration {
	if ra, ok := RetryAfter(resp, time.Now()); ok && ra > 0 {
		ra = min(ra, t.cfg.MaxRetryAfter)
		return ra + rand.N(ra/10+1)
	}
	return Backoff(t.cfg.MinBackoff, t.cfg.MaxBackoff, n)
}

// Backoff returns the delay before the retry that follows attempt number n
// (1 for the first attempt): min doubled n-1 times, capped at max, and
// drawn at random between half of that and all of it.
func Backoff(minDelay, maxDelay time.Duration, n int) time.Duration {
	d := minDelay
	for i := 1; i < n && d < maxDelay; i++ {
		d *= 2
	}
	d = min(d, maxDelay)
	if d <= 0 {
		return 0
	}
	return d/2 + rand.N(d/2+1)
}

// replayableBody returns a function that yields the request's body for
// each attempt: the original body first, then GetBody's copies; or, when
// the request has no GetBody, the body read once into memory. It returns
// nil for a request without a body.
func replayableBody(req *http.Request) (func(attempt int) (io.ReadCloser, error), error) {
	if req.Body == nil || req.Body == http.NoBody {
		return nil, nil
	}
	if req.GetBody != nil {
		return func(attempt int) (io.ReadCloser, error) {
			if attempt == 1 {
				return req.Body, nil
			}
			return req.GetBody()
		}, nil
	}
	data, err := io.ReadAll(req.Body)
	_ = req.Body.Close()
	if err != nil {
		return nil, fmt.Errorf("idemclient: read the request body: %w", err)
	}
	return func(int) (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }, nil
}

// closeBody closes a request body the Transport will not send (a
// RoundTripper must close it, even on error).
func closeBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}

// drainLimit bounds what is read of a discarded response so that its
// connection can be reused; a larger body costs a new connection instead.
const drainLimit = 64 << 10

func drainAndClose(resp *http.Response) {
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, drainLimit))
	_ = resp.Body.Close()
}

// cancelOnClose ends an attempt's context when its response body is
// closed.
type cancelOnClose struct {
	io.ReadCloser
	cancel func()
}

func (c *cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}
