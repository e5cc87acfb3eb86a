package idemhttp

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"slices"
	"strings"
	"unicode/utf8"
)

// errJSONTooDeep and errJSONInvalid reject a body that canonicalJSON cannot
// take: both answer 400 CodeBodyInvalid.
var (
	errJSONTooDeep = errors.New("idemhttp: JSON nests deeper than the limit")
	errJSONInvalid = errors.New("idemhttp: invalid JSON")
)

// canonicalJSON returns the canonical form of the JSON text data, so that
// two texts that differ only in ways JSON says carry no meaning get the same
// fingerprint:
//
//   - insignificant whitespace is removed;
//   - object members are sorted by their decoded name, byte by byte; members
//     with the same name keep their order (a decoder keeps the last one, so
//     reordering them would change the meaning);
//   - strings are decoded and re-encoded one way: only ", \ and control
//     characters are escaped, everything else is written as UTF-8 (so "\u0061"
//     and "a" are the same string; invalid UTF-8 and lone surrogates become
//     U+FFFD, as encoding/json decodes them);
//   - numbers keep their literal exactly as sent (json.Decoder.UseNumber),
//     never passing through float64: 12345678901234567890 and
//     12345678901234567891 stay different, and so do 1 and 1.0.
//
// Objects and arrays nested more than maxDepth levels are refused with
// errJSONTooDeep before they are read further, and anything that is not
// exactly one JSON value with errJSONInvalid. The work is linear in the size
// of data, times maxDepth at most (each level's members are copied once
// into the level above).
func canonicalJSON(data []byte, maxDepth int) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	c := canonicalizer{dec: dec, maxDepth: maxDepth}
	out, err := c.value(make([]byte, 0, len(data)), 0)
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errJSONInvalid // trailing data after the value
	}
	return out, nil
}

type canonicalizer struct {
	dec      *json.Decoder
	maxDepth int
}

// value appends the canonical form of the next value to out. depth counts
// the arrays and objects around it.
func (c *canonicalizer) value(out []byte, depth int) ([]byte, error) {
	tok, err := c.dec.Token()
	if err != nil {
		return nil, errJSONInvalid
	}
	switch v := tok.(type) {
	case json.Delim:
		if v != '[' && v != '{' {
			return nil, errJSONInvalid
		}
		if depth >= c.maxDepth {
			return nil, errJSONTooDeep
		}
		if v == '[' {
			return c.array(out, depth+1)
		}
		return c.object(out, depth+1)
	case string:
		return appendString(out, v), nil
	case json.Number:
		return append(out, v...), nil
	case bool:
		if v {
			return append(out, "true"...), nil
		}
		return append(out, "false"...), nil
	case nil:
		return append(out, "null"...), nil
	default:
		return nil, errJSONInvalid
	}
}

func (c *canonicalizer) array(out []byte, depth int) ([]byte, error) {
	out = append(out, '[')
	for i := 0; c.dec.More(); i++ {
		if i > 0 {
			out = append(out, ',')
		}
		var err error
		if out, err = c.value(out, depth); err != nil {
			return nil, err
		}
	}
	if tok, err := c.dec.Token(); err != nil || tok != json.Delim(']') {
		return nil, errJSONInvalid
	}
	return append(out, ']'), nil
}

// member is one canonical "name":value of an object, in the object's buffer.
type member struct {
	// fold is the name under case folding: members are sorted by it, and
	// members whose names fold alike keep their document order, because Go's
	// encoding/json matches field names ignoring case and keeps the last
	// match, so their order changes what a handler reads.
	fold       string
	start, end int
}

func (c *canonicalizer) object(out []byte, depth int) ([]byte, error) {
	var (
		buf     []byte
		members []member
	)
	for c.dec.More() {
		tok, err := c.dec.Token()
		if err != nil {
			return nil, errJSONInvalid
		}
		name, ok := tok.(string)
		if !ok {
			return nil, errJSONInvalid
		}
		start := len(buf)
		buf = append(appendString(buf, name), ':')
		if buf, err = c.value(buf, depth); err != nil {
			return nil, err
		}
		members = append(members, member{fold: strings.ToLower(strings.ToUpper(name)), start: start, end: len(buf)})
	}
	if tok, err := c.dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, errJSONInvalid
	}
	slices.SortStableFunc(members, func(a, b member) int { return strings.Compare(a.fold, b.fold) })
	out = append(out, '{')
	for i, m := range members {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, buf[m.start:m.end]...)
	}
	return append(out, '}'), nil
}

// appendString appends s as a JSON string: ", \ and control characters
// below U+0020 escaped (with the short escapes where JSON has them), every
// other character as UTF-8. Invalid UTF-8 is written as U+FFFD.
func appendString(out []byte, s string) []byte {
	const hex = "0123456789abcdef"
	out = append(out, '"')
	for _, r := range s {
		switch {
		case r == '"':
			out = append(out, '\\', '"')
		case r == '\\':
			out = append(out, '\\', '\\')
		case r == '\n':
			out = append(out, '\\', 'n')
		case r == '\r':
			out = append(out, '\\', 'r')
		case r == '\t':
			out = append(out, '\\', 't')
		case r == '\b':
			out = append(out, '\\', 'b')
		case r == '\f':
			out = append(out, '\\', 'f')
		case r < 0x20:
			out = append(out, '\\', 'u', '0', '0', hex[r>>4], hex[r&0xf])
		default:
			out = utf8.AppendRune(out, r)
		}
	}
	return append(out, '"')
}
