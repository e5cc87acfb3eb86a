// Package codec converts the parts of an idem record that every dialect
// stores the same way: response headers as JSON and times as UTC.
package codec

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"unicode/utf8"
)

// EncodeHeader returns h as JSON, or nil for an empty header so that no
// bytes are stored for responses without headers.
//
// The output is byte for byte what encoding/json.Marshal gives for h (keys
// sorted, HTML characters and U+2028/U+2029 escaped, invalid UTF-8 replaced
// by U+FFFD), built by hand because this runs on every completion and
// json.Marshal of a map costs several allocations; this costs one for a
// header of up to eight names.
func EncodeHeader(h http.Header) ([]byte, error) {
	if len(h) == 0 {
		return nil, nil
	}
	var buf [8]string
	keys := buf[:0]
	size := 2
	for k, vs := range h {
		keys = append(keys, k)
		size += len(k) + 4
		for _, v := range vs {
			size += len(v) + 3
		}
		size += 6 // brackets, or null
	}
	slices.Sort(keys)
	b := make([]byte, 0, size+size/8)
	b = append(b, '{')
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendString(b, k)
		b = append(b, ':')
		vs := h[k]
		if vs == nil {
			b = append(b, "null"...)
			continue
		}
		b = append(b, '[')
		for j, v := range vs {
			if j > 0 {
				b = append(b, ',')
			}
			b = appendString(b, v)
		}
		b = append(b, ']')
	}
	return append(b, '}'), nil
}

const hexDigits = "0123456789abcdef"

// appendString appends s as a JSON string, escaped as encoding/json does
// with HTML escaping on.
func appendString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			default: // other control characters and <, >, &
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// DecodeHeader is the inverse of EncodeHeader; nil or empty input gives a nil header.
//
// Headers as EncodeHeader writes them, without escapes, are parsed by hand
// (every replay decodes one, and json.Unmarshal into a map costs a dozen
// allocations); anything else goes through encoding/json.
func DecodeHeader(b []byte) (http.Header, error) {
	if len(b) == 0 {
		return nil, nil
	}
	if h, ok := decodeSimple(b); ok {
		return h, nil
	}
	var h http.Header
	if err := json.Unmarshal(b, &h); err != nil {
		return nil, fmt.Errorf("idem: decode stored response header: %w", err)
	}
	return h, nil
}

// decodeSimple parses {"K":["v",...],...} with no whitespace, no escapes and
// no null, as EncodeHeader writes it for ordinary headers. ok is false for
// anything else, which the caller hands to encoding/json.
//
// Every replay decodes a header: the names and values are substrings of one
// copy of b, and the value lists share one array (each capped at its
// length, so an append to one list does not overwrite the next), a few
// allocations instead of two per name.
func decodeSimple(b []byte) (_ http.Header, ok bool) {
	if len(b) < 2 || b[0] != '{' || b[len(b)-1] != '}' {
		return nil, false
	}
	h := make(http.Header, 2)
	i := 1
	if b[i] == '}' {
		return h, i == len(b)-1
	}
	text := string(b)
	// At most one string per two quotes: the names and the values.
	all := make([]string, 0, bytes.Count(b, []byte{'"'})/2)
	for {
		ks, ke, next, ok := simpleString(b, i)
		if !ok || next >= len(b) || b[next] != ':' {
			return nil, false
		}
		k := text[ks:ke]
		i = next + 1
		if i >= len(b) || b[i] != '[' {
			return nil, false
		}
		i++
		first := len(all)
		if i < len(b) && b[i] == ']' {
			i++
		} else {
			for {
				vs, ve, next, ok := simpleString(b, i)
				if !ok || next >= len(b) {
					return nil, false
				}
				all = append(all, text[vs:ve])
				i = next + 1
				if b[next] == ']' {
					break
				}
				if b[next] != ',' {
					return nil, false
				}
			}
		}
		if _, dup := h[k]; dup {
			return nil, false // json.Unmarshal's rule for duplicates applies
		}
		h[k] = all[first:len(all):len(all)]
		if i >= len(b) {
			return nil, false
		}
		switch b[i] {
		case ',':
			i++
		case '}':
			return h, i == len(b)-1
		default:
			return nil, false
		}
	}
}

// simpleString reads a JSON string at b[i] that has no escape and only
// valid UTF-8 without control characters, returning the bounds of its
// contents and the index after its closing quote.
func simpleString(b []byte, i int) (start, end, next int, ok bool) {
	if i >= len(b) || b[i] != '"' {
		return 0, 0, 0, false
	}
	start = i + 1
	for j := start; j < len(b); j++ {
		switch c := b[j]; {
		case c == '"':
			if !utf8.Valid(b[start:j]) {
				return 0, 0, 0, false
			}
			return start, j, j + 1, true
		case c == '\\' || c < 0x20:
			return 0, 0, 0, false
		}
	}
	return 0, 0, 0, false
}
