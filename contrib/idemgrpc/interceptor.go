package idemgrpc

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"log/slog"
	"net/url"
	"regexp"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/internal/digest"
)

// fingerprintVersion is hashed first into every fingerprint, so that a
// future change of what is hashed can never match an old record by chance.
const fingerprintVersion = "idemgrpc/1"

// UnaryServerInterceptor returns an interceptor that makes the unary methods
// it protects (all of them by default; Config.Protect) safe to retry with an
// idempotency-key metadata value, using store. Install it with
// grpc.ChainUnaryInterceptor, after interceptors that authenticate the call
// (Config.Tenant reads what they established) and before none that retry.
//
// For each protected call it parses the key, derives the scope (tenant and
// full method) and the fingerprint (full method, tenant, the request's type
// and deterministic encoding), then, in one transaction begun by
// [idem.Store.Do]: claims the key, runs the handler with the transaction in
// its context ([Tx]), stores the response message and commits, and only then
// answers. A retry gets the stored message again, with the
// idempotency-replayed: true header metadata. The package documentation lists
// every status it answers.
//
// Streaming methods are not protected (a unary interceptor never sees them).
//
// It returns an error if store is nil or cfg is invalid. The interceptor is
// safe for concurrent use and keeps no state between calls.
func UnaryServerInterceptor[TTx any](store *idem.Store[TTx], cfg *Config) (grpc.UnaryServerInterceptor, error) {
	if store == nil {
		return nil, errors.New("idemgrpc: UnaryServerInterceptor needs a store")
	}
	s, err := cfg.settings()
	if err != nil {
		return nil, err
	}
	i := &interceptor[TTx]{store: store, cfg: s}
	return i.intercept, nil
}

type interceptor[TTx any] struct {
	store *idem.Store[TTx]
	cfg   *Config
}

// call is the interceptor's state for one protected call, for its log record.
type call struct {
	method string
	start  time.Time
	key    string
	scope  string
}

// passThrough makes idem.Store.Do roll back a handler error that is not
// final; the error is then answered as it is.
type passThrough struct{ err error }

func (p *passThrough) Error() string { return "idemgrpc: handler error, rolled back" }

// errResponseInvalid makes idem.Store.Do roll back a response that cannot be
// stored: nil, or not a protocol buffer message.
var errResponseInvalid = errors.New("idemgrpc: the handler's response is not a protocol buffer message")

func (i *interceptor[TTx]) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if i.cfg.Protect != nil && !i.cfg.Protect(info.FullMethod) {
		return handler(ctx, req)
	}
	c := &call{method: info.FullMethod, start: time.Now()}
	md, _ := metadata.FromIncomingContext(ctx)
	key, reason := parseKey(md.Get(i.cfg.Metadata), i.cfg.KeyFormat)
	switch {
	case reason == ReasonKeyMissing && i.cfg.KeyOptional != nil && i.cfg.KeyOptional(ctx, c.method):
		i.log(ctx, c, "unprotected", codes.OK)
		return handler(ctx, req)
	case reason == ReasonKeyMissing:
		return nil, i.fail(ctx, c, "key_missing", codes.InvalidArgument, reason,
			"This method needs an "+i.cfg.Metadata+" metadata value.")
	case reason != "":
		return nil, i.fail(ctx, c, "key_invalid", codes.InvalidArgument, reason, i.keyFormatMessage())
	}
	c.key = key

	var tenant string
	if i.cfg.Tenant != nil {
		t, err := i.cfg.Tenant(ctx, c.method)
		if err != nil {
			return nil, i.hookError(ctx, c, "tenant_invalid", err, ReasonTenantInvalid, "The call's tenant could not be determined.")
		}
		tenant = t
	}
	c.scope = scopeOf(tenant, c.method)

	var typeName string
	msg, isProto := req.(proto.Message)
	if isProto {
		typeName = string(msg.ProtoReflect().Descriptor().FullName())
		if proto.Size(msg) > i.cfg.MaxRequestBytes {
			return nil, i.fail(ctx, c, "request_too_large", codes.ResourceExhausted, ReasonRequestTooLarge,
				"The request message is larger than this method accepts with an "+i.cfg.Metadata+".")
		}
	}
	var hashed []byte
	switch {
	case i.cfg.Fingerprint != nil:
		h, err := i.cfg.Fingerprint(ctx, c.method, req)
		if err != nil {
			return nil, i.hookError(ctx, c, "fingerprint_failed", err, ReasonFingerprintFailed, "The request could not be fingerprinted.")
		}
		hashed = h
	case !isProto:
		return nil, i.fail(ctx, c, "fingerprint_failed", codes.Internal, ReasonFingerprintFailed,
			"The request is not a protocol buffer message; the server needs a Config.Fingerprint for this method.")
	default:
		b, err := deterministic.Marshal(msg)
		if err != nil {
			return nil, i.fail(ctx, c, "fingerprint_failed", codes.InvalidArgument, ReasonFingerprintFailed,
				"The request could not be fingerprinted.")
		}
		hashed = b
	}
	fp := idem.NewFingerprint([]byte(fingerprintVersion), []byte(c.method), []byte(tenant), []byte(typeName), hashed)
	return i.do(ctx, c, fp, req, handler) //nolint:contextcheck // derives its ctx with context.WithoutCancel on purpose: a client that goes away must not cancel a claimed key's work
}

