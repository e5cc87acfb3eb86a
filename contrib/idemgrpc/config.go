package idemgrpc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"time"
)

// Config configures the interceptor made by [UnaryServerInterceptor]. A nil
// *Config, and every zero field, means the default.
type Config struct {
	// Protect reports whether the method named fullMethod
	// ("/package.Service/Method") is protected; calls of other methods pass
	// through untouched (no key needed, no transaction, [Tx] reports false).
	// Defaults to nil: every unary method the interceptor sees is protected.
	// [Methods] builds one from a list.
	Protect func(fullMethod string) bool

	// Metadata is the request metadata key that carries the idempotency
	// key, in lower case. Defaults to "idempotency-key".
	Metadata string

	// KeyFormat is what a key must match. Anchor it. Keys are also refused
	// when longer than idem.MaxKeyLength, with control characters, or sent
	// as more than one metadata value. Defaults to ^[A-Za-z0-9_-]{12,64}$,
	// the default of idemhttp.
	KeyFormat *regexp.Regexp

	// KeyOptional, if set, reports whether a call of a protected method
	// without a key may pass through to the handler unprotected. Defaults
	// to nil: a call without a key fails with InvalidArgument.
	KeyOptional func(ctx context.Context, fullMethod string) bool

	// Tenant returns the tenant a call acts for, for example from the
	// authenticated peer or a metadata value. The same key in two tenants
	// names two records, and the tenant is part of the fingerprint. An
	// error refuses the call: an error carrying a gRPC status (from
	// status.Error) is answered with that status, any other error with
	// InvalidArgument and [ReasonTenantInvalid]. Defaults to nil: one
	// tenant, "".
	Tenant func(ctx context.Context, fullMethod string) (string, error)

	// Fingerprint, if set, returns the bytes that identify the request
	// message, hashed in place of its deterministic encoding (the method,
	// the message type and the tenant are always covered): some of its
	// fields, to make the fingerprint independent of the others, or of
	// encoding changes across schema versions (see the package
	// documentation). It is also the way to protect methods whose messages
	// are not protocol buffers. An error refuses the call like Tenant's,
	// with [ReasonFingerprintFailed]. Defaults to nil.
	Fingerprint func(ctx context.Context, fullMethod string, req any) ([]byte, error)

	// MaxRequestBytes bounds the encoded size of a protected request
	// message; a larger one fails with ResourceExhausted and
	// [ReasonRequestTooLarge] before anything is claimed. It comes on top
	// of the server's own grpc.MaxRecvMsgSize (4 MiB by default), and
	// bounds the copy the fingerprint encodes. Defaults to 1 MiB.
	MaxRequestBytes int

	// MaxResponseBytes bounds the encoded size of a response that is
	// stored (a success, or a failure marked final). A larger one cannot be
	// stored: its transaction is rolled back (nothing happened), the call
	// fails with Internal and [ReasonResponseTooLarge], and the key stays
	// free. Defaults to 1 MiB.
	MaxResponseBytes int

	// Timeout bounds the transaction of a call, from the claim to the
	// commit, handler included. The call's own deadline and cancellation
	// do not end the transaction once the key is claimed: it runs to
	// completion within Timeout and commits, so that the client's retry is
	// answered with the stored response. Defaults to 30s.
	Timeout time.Duration

	// MaxRetryDelay caps the retry delay sent with Aborted (a call with
	// this key in progress): the time the store says the holder needs,
	// at least 50ms, at most MaxRetryDelay. Defaults to 5s.
	MaxRetryDelay time.Duration

	// UnavailableRetryDelay is the retry delay sent with Unavailable (the
	// store could not be reached or could not commit). Defaults to 2s.
	UnavailableRetryDelay time.Duration

	// Logger receives one record per protected call: its outcome, the full
	// method, the gRPC code, a digest of the key and the latency. It never
	// receives a raw key, tenant or message. Defaults to discarding
	// everything.
	Logger *slog.Logger
}

// Methods returns a Config.Protect that protects exactly the listed full
// method names, such as "/shop.v1.Orders/CreateOrder".
func Methods(fullMethods ...string) func(fullMethod string) bool {
	set := make(map[string]bool, len(fullMethods))
	for _, m := range fullMethods {
		set[m] = true
	}
	return func(fullMethod string) bool { return set[fullMethod] }
}

const (
	defaultMetadata              = "idempotency-key"
	defaultMaxRequestBytes       = 1 << 20
	defaultMaxResponseBytes      = 1 << 20
	defaultTimeout               = 30 * time.Second
	defaultMaxRetryDelay         = 5 * time.Second
	defaultUnavailableRetryDelay = 2 * time.Second
	minRetryDelay                = 50 * time.Millisecond
)

// defaultKeyFormat is idemhttp's: wide enough for UUIDs, ULIDs and base64url
// tokens, narrow enough to keep keys out of trouble in logs and metadata.
var defaultKeyFormat = regexp.MustCompile(`^[A-Za-z0-9_-]{12,64}$`)

func (c *Config) settings() (*Config, error) {
	var s Config
	if c != nil {
		s = *c
	}
	if s.Metadata == "" {
		s.Metadata = defaultMetadata
	}
	if s.KeyFormat == nil {
		s.KeyFormat = defaultKeyFormat
	}
	if s.MaxRequestBytes == 0 {
		s.MaxRequestBytes = defaultMaxRequestBytes
	}
	if s.MaxResponseBytes == 0 {
		s.MaxResponseBytes = defaultMaxResponseBytes
	}
	if s.Timeout == 0 {
		s.Timeout = defaultTimeout
	}
	if s.MaxRetryDelay == 0 {
		s.MaxRetryDelay = defaultMaxRetryDelay
	}
	if s.UnavailableRetryDelay == 0 {
		s.UnavailableRetryDelay = defaultUnavailableRetryDelay
	}
	if s.Logger == nil {
		s.Logger = slog.New(slog.DiscardHandler)
	}
	switch {
	case s.Metadata != strings.ToLower(s.Metadata) || strings.HasPrefix(s.Metadata, "grpc-") || strings.HasSuffix(s.Metadata, "-bin"):
		return nil, fmt.Errorf("idemgrpc: Config.Metadata %q must be lower case, not grpc-* and not binary (-bin)", s.Metadata)
	case s.MaxRequestBytes < 0:
		return nil, errors.New("idemgrpc: Config.MaxRequestBytes must not be negative")
	case s.MaxResponseBytes < 0:
		return nil, errors.New("idemgrpc: Config.MaxResponseBytes must not be negative")
	case s.Timeout < 0:
		return nil, errors.New("idemgrpc: Config.Timeout must not be negative")
	case s.MaxRetryDelay < 0:
		return nil, errors.New("idemgrpc: Config.MaxRetryDelay must not be negative")
	case s.UnavailableRetryDelay < 0:
		return nil, errors.New("idemgrpc: Config.UnavailableRetryDelay must not be negative")
	}
	return &s, nil
}
