package idem_test

import (
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func TestResponseValidate(t *testing.T) {
	valid := []*idem.Response{
		{StatusCode: 200},
		{StatusCode: 599, Header: http.Header{"X-A": {"", "a\tb", "café"}, "!#$%&'*+-.^_`|~09azAZ": nil}, Body: []byte{0, 255}},
	}
	for _, r := range valid {
		require.NoError(t, r.Validate())
	}
	invalid := map[string]*idem.Response{
		"nil":            nil,
		"status 0":       {StatusCode: 0},
		"status 199":     {StatusCode: 199},
		"status 600":     {StatusCode: 600},
		"empty name":     {StatusCode: 200, Header: http.Header{"": {"v"}}},
		"name with ':'":  {StatusCode: 200, Header: http.Header{"A:B": {"v"}}},
		"value with LF":  {StatusCode: 200, Header: http.Header{"A": {"secret-value\nX: y"}}},
		"value with NUL": {StatusCode: 200, Header: http.Header{"A": {"a\x00"}}},
		"value with DEL": {StatusCode: 200, Header: http.Header{"A": {"a\x7f"}}},
		"latin-1 value":  {StatusCode: 200, Header: http.Header{"A": {"caf\xe9"}}},
	}
	for name, r := range invalid {
		err := r.Validate()
		require.ErrorIs(t, err, idem.ErrInvalidResponse, name)
		require.NotContains(t, err.Error(), "secret-value", name)
		var typed *idem.InvalidResponseError
		require.True(t, errors.As(err, &typed), name)
	}
}

func TestCorruptRecordErrorHidesItsCause(t *testing.T) {
	cause := errors.New(`invalid character 's' in "secret"`)
	err := &idem.CorruptRecordError{KeyDigest: "0123456789abcdef", Reason: "its response headers do not decode", Cause: cause}
	require.ErrorIs(t, err, idem.ErrCorruptRecord)
	require.ErrorIs(t, err, cause, "the cause stays reachable")
	require.False(t, strings.Contains(err.Error(), "secret"), "the cause's text is not in the message")
	require.Contains(t, err.Error(), "0123456789abcdef")
}

func TestConfigRefusesNegativeResponseLimits(t *testing.T) {
	d := newSQLiteDialect(t)
	for _, cfg := range []*idem.Config{{MaxResponseBytes: -1}, {MaxResponseHeaderBytes: -1}} {
		_, err := idem.New(d, cfg)
		require.ErrorContains(t, err, "must not be negative")
	}
	_, err := idem.New(d, &idem.Config{MaxResponseBytes: 1, MaxResponseHeaderBytes: 1})
	require.NoError(t, err)
}
