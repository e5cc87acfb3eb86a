package idemgrpc

import (
	"context"
	"strconv"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// ErrorDomain is the Domain of the google.rpc.ErrorInfo detail attached to
// every status the interceptor answers by itself; its Reason is one of the
// Reason constants. Clients branch on the code and the reason, never on the
// message.
const ErrorDomain = "idem.idemstore.github.com"

// Reasons of the statuses the interceptor answers by itself, in the
// google.rpc.ErrorInfo detail.
const (
	// ReasonKeyMissing (InvalidArgument): a protected method was called
	// without the idempotency-key metadata.
	ReasonKeyMissing = "IDEMPOTENCY_KEY_MISSING"
	// ReasonKeyInvalid (InvalidArgument): the key does not match the
	// format, is sent as more than one value, or holds control characters.
	ReasonKeyInvalid = "IDEMPOTENCY_KEY_INVALID"
	// ReasonKeyReused (FailedPrecondition): the key was used before with a
	// different request. The stored record is unchanged.
	ReasonKeyReused = "IDEMPOTENCY_KEY_REUSED"
	// ReasonInProgress (Aborted): another call with this key is being
	// processed. Retry with the same key after the delay of the
	// google.rpc.RetryInfo detail, also sent as the grpc-retry-pushback-ms
	// trailer that gRPC's retry policies honour.
	ReasonInProgress = "IDEMPOTENCY_REQUEST_IN_PROGRESS"
	// ReasonStoreUnavailable (Unavailable): the idempotency store could not
	// be reached or could not commit; the handler did not run, or its work
	// was rolled back. Retry with the same key after the RetryInfo delay.
	ReasonStoreUnavailable = "IDEMPOTENCY_STORE_UNAVAILABLE"
	// ReasonRequestTooLarge (ResourceExhausted): the request message is
	// larger than Config.MaxRequestBytes.
	ReasonRequestTooLarge = "IDEMPOTENCY_REQUEST_TOO_LARGE"
	// ReasonTenantInvalid (InvalidArgument): Config.Tenant returned an
	// error without a gRPC status.
	ReasonTenantInvalid = "IDEMPOTENCY_TENANT_INVALID"
	// ReasonFingerprintFailed (InvalidArgument, or Internal for a request
	// that is not a protocol buffer message and no Config.Fingerprint):
	// the request could not be fingerprinted.
	ReasonFingerprintFailed = "IDEMPOTENCY_FINGERPRINT_FAILED"
	// ReasonResponseTooLarge (Internal): the handler's response, or a
	// failure it marked final, is larger than Config.MaxResponseBytes and
	// cannot be stored. Its transaction was rolled back; nothing happened.
	ReasonResponseTooLarge = "IDEMPOTENCY_RESPONSE_TOO_LARGE"
	// ReasonResponseInvalid (Internal): the handler returned a nil response
	// and no error, or a response that is not a protocol buffer message.
	// Its transaction was rolled back.
	ReasonResponseInvalid = "IDEMPOTENCY_RESPONSE_INVALID"
	// ReasonReplayFailed (Internal): the key's stored response cannot be
	// turned back into a message (its type is no longer linked into the
	// server, or the record is damaged). The handler is not run again and
	// the record is left as it is.
	ReasonReplayFailed = "IDEMPOTENCY_REPLAY_FAILED"
)

// PushbackTrailer is the trailer that tells a gRPC client with a retry
// policy how many milliseconds to wait before its next attempt (gRFC A6).
const PushbackTrailer = "grpc-retry-pushback-ms"

// ReplayedHeader is the response header metadata set to "true" on a
// replayed answer (a stored success or a stored final failure).
const ReplayedHeader = "idempotency-replayed"

// fail builds the status error of the interceptor's own answers.
func fail(code codes.Code, reason, msg string) error {
	st := status.New(code, msg)
	if d, err := st.WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain}); err == nil {
		st = d
	}
	return st.Err()
}

// failRetry is fail for an answer that may be retried after delay: the
// delay goes in a google.rpc.RetryInfo detail and in the pushback trailer,
// which is all the trailers-only answer a gRPC retry needs carries.
func failRetry(ctx context.Context, code codes.Code, reason, msg string, delay time.Duration) error {
	st := status.New(code, msg)
	if d, err := st.WithDetails(
		&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain},
		&errdetails.RetryInfo{RetryDelay: durationpb.New(delay)},
	); err == nil {
		st = d
	}
	_ = grpc.SetTrailer(ctx, metadata.Pairs(PushbackTrailer, strconv.FormatInt(delay.Milliseconds(), 10)))
	return st.Err()
}

// RetryDelay returns the delay a status error of the interceptor asks the
// client to wait before retrying with the same key (its
// google.rpc.RetryInfo detail), and false when err carries none.
func RetryDelay(err error) (time.Duration, bool) {
	st, ok := status.FromError(err)
	if !ok {
		return 0, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}

// Reason returns the reason of a status error the interceptor answered by
// itself (one of the Reason constants), or "" for any other error.
func Reason(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return ""
	}
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetDomain() == ErrorDomain {
			return ei.GetReason()
		}
	}
	return ""
}
