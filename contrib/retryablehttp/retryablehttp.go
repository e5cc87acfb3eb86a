// Package retryablehttp makes github.com/hashicorp/go-retryablehttp retry
// the way the Idempotency-Key protocol of idemhttp needs: the same key and
// body on every attempt, 409 idempotency_request_in_progress retried (the
// library's default policy gives up on it, so a client got a final "in
// progress" for a transfer that committed), Retry-After honoured on every
// retryable answer within RetryWaitMax, and never a retry of 400, 409
// idempotency_key_reused, 413 or 422.
//
// [NewClient] returns a configured client. To adapt one of your own, set
//
//	c.CheckRetry = idemretryable.CheckRetry
//	c.Backoff = idemretryable.Backoff
//	c.PrepareRetry = idemretryable.RequireKey
//	c.ErrorHandler = retryablehttp.PassthroughErrorHandler
//
// and give each request its key once, with [SetKey], before Do: the library
// sends the request's headers and rewinds its body on every attempt, so
// one SetKey covers all of them.
//
// Import it under another name than go-retryablehttp's package, which has
// the same one:
//
//	import idemretryable "github.com/idemstore/idem/contrib/retryablehttp"
//
// The decisions are those of [idemclient.Retryable] and
// [idemclient.RetryAfter]; package idemclient documents them, and offers a
// retrying http.RoundTripper for programs that do not use go-retryablehttp.
package retryablehttp

import (
	"context"
	"errors"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/hashicorp/go-retryablehttp"

	"github.com/idemstore/idem/idemclient"
)

// Header is the header SetKey sets and RequireKey checks: idemhttp's
// default.
const Header = "Idempotency-Key"

// NewClient returns a go-retryablehttp client with the library's defaults
// (4 retries, waits between 1s and 30s, a pooled transport) and this
// package's policy: CheckRetry, Backoff, RequireKey as PrepareRetry, and
// retryablehttp.PassthroughErrorHandler, so that once the retries are
// spent the caller gets the last response (a 409 in progress, a 503) to
// inspect, rather than an error without it. Set its RetryMax,
// RetryWaitMin, RetryWaitMax and HTTPClient.Timeout (each attempt's bound)
// as usual.
func NewClient() *retryablehttp.Client {
	c := retryablehttp.NewClient()
	c.Logger = nil // the library logs the request URL at debug level; keep it quiet by default
	c.CheckRetry = CheckRetry
	c.Backoff = Backoff
	c.PrepareRetry = RequireKey
	c.ErrorHandler = retryablehttp.PassthroughErrorHandler
	return c
}

// CheckRetry is a retryablehttp.CheckRetry for requests sent with an
// idempotency key. It stops when ctx, the request's context, has ended
// (returning its error, as the library's default policy does), and
// otherwise retries what [idemclient.Retryable] calls retryable: connection
// errors and timeouts, 408, 409 idempotency_request_in_progress, 425,
// 429, 500 (but not idempotency_response_too_large), 502, 503 and 504.
func CheckRetry(ctx context.Context, resp *http.Response, err error) (bool, error) {
	if ctx.Err() != nil {
		return false, ctx.Err()
	}
	return idemclient.Retryable(resp, err), nil
}

// Backoff is a retryablehttp.Backoff: the response's Retry-After (seconds
// or an HTTP date, on any status) capped at maxWait plus up to a tenth of
// it as jitter, or else an exponential backoff from minWait, doubling per
// attempt up to maxWait, drawn between half of it and all of it. The
// library passes RetryWaitMin, RetryWaitMax and the number of the attempt
// that failed, from 0.
func Backoff(minWait, maxWait time.Duration, attemptNum int, resp *http.Response) time.Duration {
	if ra, ok := idemclient.RetryAfter(resp, time.Now()); ok && ra > 0 {
		ra = min(ra, maxWait)
		return ra + rand.N(ra/10+1)
	}
	return idemclient.Backoff(minWait, max(maxWait, minWait), attemptNum+1)
}

// ErrNoKey is returned by RequireKey, and so by the client's Do, for a
// request of a non-idempotent method about to be retried without an
// idempotency key.
var ErrNoKey = errors.New("idem/contrib/retryablehttp: a POST or PATCH without an Idempotency-Key is not retried (call SetKey before Do)")

// RequireKey is a retryablehttp.PrepareRetry that refuses to retry a POST
// or PATCH that carries no idempotency key: without one, the server cannot
// tell the retry from a new request, and the operation could run twice.
func RequireKey(req *http.Request) error {
	if (req.Method == http.MethodPost || req.Method == http.MethodPatch) && req.Header.Get(Header) == "" {
		return ErrNoKey
	}
	return nil
}

// SetKey gives req its idempotency key, once, before Do: the key already in
// its header, else the key of [idemclient.WithKey] in its context, else a
// new random one ([idemclient.NewKey]). It returns the key. Call it once
// per logical operation: a new retryablehttp.Request for the same
// operation must carry the same key (keep it, and set it again with
// idemclient.WithKey or the header).
func SetKey(req *retryablehttp.Request) (string, error) {
	if key := req.Header.Get(Header); key != "" {
		return key, nil
	}
	key, ok := idemclient.KeyFromContext(req.Context())
	if !ok {
		var err error
		if key, err = idemclient.NewKey(); err != nil {
			return "", err
		}
	}
	req.Header.Set(Header, key)
	return key, nil
}
