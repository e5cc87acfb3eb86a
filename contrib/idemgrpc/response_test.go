package idemgrpc

import (
	"net/http"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/idemstore/idem"
)

func TestResponseRoundTrip(t *testing.T) {
	r, err := encodeMessage(wrapperspb.String("order-1"), 1<<10)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, r.StatusCode)
	require.Equal(t, "0", r.Header.Get("Grpc-Status"))
	require.Equal(t, "google.protobuf.StringValue", r.Header.Get("Grpc-Message-Type"))
	m, st, err := decode(r)
	require.NoError(t, err)
	require.Nil(t, st)
	require.True(t, proto.Equal(wrapperspb.String("order-1"), m))

	s, err := status.New(codes.NotFound, "no such account").WithDetails(&errdetails.ErrorInfo{Reason: "NO_ACCOUNT"})
	require.NoError(t, err)
	r, err = encodeStatus(s, 1<<10)
	require.NoError(t, err)
	require.Equal(t, http.StatusNotFound, r.StatusCode, "stored failures carry the HTTP equivalent of their code")
	require.Equal(t, "5", r.Header.Get("Grpc-Status"))
	m, st, err = decode(r)
	require.NoError(t, err)
	require.Nil(t, m)
	require.True(t, proto.Equal(s.Proto(), st.Proto()))

	_, err = encodeMessage(wrapperspb.String(strings.Repeat("x", 100)), 50)
	require.ErrorIs(t, err, errTooLarge)
}

// Damaged or foreign records are refused with an error, never a panic and
// never a wrong message.
func TestDecodeDamaged(t *testing.T) {
	good, err := encodeMessage(wrapperspb.Int64(7), 1<<10)
	require.NoError(t, err)
	with := func(k, v string) *idem.Response {
		h := good.Header.Clone()
		h.Set(k, v)
		return &idem.Response{StatusCode: 200, Header: h, Body: good.Body}
	}
	for name, r := range map[string]*idem.Response{
		"nil":                  nil,
		"no headers":           {StatusCode: 200, Body: good.Body},
		"bad code":             with("Grpc-Status", "x"),
		"code out of range":    with("Grpc-Status", "17"),
		"negative code":        with("Grpc-Status", "-1"),
		"unknown type":         with("Grpc-Message-Type", "no.such.Type"),
		"invalid type":         with("Grpc-Message-Type", "not a name"),
		"failure not a status": with("Grpc-Status", "9"),
		"body not the type":    {StatusCode: 200, Header: good.Header, Body: []byte{0xff, 0xff, 0xff}},
		"status disagrees": func() *idem.Response {
			r, _ := encodeStatus(status.New(codes.NotFound, "x"), 1<<10)
			r.Header.Set("Grpc-Status", "9")
			return r
		}(),
	} {
		require.NotPanics(t, func() {
			_, _, err := decode(r)
			require.Error(t, err, name)
		}, name)
	}
}

func TestParseKey(t *testing.T) {
	f := regexp.MustCompile(`^[A-Za-z0-9_-]{12,64}$`)
	k, reason := parseKey([]string{"abcdefghijkl"}, f)
	require.Equal(t, "abcdefghijkl", k)
	require.Empty(t, reason)
	_, reason = parseKey(nil, f)
	require.Equal(t, ReasonKeyMissing, reason)
	for _, vs := range [][]string{
		{""}, {"abcdefghijkl", "abcdefghijkl"}, {"abcdefghij\x00kl"}, {"abcdefghijkl\xff"},
		{strings.Repeat("a", idem.MaxKeyLength+1)}, {" abcdefghijkl"},
	} {
		_, reason := parseKey(vs, f)
		require.Equal(t, ReasonKeyInvalid, reason, "%q", vs)
	}
	// Control characters are refused whatever the format allows.
	_, reason = parseKey([]string{"abc\u0085defghijkl"}, regexp.MustCompile(`.*`))
	require.Equal(t, ReasonKeyInvalid, reason)
}

func TestScopeOf(t *testing.T) {
	require.Equal(t, "acme%20corp /a.B/C", scopeOf("acme corp", "/a.B/C"))
	long := scopeOf(strings.Repeat("t", 300), "/a.B/C")
	require.True(t, strings.HasPrefix(long, "sha256:"))
	require.LessOrEqual(t, len(long), idem.MaxScopeLength)
	require.NotEqual(t, long, scopeOf(strings.Repeat("t", 301), "/a.B/C"))
}