// do claims the key and runs the handler in one transaction of
// idem.Store.Do, and answers from its outcome.
func (i *interceptor[TTx]) do(ctx context.Context, c *call, fp idem.Fingerprint, req any, handler grpc.UnaryHandler) (any, error) {
	// Once the key is claimed, the caller's deadline or cancellation must
	// not abort the transaction: it runs to completion within Timeout and
	// commits, so that the client's retry finds the stored response.
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), i.cfg.Timeout)
	defer cancel()

	var (
		lastResp any
		lastErr  error
	)
	res, err := i.store.Do(dctx, c.scope, c.key, fp, func(ctx context.Context, tx TTx) (*idem.Response, error) {
		a := &attempt{tx: tx, key: c.key, scope: c.scope}
		lastResp, lastErr = run(context.WithValue(ctx, attemptKey{}, a), a, req, handler)
		if lastErr != nil {
			if !a.final.Load() {
				if errors.Is(lastErr, idem.ErrRetryable) {
					return nil, lastErr // Do runs the transaction again
				}
				return nil, &passThrough{err: lastErr}
			}
			st := status.Convert(lastErr)
			if st.Code() == codes.OK { // an error that claims OK is no success
				st = status.New(codes.Unknown, st.Message())
			}
			resp, err := encodeStatus(st, i.cfg.MaxResponseBytes)
			if err != nil {
				return nil, err
			}
			return nil, idem.FinalFailure(resp)
		}
		m, ok := lastResp.(proto.Message)
		if !ok || !m.ProtoReflect().IsValid() {
			return nil, errResponseInvalid
		}
		return encodeMessage(m, i.cfg.MaxResponseBytes)
	})

	var (
		pass       *passThrough
		inProgress *idem.InProgressError
	)
	switch {
	case err == nil && res.Replayed:
		// A body kept in the store's BodyStore is read back (and checked)
		// first: decoding the empty inline body would answer an empty
		// message instead of the stored one.
		stored, lerr := i.store.LoadBody(dctx, res.Response)
		if lerr != nil {
			return nil, i.fail(ctx, c, "replay_failed", codes.Internal, ReasonReplayFailed,
				"The stored response of this "+i.cfg.Metadata+" cannot be replayed.")
		}
		m, st, derr := decode(stored)
		if derr != nil {
			return nil, i.fail(ctx, c, "replay_failed", codes.Internal, ReasonReplayFailed,
				"The stored response of this "+i.cfg.Metadata+" cannot be replayed.")
		}
		_ = grpc.SetHeader(ctx, metadata.Pairs(ReplayedHeader, "true"))
		if st != nil {
			i.log(ctx, c, "replayed", st.Code())
			return nil, st.Err()
		}
		i.log(ctx, c, "replayed", codes.OK)
		return m, nil
	case err == nil && res.Status == idem.StatusFailed:
		i.log(ctx, c, "completed_final_failure", status.Code(lastErr))
		return nil, lastErr
	case err == nil:
		i.log(ctx, c, "completed", codes.OK)
		return lastResp, nil
	case errors.As(err, &pass):
		i.log(ctx, c, "rolled_back", status.Code(pass.err))
		return nil, pass.err
	case errors.Is(err, errTooLarge):
		return nil, i.fail(ctx, c, "response_too_large", codes.Internal, ReasonResponseTooLarge,
			"The response is too large to be stored for retries; nothing was done.")
	case errors.Is(err, errResponseInvalid):
		return nil, i.fail(ctx, c, "response_invalid", codes.Internal, ReasonResponseInvalid,
			"The handler returned no response message; nothing was done.")
	case errors.Is(err, idem.ErrFingerprint):
		return nil, i.fail(ctx, c, "key_reused", codes.FailedPrecondition, ReasonKeyReused,
			"This "+i.cfg.Metadata+" was used with a different request. Use a new key for a new request.")
	case errors.As(err, &inProgress):
		delay := min(max(inProgress.RetryAfter, minRetryDelay), max(i.cfg.MaxRetryDelay, minRetryDelay))
		i.log(ctx, c, "in_progress", codes.Aborted)
		return nil, failRetry(ctx, codes.Aborted, ReasonInProgress,
			"A call with this "+i.cfg.Metadata+" is being processed. Retry later with the same key.", delay)
	case errors.Is(err, idem.ErrInvalidKey):
		return nil, i.fail(ctx, c, "key_invalid", codes.InvalidArgument, ReasonKeyInvalid, i.keyFormatMessage())
	default:
		// The store is unreachable or failing, the commit failed, the
		// transaction kept conflicting, or Timeout ran out: whatever the
		// handler did was rolled back (a commit that failed on a lost
		// connection may have committed; the retry then replays it).
		i.log(ctx, c, "store_unavailable", codes.Unavailable)
		return nil, failRetry(ctx, codes.Unavailable, ReasonStoreUnavailable,
			"The call could not be processed safely right now. Retry later with the same key.", i.cfg.UnavailableRetryDelay)
	}
}

