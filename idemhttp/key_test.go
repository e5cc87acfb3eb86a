package idemhttp_test

import (
	"regexp"
	"strings"
	"testing"
	"unicode"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
	"github.com/idemstore/idem/idemhttp"
)

func TestParseKey(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		values []string
		key    string
		code   string
	}{
		{nil, "", idemhttp.CodeKeyMissing},
		{[]string{"abcdefghijkl"}, "abcdefghijkl", ""},
		{[]string{`"abcdefghijkl"`}, "abcdefghijkl", ""},
		{[]string{" \tabcdefghijkl\t "}, "abcdefghijkl", ""},
		{[]string{`"0123456789ab_-"`}, "0123456789ab_-", ""},
		{[]string{strings.Repeat("a", 64)}, strings.Repeat("a", 64), ""},
		{[]string{"550e8400-e29b-41d4-a716-446655440000"}, "550e8400-e29b-41d4-a716-446655440000", ""},
		{[]string{strings.Repeat("a", 65)}, "", idemhttp.CodeKeyInvalid},
		{[]string{"abcdefghijk"}, "", idemhttp.CodeKeyInvalid}, // 11 characters
		{[]string{""}, "", idemhttp.CodeKeyInvalid},
		{[]string{`""`}, "", idemhttp.CodeKeyInvalid},
		{[]string{`"`}, "", idemhttp.CodeKeyInvalid},
		{[]string{`"abcdefghijkl`}, "", idemhttp.CodeKeyInvalid},
		{[]string{`"abcdefghijkl"x`}, "", idemhttp.CodeKeyInvalid},
		{[]string{`"abcdefghijkl";a=1`}, "", idemhttp.CodeKeyInvalid},
		{[]string{`"abcdef\ghijkl"`}, "", idemhttp.CodeKeyInvalid},  // \g is no escape
		{[]string{`"abcdef\"ghijkl"`}, "", idemhttp.CodeKeyInvalid}, // valid sf-string, key has a quote
		{[]string{`"abcdef"ghijkl"`}, "", idemhttp.CodeKeyInvalid},  // unescaped quote
		{[]string{"abcdefghijkl", "abcdefghijkl"}, "", idemhttp.CodeKeyInvalid},
		{[]string{"abcdefghijkl, mnopqrstuvwx"}, "", idemhttp.CodeKeyInvalid},
		{[]string{"abcdef\x00ghijkl"}, "", idemhttp.CodeKeyInvalid},
		{[]string{"abcdefghijkl\x7f"}, "", idemhttp.CodeKeyInvalid},
		{[]string{"abcdefghijklé"}, "", idemhttp.CodeKeyInvalid},
		{[]string{"abcdefghijkl\xff"}, "", idemhttp.CodeKeyInvalid},
	} {
		key, code := idemhttp.ParseKey(c.values, idemhttp.DefaultKeyFormat)
		require.Equal(t, c.code, code, "%q", c.values)
		require.Equal(t, c.key, key, "%q", c.values)
	}

	// A permissive format still cannot let through what idem refuses.
	anything := regexp.MustCompile(`^.*$`)
	for _, v := range []string{"a\u0085b", strings.Repeat("k", idem.MaxKeyLength+1)} {
		_, code := idemhttp.ParseKey([]string{v}, anything)
		require.Equal(t, idemhttp.CodeKeyInvalid, code, "%q", v)
	}
	key, code := idemhttp.ParseKey([]string{`"a\\b\"c"`}, anything)
	require.Empty(t, code)
	require.Equal(t, `a\b"c`, key, "sf-string escapes are decoded")
}

// FuzzParseKey: parsing never panics; an accepted key is valid for idem and
// the format, and its raw and quoted forms parse back to it.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"abcdefghijkl", `"abcdefghijkl"`, "", `"`, `"\"`, "a\x00"} {
		f.Add(s)
	}
	format := idemhttp.DefaultKeyFormat
	// The same expression compiled again is not the default format, so
	// ParseKey matches it with the regexp engine instead of by hand.
	sameFormat := regexp.MustCompile(format.String())
	f.Fuzz(func(t *testing.T, value string) {
		key, code := idemhttp.ParseKey([]string{value}, format)
		if viaRegexp, regexpCode := idemhttp.ParseKey([]string{value}, sameFormat); viaRegexp != key || regexpCode != code {
			t.Fatalf("%q: the default format gives %q, %q; the regexp %q, %q", value, key, code, viaRegexp, regexpCode)
		}
		if _, twice := idemhttp.ParseKey([]string{value, value}, format); twice != idemhttp.CodeKeyInvalid {
			t.Fatalf("two header lines accepted: %q", value)
		}
		if code != "" {
			if code != idemhttp.CodeKeyInvalid || key != "" {
				t.Fatalf("%q: code %q key %q", value, code, key)
			}
			return
		}
		if !format.MatchString(key) || len(key) > idem.MaxKeyLength || strings.ContainsFunc(key, unicode.IsControl) {
			t.Fatalf("%q: accepted invalid key %q", value, key)
		}
		for _, form := range []string{key, `"` + key + `"`, " " + key + "\t"} {
			if again, code := idemhttp.ParseKey([]string{form}, format); code != "" || again != key {
				t.Fatalf("%q: form %q of key %q parses to %q, %q", value, form, key, again, code)
			}
		}
	})
}

// TestDefaultKeyFormatByHand: the default format, matched without the regexp
// engine, accepts exactly what its expression does: every length around the
// bounds, and every byte at the first, a middle and the last position.
func TestDefaultKeyFormatByHand(t *testing.T) {
	sameFormat := regexp.MustCompile(idemhttp.DefaultKeyFormat.String())
	check := func(v string) {
		t.Helper()
		key, code := idemhttp.ParseKey([]string{v}, idemhttp.DefaultKeyFormat)
		wantKey, wantCode := idemhttp.ParseKey([]string{v}, sameFormat)
		require.Equal(t, wantCode, code, "%q", v)
		require.Equal(t, wantKey, key, "%q", v)
	}
	for n := 0; n <= 70; n++ {
		check(strings.Repeat("aZ9_-", 14)[:n])
	}
	base := []byte("abcdefghijklmnop")
	for c := 0; c < 256; c++ {
		for _, at := range []int{0, len(base) / 2, len(base) - 1} {
			v := append([]byte(nil), base...)
			v[at] = byte(c)
			check(string(v))
		}
	}
	check("abcdefghijklmnop\n")
	check("abcdefghijklmnopé")
}
