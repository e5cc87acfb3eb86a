package idemhttp

import (
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/idemstore/idem"
)

// defaultKeyFormat is the default Config.KeyFormat: wide enough for UUIDs,
// ULIDs and base64url tokens, narrow enough to keep keys out of trouble in
// logs, URLs and headers.
var defaultKeyFormat = regexp.MustCompile(`^[A-Za-z0-9_-]{12,64}$`)

// parseKey returns the idempotency key carried by values, the lines of the
// key header, or the error code that rejects the request: CodeKeyMissing
// when there is no line, CodeKeyInvalid when there is more than one, when the
// value holds a control character, is not valid UTF-8, is longer than
// idem.MaxKeyLength, or does not match format.
//
// The value may be sent raw (abc) or as a structured-field string ("abc",
// RFC 8941 section 3.3.3, with \" and \\ escapes); both name the same key.
// Surrounding spaces and tabs are ignored.
func parseKey(values []string, format *regexp.Regexp) (key, code string) {
	switch len(values) {
	case 0:
		return "", CodeKeyMissing
	case 1:
	default:
		return "", CodeKeyInvalid
	}
	v := strings.Trim(values[0], " \t")
	if !utf8.ValidString(v) || hasControl(v) {
		return "", CodeKeyInvalid
	}
	if strings.HasPrefix(v, `"`) {
		var ok bool
		if v, ok = unquoteSFString(v); !ok {
			return "", CodeKeyInvalid
		}
	}
	if v == "" || len(v) > idem.MaxKeyLength || !matchesFormat(v, format) {
		return "", CodeKeyInvalid
	}
	return v, ""
}

// matchesFormat reports whether v matches format. The default format is
// checked by isDefaultKey: the regexp engine cost a replay through the
// middleware about 2 % of its CPU (docs/performance-history.md, round 6).
func matchesFormat(v string, format *regexp.Regexp) bool {
	if format == defaultKeyFormat {
		return isDefaultKey(v)
	}
	return format.MatchString(v)
}

// isDefaultKey is defaultKeyFormat, ^[A-Za-z0-9_-]{12,64}$, by hand.
func isDefaultKey(v string) bool {
	if len(v) < 12 || len(v) > 64 {
		return false
	}
	for i := 0; i < len(v); i++ {
		switch c := v[i]; {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// unquoteSFString decodes an RFC 8941 sf-string: printable ASCII between
// double quotes, where only \" and \\ are escapes.
func unquoteSFString(s string) (string, bool) {
	if len(s) < 2 || s[0] != '"' || s[len(s)-1] != '"' {
		return "", false
	}
	s = s[1 : len(s)-1]
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '\\':
			i++
			if i == len(s) || (s[i] != '"' && s[i] != '\\') {
				return "", false
			}
			b.WriteByte(s[i])
		case c == '"', c < 0x20, c > 0x7e:
			return "", false
		default:
			b.WriteByte(c)
		}
	}
	return b.String(), true
}

// hasControl reports whether s holds a control character (C0, DEL or C1),
// which idem refuses in keys.
func hasControl(s string) bool {
	return strings.IndexFunc(s, unicode.IsControl) >= 0
}
