package idemhttp_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/idemhttp"
)

const testDepth = 64

func TestCanonicalJSON(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("9876543210", 1000)
	for _, c := range []struct{ in, want string }{
		{`{"b":1,"a":2}`, `{"a":2,"b":1}`},
		{" {\n\t\"b\" : [ 1 , 2 ] ,\r\n \"a\" : { \"y\" : null , \"x\" : true } } ", `{"a":{"x":true,"y":null},"b":[1,2]}`},
		{`[{"b":1,"a":2},{"d":[],"c":{}}]`, `[{"a":2,"b":1},{"c":{},"d":[]}]`},
		{`{"a":1,"b":0,"a":2}`, `{"a":1,"a":2,"b":0}`},           // duplicates keep their order
		{`{"é":1,"z":2,"A":3,"":4}`, `{"":4,"A":3,"z":2,"é":1}`}, // byte order of the decoded names
		{`{"\u0062":1,"a":2}`, `{"a":2,"b":1}`},                  // names compare decoded
		{`{"b":1,"A":2}`, `{"A":2,"b":1}`},                       // sorted ignoring case
		// Names that differ only in case keep their document order: Go's
		// encoding/json matches them ignoring case and keeps the last one,
		// so the two orders are two different requests.
		{`{"amount_cents":100,"AMOUNT_CENTS":999}`, `{"amount_cents":100,"AMOUNT_CENTS":999}`},
		{`{"AMOUNT_CENTS":999,"amount_cents":100}`, `{"AMOUNT_CENTS":999,"amount_cents":100}`},
		{`{"\u212a":1,"k":2}`, `{"K":1,"k":2}`},                          // the Kelvin sign folds to k
		{`"\u0061\u00e9\/\ud83d\ude00"`, `"aé/😀"`},                       // one escaping for strings
		{`"\u0001\u001f\n\t\r\b\f\"\\"`, `"\u0001\u001f\n\t\r\b\f\"\\"`}, // control characters stay escaped
		{`"\ud800x"`, "\"\uFFFDx\""},                                     // a lone surrogate becomes U+FFFD
		{"\"\xffx\"", "\"\uFFFDx\""},                                     // so does invalid UTF-8
		{`[1.0, 1, -0, 1E+2, 1e2, 0.10]`, `[1.0,1,-0,1E+2,1e2,0.10]`},    // numbers keep their literal
		{`{"n":` + long + `}`, `{"n":` + long + `}`},
		{` 42 `, `42`},
		{`"x"`, `"x"`},
		{`null`, `null`},
		{`false`, `false`},
	} {
		got, err := idemhttp.CanonicalJSON([]byte(c.in), testDepth)
		require.NoError(t, err, c.in)
		require.Equal(t, c.want, string(got), c.in)
		again, err := idemhttp.CanonicalJSON(got, testDepth)
		require.NoError(t, err)
		require.Equal(t, got, again, "canonical forms are stable")
	}
}

func TestCanonicalJSONRejects(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		``, ` `, `{`, `}`, `{"a":1,}`, `[1 2]`, `[1,]`, `01`, `{} {}`, `{}x`, `NaN`, `"open`,
		`{"a" 1}`, `{1:2}`, `{'a':1}`, `[1]]`, `tru`, "\"a\x01\"", `+1`, `.5`, `1.`,
	} {
		_, err := idemhttp.CanonicalJSON([]byte(in), testDepth)
		require.Error(t, err, "%q", in)
		require.False(t, errors.Is(err, idemhttp.ErrJSONTooDeep), "%q", in)
	}
}

