package idemhttp

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// Error codes of the responses the middleware writes itself. Clients branch on
// the HTTP status and the code, never on the message.
const (
	// CodeKeyMissing (400): the request has no Idempotency-Key header.
	CodeKeyMissing = "idempotency_key_missing"
	// CodeKeyInvalid (400): the key does not match the format, is sent on
	// more than one header line, or holds control characters.
	CodeKeyInvalid = "idempotency_key_invalid"
	// CodeKeyReused (409, or Config.MismatchStatus): the key was used before
	// with a different request. The stored record is unchanged.
	CodeKeyReused = "idempotency_key_reused"
	// CodeInProgress (409): another request with this key is being
	// processed. Retry after the Retry-After header's seconds, with the
	// same key.
	CodeInProgress = "idempotency_request_in_progress"
	// CodeStoreUnavailable (503): the idempotency store could not be reached
	// or could not commit; the handler did not run, or its work was rolled
	// back. Retry after Retry-After with the same key.
	CodeStoreUnavailable = "idempotency_store_unavailable"
	// CodeLeaseLost (503, leased mode only): the request's lease on the key
	// was taken over by another attempt (after it ran out, through the
	// store's StatusCheck or BlindTakeover) before its response was stored.
	// Nothing of it was stored; retry after Retry-After with the same key
	// to get the other attempt's result.
	CodeLeaseLost = "idempotency_lease_lost"
	// CodeBodyTooLarge (413): the request body, or its gzip-decoded form, is
	// larger than Config.MaxBodyBytes.
	CodeBodyTooLarge = "idempotency_body_too_large"
	// CodeBodyInvalid (400): a JSON body that does not parse or nests deeper
	// than Config.MaxJSONDepth, a gzip body that does not decode, or a body
	// that could not be read.
	CodeBodyInvalid = "idempotency_body_invalid"
	// CodeTenantInvalid (400): Config.Tenant returned an error that is not
	// an *Error.
	CodeTenantInvalid = "idempotency_tenant_invalid"
	// CodeFingerprintFailed (400): Config.Fingerprint returned an error that
	// is not an *Error.
	CodeFingerprintFailed = "idempotency_fingerprint_failed"
	// CodeOperationFailed (500): Config.Operation returned an error that
	// is not an *Error, or an empty name. The handler did not run.
	CodeOperationFailed = "idempotency_operation_failed"
	// CodeNoResponse (500): the handler returned without writing a status
	// or a body, so the attempt is taken as one whose handler never ran
	// (a router adapter that did not call it, as when a transaction retry
	// re-enters a chain that cannot run twice) and nothing is stored. In
	// the transactional mode its transaction was rolled back and the key is
	// free; in the leased mode the record stays processing until its lease
	// runs out and the store's StatusCheck decides, because the handler may
	// have had an outside effect.
	CodeNoResponse = "idempotency_handler_no_response"
	// CodeResponseTooLarge (500): the handler's successful response (or a
	// failure it marked final) is larger than Config.MaxResponseBytes and
	// cannot be stored. Its transaction was rolled back; nothing happened.
	CodeResponseTooLarge = "idempotency_response_too_large"
	// CodeResponseInvalid (500): the handler's response that would be
	// stored is refused by the store (idem.ErrInvalidResponse): a status
	// outside 200–599 or a replayed header with a control character in its
	// value. In the transactional mode its transaction was rolled back and
	// nothing happened; in the leased mode the record stays processing
	// until the store's StatusCheck decides, as after a store failure.
	CodeResponseInvalid = "idempotency_response_invalid"
	// CodeRecordInvalid (500): the key's stored record cannot be replayed
	// (idem.ErrCorruptRecord: written by hand, by an older version, or
	// damaged). Nothing ran. The record is left for an operator to delete
	// (the store logs its key digest); until then, or until its retention
	// ends, every retry with the key gets this answer.
	CodeRecordInvalid = "idempotency_record_invalid"
	// CodeMethodInvalid (400): the request's method is a case variant of a
	// protected method ("post" when POST is protected). Methods are
	// case-sensitive (RFC 9110 section 9.1), so the middleware would not
	// protect it, yet a router that matches methods without regard to case
	// would run the protected handler: it is refused instead.
	CodeMethodInvalid = "idempotency_method_invalid"
)

// MismatchStatusIETF is the status the IETF draft "The Idempotency-Key HTTP
// Header Field" gives a key reused with a different request: 422
// Unprocessable Content. Set Config.MismatchStatus to it to follow the draft;
// idemhttp answers 409 by default, which keeps both conflicts on one status
// told apart by their code.
const MismatchStatusIETF = http.StatusUnprocessableEntity

// Error is an error response of the middleware: its status, code and message,
// and the request ID it is sent with.
//
// Config.Tenant and Config.Fingerprint may return an *Error to choose the
// response themselves; Config.RenderError receives one to render.
type Error struct {
	// Status is the HTTP status code.
	Status int
	// Code is the machine-readable reason, one of the Code constants for
	// errors of the middleware.
	Code string
	// Message is for humans; clients must not parse it. It never holds the
	// key or any part of the body.
	Message string
	// RequestID identifies the request in logs; the middleware fills it in.
	RequestID string
	// RetryAfter, when positive, is sent as the Retry-After header in whole
	// seconds, rounded up.
	RetryAfter time.Duration
}

// Error implements error.
func (e *Error) Error() string {
	return fmt.Sprintf("idemhttp: %d %s: %s", e.Status, e.Code, e.Message)
}

// errorBody is the JSON error contract.
type errorBody struct {
	Code      string `json:"code"`
	Message   string `json:"message"`
	RequestID string `json:"request_id"`
}

// WriteError writes e in the JSON error contract,
//
//	{"code": "...", "message": "...", "request_id": "..."}
//
// with Content-Type application/json and the status e.Status. It is the
// default Config.RenderError; handlers may call it to answer their own errors
// in the same shape. The middleware sets the X-Request-Id and Retry-After
// headers before it calls the renderer; WriteError sets them too, for callers
// outside the middleware.
func WriteError(w http.ResponseWriter, e *Error) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	if e.RequestID != "" {
		h.Set(requestIDHeader, e.RequestID)
	}
	if e.RetryAfter > 0 {
		h.Set("Retry-After", retryAfterSeconds(e.RetryAfter))
	}
	body, err := json.Marshal(errorBody{Code: e.Code, Message: e.Message, RequestID: e.RequestID})
	if err != nil { // unreachable: three strings always marshal
		body = []byte(`{"code":"internal_error","message":"","request_id":""}`)
	}
	w.WriteHeader(e.Status)
	_, _ = w.Write(append(body, '\n'))
}

// retryAfterSeconds renders d as a Retry-After value: whole seconds, rounded
// up, at least 1.
func retryAfterSeconds(d time.Duration) string {
	s := int64((d + time.Second - 1) / time.Second)
	return strconv.FormatInt(max(s, 1), 10)
}
