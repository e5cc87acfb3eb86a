package idemclient

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// The error codes of idemhttp's responses that decide a retry (the
// constants of package idemhttp, repeated so that this package needs
// nothing but the standard library).
const (
	// codeInProgress (409): the original request is still being processed.
	codeInProgress = "idempotency_request_in_progress"
	// codeResponseTooLarge (500): the success could not be stored and
	// nothing happened; a retry gets the same answer.
	codeResponseTooLarge = "idempotency_response_too_large"
)

// peekLimit bounds how much of an error body is read to find its code:
// idemhttp's error bodies are a few hundred bytes.
const peekLimit = 4 << 10

// Retryable reports whether an attempt of a request carrying an
// idempotency key, which ended with resp and err, may be sent again with
// the same key and body. err is the error of the round trip (resp is nil
// then), resp the response otherwise.
//
// Errors are retryable except those a retry cannot cure: a cancelled
// context, a certificate that does not verify, a malformed request. A
// timeout is retryable, whichever deadline it met: check the request's own
// context first (ctx.Err() != nil: stop), as [Transport] does. Statuses are retryable as listed in the
// package documentation: 408, 409 idempotency_request_in_progress, 425,
// 429, 500 (but not idempotency_response_too_large), 502, 503 and 504.
//
// To tell the two 409s (and idemhttp's 500s) apart, Retryable reads up to
// 4 KiB of the body of a 409 or 500 that declares a JSON media type; it
// puts back what it read, so resp.Body still yields the whole body.
func Retryable(resp *http.Response, err error) bool {
	if err != nil {
		return retryableError(err)
	}
	if resp == nil {
		return false
	}
	switch resp.StatusCode {
	case http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests,
		http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	case http.StatusConflict:
		return errorCode(resp) == codeInProgress
	case http.StatusInternalServerError:
		return errorCode(resp) != codeResponseTooLarge
	default:
		return false
	}
}

// retryableError classifies a round trip's error.
func retryableError(err error) bool {
	if errors.Is(err, context.Canceled) {
		// Someone gave up on the request. A deadline is another matter:
		// an attempt's timeout (http.Client.Timeout, the transport's)
		// wraps context.DeadlineExceeded too, and is retryable; the
		// caller checks its own context before retrying.
		return false
	}
	var (
		unknownAuthority x509.UnknownAuthorityError
		invalidCert      x509.CertificateInvalidError
		hostname         x509.HostnameError
		verification     *tls.CertificateVerificationError
	)
	if errors.As(err, &unknownAuthority) || errors.As(err, &invalidCert) ||
		errors.As(err, &hostname) || errors.As(err, &verification) {
		return false
	}
	// net/http reports requests it refuses to send with these texts and no
	// error type of their own; sending them again changes nothing.
	msg := err.Error()
	for _, permanent := range []string{"unsupported protocol scheme", "no Host in request URL", "invalid header field", "invalid method"} {
		if strings.Contains(msg, permanent) {
			return false
		}
	}
	return true
}

// errorCode returns the code of an error body in idemhttp's JSON shape
// ({"code": "…", …}), or "" when the body is not one. It reads up to
// peekLimit bytes of resp.Body and puts them back in front of the rest.
func errorCode(resp *http.Response) string {
	if resp.Body == nil || resp.Body == http.NoBody {
		return ""
	}
	media, _, err := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if err != nil || (media != "application/json" && !strings.HasSuffix(media, "+json")) {
		return ""
	}
	head, err := io.ReadAll(io.LimitReader(resp.Body, peekLimit))
	resp.Body = &peekedBody{Reader: io.MultiReader(bytes.NewReader(head), &errReader{err: err}, resp.Body), body: resp.Body}
	if err != nil {
		return ""
	}
	var e struct {
		Code string `json:"code"`
	}
	if json.Unmarshal(head, &e) != nil {
		return ""
	}
	return e.Code
}

// peekedBody is a response body whose first bytes were read and put back.
type peekedBody struct {
	io.Reader
	body io.ReadCloser
}

func (p *peekedBody) Close() error { return p.body.Close() }

// errReader replays the error that interrupted a peek, once the peeked
// bytes are consumed, instead of hiding it; a nil err reads as io.EOF, so
// that the reader after it takes over.
type errReader struct{ err error }

func (e *errReader) Read([]byte) (int, error) {
	if e.err != nil {
		return 0, e.err
	}
	return 0, io.EOF
}

// RetryAfter returns the delay a response's Retry-After header asks for,
// either delay-seconds or an HTTP date (RFC 9110, section 10.2.3), counted
// from now, and whether the header was present and valid. A date in the
// past is a delay of zero.
func RetryAfter(resp *http.Response, now time.Time) (time.Duration, bool) {
	if resp == nil {
		return 0, false
	}
	v := strings.TrimSpace(resp.Header.Get("Retry-After"))
	if v == "" {
		return 0, false
	}
	if secs, err := strconv.ParseUint(v, 10, 32); err == nil {
		return time.Duration(secs) * time.Second, true
	}
	if when, err := http.ParseTime(v); err == nil {
		return max(when.Sub(now), 0), true
	}
	return 0, false
}