// run calls the handler and marks the attempt ended when it returns (or
// panics: the panic propagates after idem.Store.Do rolled back).
func run(ctx context.Context, a *attempt, req any, handler grpc.UnaryHandler) (any, error) {
	defer a.ended.Store(true)
	return handler(ctx, req)
}

// fail logs and builds one of the interceptor's own error statuses.
func (i *interceptor[TTx]) fail(ctx context.Context, c *call, outcome string, code codes.Code, reason, msg string) error {
	i.log(ctx, c, outcome, code)
	return fail(code, reason, msg)
}

// hookError answers an error of Config.Tenant or Config.Fingerprint: with
// its own status if it carries one, else InvalidArgument with reason.
func (i *interceptor[TTx]) hookError(ctx context.Context, c *call, outcome string, err error, reason, msg string) error {
	if st, ok := status.FromError(err); ok && st.Code() != codes.OK {
		i.log(ctx, c, outcome, st.Code())
		return st.Err()
	}
	return i.fail(ctx, c, outcome, codes.InvalidArgument, reason, msg)
}

func (i *interceptor[TTx]) keyFormatMessage() string {
	return "The " + i.cfg.Metadata + " metadata must be one value matching " + i.cfg.KeyFormat.String() + "."
}

// log writes the one record of a protected call. It carries digests, never
// the raw key, tenant or message.
func (i *interceptor[TTx]) log(ctx context.Context, c *call, outcome string, code codes.Code) {
	level := slog.LevelInfo
	switch outcome {
	case "store_unavailable", "response_too_large", "response_invalid", "replay_failed":
		level = slog.LevelError
	}
	if !i.cfg.Logger.Enabled(ctx, level) {
		return
	}
	attrs := []slog.Attr{
		slog.String("outcome", outcome),
		slog.String("method", c.method),
		slog.String("code", code.String()),
	}
	if c.key != "" && c.scope != "" {
		attrs = append(attrs, slog.String("key", digest.Key(c.scope, c.key)))
	}
	attrs = append(attrs, slog.Duration("latency", time.Since(c.start)))
	i.cfg.Logger.LogAttrs(ctx, level, "idemgrpc: call", attrs...)
}

// parseKey returns the key carried by values, the metadata values of the
// key, or the reason that refuses the call: ReasonKeyMissing without a
// value, ReasonKeyInvalid for more than one, or one that is empty, longer
// than idem.MaxKeyLength, not valid UTF-8, holds a control character or
// does not match format.
func parseKey(values []string, format *regexp.Regexp) (key, reason string) {
	switch len(values) {
	case 0:
		return "", ReasonKeyMissing
	case 1:
	default:
		return "", ReasonKeyInvalid
	}
	v := values[0]
	if v == "" || len(v) > idem.MaxKeyLength || !utf8.ValidString(v) ||
		strings.IndexFunc(v, unicode.IsControl) >= 0 || !format.MatchString(v) {
		return "", ReasonKeyInvalid
	}
	return v, ""
}

// scopeOf names the operation a key belongs to: the tenant (path-escaped, so
// it holds no space) and the full method, as in "acme /shop.v1.Orders/Create".
// A scope idem would refuse (too long, control characters) is replaced by
// "sha256:" and its hex digest, which still tells scopes apart.
func scopeOf(tenant, method string) string {
	s := url.PathEscape(tenant) + " " + method
	if len(s) <= idem.MaxScopeLength && utf8.ValidString(s) && strings.IndexFunc(s, unicode.IsControl) < 0 {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}
