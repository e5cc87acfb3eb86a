package idem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"unicode/utf8"
)

// Storable status codes. A stored response is the final answer to a
// request, so informational 1xx codes (which HTTP sends ahead of the final
// answer and never replays as one) are refused, as is anything outside
// HTTP's 200–599. The rule is about the code, not about HTTP: a protocol
// with statuses of its own (gRPC, a message consumer) stores 200 for
// success and the HTTP-equivalent code otherwise, with its own status in a
// header.
const (
	MinStatusCode = 200
	MaxStatusCode = 599
)

// Default limits of a stored response; see Config.MaxResponseBytes and
// Config.MaxResponseHeaderBytes.
const (
	DefaultMaxResponseBytes       = 8 << 20
	DefaultMaxResponseHeaderBytes = 64 << 10
)

// ErrInvalidResponse means a [Response] cannot be stored: its status code
// is outside 200–599, a header name is not an RFC 9110 token, a header value
// holds a control character or invalid UTF-8, or it is larger than the store's limits.
// Nothing was written. It is returned as an *[InvalidResponseError].
var ErrInvalidResponse = errors.New("idem: invalid response")

// ErrCorruptRecord means a stored record could not be answered from: its
// response fails the checks of [Response.Validate] (a status code of 0, a
// header with a newline), its status and response disagree, or a column
// does not decode. It was written by hand, by an older version or damaged.
// The record is left as it is (the key stays bound to it until its
// retention ends); an operator may delete the row, whose key digest the
// store's Logger reports. It is returned as a *[CorruptRecordError].
var ErrCorruptRecord = errors.New("idem: stored record is invalid")

// InvalidResponseError tells which part of a [Response] is invalid. Its
// message never carries a header value or a body.
type InvalidResponseError struct {
	// Field is "StatusCode", "Header" or "Body".
	Field string
	// Reason says what is wrong, without the offending value (except a
	// status code, which is only a number).
	Reason string
}

// Error implements error.
func (e *InvalidResponseError) Error() string {
	return "idem: invalid response: " + e.Field + ": " + e.Reason
}

// Is reports whether target is ErrInvalidResponse.
func (e *InvalidResponseError) Is(target error) bool { return target == ErrInvalidResponse }

// CorruptRecordError reports a stored record that cannot be answered from.
type CorruptRecordError struct {
	// KeyDigest is a short digest of the record's scope and key, safe to
	// log; empty when the dialect could not tell which record it read.
	KeyDigest string
	// Reason says what is wrong, without stored values.
	Reason string
	// Cause is the underlying error (an *InvalidResponseError, a decoding
	// error), reachable through errors.As; its text is not part of Error.
	Cause error
}

// Error implements error.
func (e *CorruptRecordError) Error() string {
	msg := "idem: stored record"
	if e.KeyDigest != "" {
		msg += " of key " + e.KeyDigest
	}
	return msg + " is invalid: " + e.Reason
}

// Is reports whether target is ErrCorruptRecord.
func (e *CorruptRecordError) Is(target error) bool { return target == ErrCorruptRecord }

// Unwrap returns Cause.
func (e *CorruptRecordError) Unwrap() error { return e.Cause }

// Validate checks what every store requires of a response, whatever its
// limits: a status code in 200–599 and headers valid per RFC 9110 (names
// are tokens; values hold no control character but horizontal tab, so no
// CR, LF or NUL, and are valid UTF-8). It returns an *[InvalidResponseError], or nil. A nil
// response is invalid.
func (r *Response) Validate() error {
	if r == nil {
		return &InvalidResponseError{Field: "Response", Reason: "nil"}
	}
	if r.StatusCode < MinStatusCode || r.StatusCode > MaxStatusCode {
		return &InvalidResponseError{Field: "StatusCode",
			Reason: strconv.Itoa(r.StatusCode) + " is not a final status (200-599)"}
	}
	for name, values := range r.Header {
		if !validHeaderName(name) {
			return &InvalidResponseError{Field: "Header", Reason: "a header name is not an RFC 9110 token"}
		}
		for _, v := range values {
			if !validHeaderValue(v) {
				// The name is a token, safe to show; the value is not.
				return &InvalidResponseError{Field: "Header", Reason: "a value of " + name + " holds a control character or invalid UTF-8"}
			}
		}
	}
	return nil
}

// headerSize is the size of h as header lines on the wire: "Name: value\r\n".
func headerSize(h map[string][]string) int {
	n := 0
	for name, values := range h {
		for _, v := range values {
			n += len(name) + len(v) + 4
		}
	}
	return n
}

// validateResponse is Validate with the store's size limits.
func (s *Store[TTx]) validateResponse(r *Response) error {
	if err := r.Validate(); err != nil {
		return err
	}
	if len(r.Body) > s.cfg.MaxResponseBytes {
		return &InvalidResponseError{Field: "Body", Reason: fmt.Sprintf(
			"%d bytes, more than Config.MaxResponseBytes (%d)", len(r.Body), s.cfg.MaxResponseBytes)}
	}
	if n := headerSize(r.Header); n > s.cfg.MaxResponseHeaderBytes {
		return &InvalidResponseError{Field: "Header", Reason: fmt.Sprintf(
			"%d bytes, more than Config.MaxResponseHeaderBytes (%d)", n, s.cfg.MaxResponseHeaderBytes)}
	}
	return nil
}

