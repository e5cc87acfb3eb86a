package idemhttp

import (
	"context"
	"time"

	"github.com/idemstore/idem/internal/digest"
)

// RequestEvent reports one protected request, for metrics and traces (see
// Config.Observe and contrib/idemotel). It names the record only by the key
// digest, never by the key, the tenant or a body.
type RequestEvent struct {
	// Outcome is the outcome the request's log record names: "completed",
	// "completed_final_failure", "replayed", "rolled_back", "key_reused",
	// "in_progress", "store_unavailable", "key_missing", "key_invalid",
	// "body_rejected", "tenant_invalid", "fingerprint_failed",
	// "method_invalid", "operation_failed", "store_misconfigured",
	// "no_response", "response_too_large", "response_invalid",
	// "record_invalid", "unprotected", "panic", and in the leased mode
	// "lease_lost" and "rolled_back_not_released". A bounded set.
	Outcome string
	// Mode is the middleware's mode.
	Mode Mode
	// Method is the request's method (one of Config.Methods).
	Method string
	// Route is the pattern in the request's Pattern field (set by
	// ServeMux, and by chi once it has routed) without its method, such
	// as "/orders/{id}", or "" when there is none: the raw path, which is
	// unbounded, is never reported.
	Route string
	// Status is the HTTP status answered, 0 when none was (a panic).
	Status int
	// KeyDigest is the key's digest, "" when the request had no valid key.
	KeyDigest string
	// Attempt is the lease's holder number in the leased mode, else 0.
	Attempt int
	// Latency is the time from the request's arrival to its answer.
	Latency time.Duration
}

// observe reports rq to Config.Observe; callers check that it is set.
func (m *middleware[TTx]) observe(ctx context.Context, rq *request, outcome string, status int, latency time.Duration) {
	e := RequestEvent{
		Outcome: outcome, Mode: m.cfg.Mode, Method: rq.r.Method, Status: status,
		Attempt: rq.attempt, Latency: latency,
	}
	e.Route = patternPath(rq.r.Pattern)
	if rq.key != "" && rq.scope != "" {
		e.KeyDigest = digest.Key(rq.scope, rq.key)
	}
	m.cfg.Observe(ctx, e)
}
