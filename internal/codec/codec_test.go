package codec

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestEncodeHeaderMatchesJSONMarshal(t *testing.T) {
	t.Parallel()
	for _, h := range []http.Header{
		{"Content-Type": {"application/json"}},
		{"B": {"1", "2"}, "A": {}, "C": nil, "Z": {""}},
		{"X-Odd": {"quote\" back\\ <tag> & \n\r\t\x00\x1f \u2028\u2029 é 日本 \xff\xfe end"}},
		{"K1": {"a"}, "K2": {"b"}, "K3": {"c"}, "K4": {"d"}, "K5": {"e"}, "K6": {"f"}, "K7": {"g"}, "K8": {"h"}, "K9": {"i"}, "K10": {"j"}},
	} {
		want, err := json.Marshal(h)
		require.NoError(t, err)
		got, err := EncodeHeader(h)
		require.NoError(t, err)
		require.Equal(t, string(want), string(got))
		back, err := DecodeHeader(got)
		require.NoError(t, err)
		wantBack, err := DecodeHeader(want)
		require.NoError(t, err)
		require.Equal(t, wantBack, back)
	}
	got, err := EncodeHeader(nil)
	require.NoError(t, err)
	require.Nil(t, got)
}

func FuzzDecodeHeader(f *testing.F) {
	f.Add([]byte(`{"Content-Type":["application/json"]}`))
	f.Add([]byte(`{"A":[],"B":["1","2"],"C":null}`))
	f.Add([]byte(`{"A":["x"],"A":["y"]}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) == 0 {
			return
		}
		var want http.Header
		wantErr := json.Unmarshal(b, &want)
		got, err := DecodeHeader(b)
		if wantErr != nil {
			if err == nil {
				t.Fatalf("DecodeHeader(%q) accepted what json.Unmarshal rejects: %v", b, wantErr)
			}
			return
		}
		if err != nil {
			t.Fatalf("DecodeHeader(%q): %v", b, err)
		}
		require.Equal(t, want, got)
	})
}

func FuzzEncodeHeader(f *testing.F) {
	f.Add("Content-Type", "application/json", "x")
	f.Add("a\"b", "<\xff>", "\u2028")
	f.Fuzz(func(t *testing.T, k, v1, v2 string) {
		h := http.Header{k: {v1, v2}, "Other": {v2}}
		want, err := json.Marshal(h)
		if err != nil {
			t.Skip()
		}
		got, err := EncodeHeader(h)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != string(want) {
			t.Fatalf("EncodeHeader = %q, json.Marshal = %q", got, want)
		}
	})
}

func BenchmarkDecodeHeader(b *testing.B) {
	enc := []byte(`{"Content-Type":["application/json"]}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeHeader(enc); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkEncodeHeader(b *testing.B) {
	h := http.Header{"Content-Type": {"application/json"}}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := EncodeHeader(h); err != nil {
			b.Fatal(err)
		}
	}
}