// checkRecord validates a record read from the store before anything is
// answered from it. Size limits are not applied: a record stored under
// larger limits (since lowered) is still a valid answer.
func checkRecord(rec *Record, kd string) error {
	if rec == nil || !rec.Status.Final() {
		return nil
	}
	if rec.Response == nil {
		return &CorruptRecordError{KeyDigest: kd, Reason: "completed without a response"}
	}
	if err := rec.Response.Validate(); err != nil {
		field := "Response"
		if invalid, ok := errors.AsType[*InvalidResponseError](err); ok {
			field = invalid.Field
		}
		return &CorruptRecordError{KeyDigest: kd, Reason: "its response is invalid (" + field + ")", Cause: err}
	}
	return nil
}

// checkRead validates rec (when err is nil) and logs, with the key digest,
// any ErrCorruptRecord, whether checkRecord found it or the dialect did
// while decoding. It returns the error to hand on.
func (s *Store[TTx]) checkRead(ctx context.Context, rec *Record, err error, kd string) error {
	if err == nil {
		err = checkRecord(rec, kd)
	}
	if corrupt, ok := errors.AsType[*CorruptRecordError](err); ok {
		if corrupt.KeyDigest == "" {
			c := *corrupt
			c.KeyDigest = kd
			err = &c
			corrupt = &c
		}
		s.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idem: stored record is invalid; answering ErrCorruptRecord, the row is left for an operator to delete",
			slog.String("dialect", s.dialect.Name()), slog.String("key", kd), slog.String("reason", corrupt.Reason))
	}
	return err
}

// callbackErrorAttrs is what a log record says of an error returned by the
// application's callback (a status check): its class, without the text,
// which may carry keys or business data. With Config.LogCallbackErrors the
// text is logged too.
func (s *Store[TTx]) callbackErrorAttrs(err error) []slog.Attr {
	attrs := []slog.Attr{slog.String("error_class", errorClass(err))}
	if s.cfg.LogCallbackErrors {
		attrs = append(attrs, slog.String("error", err.Error()))
	}
	return attrs
}

// errorClass names err's class without its text: the sentinel of idem it
// matches, or else the type of the innermost error of the chain.
func errorClass(err error) string {
	for _, known := range []error{context.DeadlineExceeded, context.Canceled, ErrStoreUnavailable,
		ErrRetryable, ErrFenced, ErrInvalidResponse} {
		if errors.Is(err, known) {
			return known.Error()
		}
	}
	for {
		next := errors.Unwrap(err)
		if next == nil {
			return fmt.Sprintf("%T", err)
		}
		err = next
	}
}

// validHeaderName reports whether name is an RFC 9110 token (section 5.1):
// one or more tchar.
func validHeaderName(name string) bool {
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		if !isTchar(name[i]) {
			return false
		}
	}
	return true
}

// isTchar reports whether c is an RFC 9110 tchar: "!" / "#" / "$" / "%" /
// "&" / "'" / "*" / "+" / "-" / "." / "^" / "_" / "`" / "|" / "~" / DIGIT /
// ALPHA.
func isTchar(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	switch c {
	case '!', '#', '$', '%', '&', '\'', '*', '+', '-', '.', '^', '_', '`', '|', '~':
		return true
	}
	return false
}

// validHeaderValue reports whether v is a valid field value (RFC 9110
// section 5.5): visible characters, spaces, horizontal tabs and obs-text. CR, LF and NUL are "invalid and dangerous"; the other
// controls are invalid too, and HTTP/2 servers drop such fields, so a
// stored one could not be replayed as stored.
//
// Bytes 0x80-0xFF are allowed only as valid UTF-8: headers are stored as
// JSON, which would replace anything else by U+FFFD, and a replay must give
// back what was stored.
func validHeaderValue(v string) bool {
	if !utf8.ValidString(v) {
		return false
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < 0x20 && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// checkError is an unknown verdict's reason. user marks an error the
// application's status check returned, whose text is only logged with
// Config.LogCallbackErrors; idem's own reasons are logged as they are.
type checkError struct {
	msg   string
	cause error
	user  bool
}

func (e *checkError) Error() string { return e.msg }

func (e *checkError) Unwrap() error { return e.cause }

// checkErrorAttrs describes a failed status check for a log record.
func (s *Store[TTx]) checkErrorAttrs(err error) []slog.Attr {
	ce, ok := errors.AsType[*checkError](err)
	switch {
	case !ok:
		return []slog.Attr{slog.String("error", err.Error())} // idem's own message
	case ce.user:
		return append([]slog.Attr{slog.String("error", ce.msg)}, s.callbackErrorAttrs(ce.cause)...)
	default:
		return []slog.Attr{slog.String("error", ce.msg+": "+ce.cause.Error())} // an InvalidResponseError carries no value
	}
}
