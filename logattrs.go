package idem

import (
	"context"
	"errors"
	"log/slog"
)

// errorCoder is implemented, optionally, by a [Dialect] that can name the
// driver's code of an error (a SQLSTATE, a MySQL error number, a SQLite
// result code). Packages mysql, postgres and sqlite implement it.
type errorCoder interface {
	ErrorCode(err error) string
}

// storeErrorAttrs is what a log record says of an error of the store's
// database: its class and the driver's code, never its text. Driver
// messages quote values (MySQL "Duplicate entry '…' for key …", a
// PostgreSQL DETAIL "Key (scope, idempotency_key)=(…)"), and keys, scopes
// and bodies never reach logs raw.
func (s *Store[TTx]) storeErrorAttrs(err error) []slog.Attr {
	attrs := []slog.Attr{slog.String("error_class", storeErrorClass(err))}
	if c, ok := s.dialect.(errorCoder); ok {
		if code := c.ErrorCode(err); code != "" {
			attrs = append(attrs, slog.String("error_code", code))
		}
	}
	return attrs
}

// storeErrorClass names the class of an error of the store.
func storeErrorClass(err error) string {
	switch {
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, ErrStoreUnavailable), errors.Is(err, context.DeadlineExceeded):
		return "unavailable"
	case errors.Is(err, ErrRetryable):
		return "retryable"
	case errors.Is(err, ErrMisconfigured):
		return "misconfigured"
	case errors.Is(err, ErrCorruptRecord):
		return "corrupt"
	case errors.Is(err, ErrFenced):
		return "fenced"
	default:
		return "other"
	}
}

// reapError is an error of one step of a reaper pass. Its text carries the
// driver's; a log record carries only its step, key digest, class and code.
type reapError struct {
	step      string
	keyDigest string // empty for a step on no one record
	err       error
}

func (e *reapError) Error() string {
	if e.keyDigest != "" {
		return "idem: reaper " + e.step + " key " + e.keyDigest + ": " + e.err.Error()
	}
	return "idem: reaper " + e.step + ": " + e.err.Error()
}

func (e *reapError) Unwrap() error { return e.err }

// logAttrs describes the error for a log record, without its text.
func (e *reapError) logAttrs(s interface{ storeErrorAttrs(error) []slog.Attr }) []slog.Attr {
	attrs := []slog.Attr{slog.String("step", e.step)}
	if e.keyDigest != "" {
		attrs = append(attrs, slog.String("key", e.keyDigest))
	}
	return append(attrs, s.storeErrorAttrs(e.err)...)
}
