// Package idemclient is the client side of the Idempotency-Key protocol that
// [github.com/idemstore/idem/idemhttp] serves: an [http.RoundTripper] that
// makes "reuse the same key on timeouts, dropped connections and 5xx" true by
// construction.
//
// Each request whose method is in Config.Methods (POST and PATCH, the
// methods idemhttp protects by default) is one logical operation: the
// [Transport] gives it one key (the caller's Idempotency-Key header if set,
// else the key of [WithKey] in its context, else a new random one), and
// sends that key and the same body on every attempt. It retries:
//
//   - connection errors and attempt timeouts (Config.AttemptTimeout, or the
//     base transport's own timeouts);
//   - 500, 502, 503 and 504, except idemhttp's 500
//     idempotency_response_too_large, which a retry would only repeat;
//   - 409 with code idempotency_request_in_progress (the original is still
//     running), 408, 425 and 429;
//
// honouring Retry-After (seconds or an HTTP date) up to Config.MaxRetryAfter,
// and otherwise backing off exponentially with jitter. It never retries any
// other status: not 400, not 409 idempotency_key_reused, not 413, not 422.
// The request's context bounds the whole exchange, retries and waits
// included (an http.Client's Timeout does the same): when the next attempt
// could not start before its deadline, the last answer is returned at once.
//
// Requests of other methods are sent once, unchanged.
//
// A key only protects an operation when the server deduplicates on it:
// point the Transport at idemhttp routes (or a server with the same
// protocol), not at arbitrary POST endpoints.
//
// The response the caller gets carries the request that was sent last, so
// resp.Request.Header.Get("Idempotency-Key") is the key used; a response
// with Idempotency-Replayed: true is the stored original of an attempt whose
// answer was lost.
//
// [Retryable] and [RetryAfter] expose the same decisions for other retry
// libraries; github.com/idemstore/idem/contrib/retryablehttp builds a
// go-retryablehttp policy from them.
package idemclient