func TestCanonicalJSONDepth(t *testing.T) {
	t.Parallel()
	nest := func(n int) []byte {
		return []byte(strings.Repeat(`[{"a":`, n/2) + strings.Repeat("[", n%2) + "0" + strings.Repeat("]", n%2) + strings.Repeat("}]", n/2))
	}
	_, err := idemhttp.CanonicalJSON(nest(testDepth), testDepth)
	require.NoError(t, err, "exactly the limit")
	_, err = idemhttp.CanonicalJSON(nest(testDepth+1), testDepth)
	require.ErrorIs(t, err, idemhttp.ErrJSONTooDeep)

	start := time.Now()
	_, err = idemhttp.CanonicalJSON([]byte(strings.Repeat("[", 100_000)+strings.Repeat("]", 100_000)), testDepth)
	require.ErrorIs(t, err, idemhttp.ErrJSONTooDeep)
	_, err = idemhttp.CanonicalJSON([]byte(strings.Repeat(`{"a":`, 100_000)), testDepth)
	require.ErrorIs(t, err, idemhttp.ErrJSONTooDeep)
	require.Less(t, time.Since(start), 2*time.Second, "refused without reading the rest")
}

// FuzzCanonicalJSON: canonicalisation never panics, accepts every valid
// JSON text within the depth limit, and its output is valid JSON with the
// same meaning, and its own canonical form.
func FuzzCanonicalJSON(f *testing.F) {
	for _, s := range []string{`{"b":[1,{"d":null,"c":"x"}],"a":1.50}`, `[]`, `"\u00e9"`, `{"a":1,"a":2}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		out, err := idemhttp.CanonicalJSON(data, testDepth)
		if err != nil {
			if json.Valid(data) && !errors.Is(err, idemhttp.ErrJSONTooDeep) {
				t.Fatalf("valid JSON %q refused: %v", data, err)
			}
			return
		}
		if !json.Valid(out) {
			t.Fatalf("%q: canonical form %q is not JSON", data, out)
		}
		again, err := idemhttp.CanonicalJSON(out, testDepth)
		if err != nil || !bytes.Equal(again, out) {
			t.Fatalf("%q: canonical form %q is not stable: %q, %v", data, out, again, err)
		}
		if a, b := decode(t, data), decode(t, out); !reflect.DeepEqual(a, b) {
			t.Fatalf("%q: canonical form %q changed the meaning: %#v != %#v", data, out, a, b)
		}
	})
}

// FuzzCanonicalFast: canonicalJSON, with its fast path for the common
// subset, answers exactly what the json.Decoder path answers (the same
// bytes, or the same error), so that no fingerprint changes.
func FuzzCanonicalFast(f *testing.F) {
	for _, s := range []string{
		`{"b":[1,{"d":null,"c":"x"}],"a":1.50}`, `[]`, `{}`, `"\u00e9"`, `{"a":1,"a":2}`, `{"B":1,"a":2,"b":3,"A":4}`,
		`{"é":1,"E":2,"e":3,"ſ":4,"S":5,"s":6,"K":7,"k":8}`, ` { "x" : [ 1 , 2 ] , "w" : { } } `, `-0.5e+10`, `01`, `1.`,
		`-`, `1e`, `[1,]`, `{"a":1,}`, `{"a"}`, `[1 2]`, `truex`, `nul`, `"a\"b"`, "\"\x01\"", "\"\xff\"", `[[[[[[[[[[1]]]]]]]]]]`,
		`{"amount":{"value":"1999","currency":"EUR"},"items":[{"sku":"SKU-1234","qty":2}]}`, `1 2`, ``, ` `, `{"a":1}}`,
		`{"z":{"y":2,"x":1},"m":[{"b":1,"a":2}]}`, "\"\u2028\"", "\"\xe2\x80\xa8\"", "\"\xed\xa0\x80\"",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		fast, ferr := idemhttp.CanonicalJSON(data, testDepth)
		slow, serr := idemhttp.CanonicalDecoded(data, testDepth)
		if !bytes.Equal(fast, slow) || errors.Is(ferr, idemhttp.ErrJSONTooDeep) != errors.Is(serr, idemhttp.ErrJSONTooDeep) || (ferr == nil) != (serr == nil) {
			t.Fatalf("%q: canonicalJSON %q, %v; the decoder's path %q, %v", data, fast, ferr, slow, serr)
		}
	})
}

// decode reads a JSON text the way a handler would, keeping number literals.
func decode(t *testing.T, data []byte) any {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("decode %q: %v", data, err)
	}
	return v
}
