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
//
// A text in the common subset (strings without escapes, control characters
// or invalid UTF-8; within the depth limit; valid) is canonicalised by
// canonicalFast; anything else, including every text refused, by the
// encoding/json path, which decides as it always has. Both give the same
// bytes for the subset (FuzzCanonicalFast), so fingerprints do not change.
func canonicalJSON(data []byte, maxDepth int) ([]byte, error) {
	if out, ok := canonicalFast(data, maxDepth); ok {
		return out, nil
	}
	return canonicalDecoded(data, maxDepth)
}

// canonicalDecoded is canonicalJSON through json.Decoder's tokens.
func canonicalDecoded(data []byte, maxDepth int) ([]byte, error) {
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

// fastCanon is the state of canonicalFast: a scanner over data that writes
// the canonical form as it reads, without json.Decoder's tokens (an
// allocation for each string, number and delimiter: most of a replay's
// allocations through the middleware).
type fastCanon struct {
	data     []byte
	i        int
	maxDepth int
	// members is a stack of the open objects' members; scratch is reused
	// by each object's reordering.
	members []fastMember
	scratch []byte
}

// fastMember is one member of an object being canonicalised: its bytes in
// the output and its name folded as member.fold.
type fastMember struct {
	fold       []byte
	start, end int
}

// canonicalFast is canonicalJSON for the common subset; ok is false for any
// text outside it, valid or not, which the caller hands to
// canonicalDecoded.
func canonicalFast(data []byte, maxDepth int) (_ []byte, ok bool) {
	var stack [16]fastMember
	c := fastCanon{data: data, maxDepth: maxDepth, members: stack[:0]}
	out, ok := c.value(make([]byte, 0, len(data)), 0)
	if !ok {
		return nil, false
	}
	c.skipSpace()
	if c.i != len(data) {
		return nil, false
	}
	return out, true
}

func (c *fastCanon) skipSpace() {
	for c.i < len(c.data) {
		switch c.data[c.i] {
		case ' ', '\t', '\n', '\r':
			c.i++
		default:
			return
		}
	}
}

func (c *fastCanon) value(out []byte, depth int) ([]byte, bool) {
	c.skipSpace()
	if c.i >= len(c.data) {
		return nil, false
	}
	switch b := c.data[c.i]; {
	case b == '{' || b == '[':
		if depth >= c.maxDepth {
			return nil, false
		}
		if b == '[' {
			return c.array(out, depth+1)
		}
		return c.object(out, depth+1)
	case b == '"':
		s, ok := c.str()
		if !ok {
			return nil, false
		}
		return append(out, s...), true
	case b == '-' || (b >= '0' && b <= '9'):
		return c.number(out)
	default:
		for _, lit := range [...]string{"true", "false", "null"} {
			if bytes.HasPrefix(c.data[c.i:], []byte(lit)) {
				c.i += len(lit)
				return append(out, lit...), true
			}
		}
		return nil, false
	}
}

// str reads a string at c.i without escapes or control characters, of
// valid UTF-8, and returns it with its quotes: its canonical form as it is.
func (c *fastCanon) str() ([]byte, bool) {
	start := c.i
	for j := start + 1; j < len(c.data); j++ {
		switch b := c.data[j]; {
		case b == '"':
			if !utf8.Valid(c.data[start+1 : j]) {
				return nil, false
			}
			c.i = j + 1
			return c.data[start:c.i], true
		case b == '\\' || b < 0x20:
			return nil, false
		}
	}
	return nil, false
}

// number copies a number literal of JSON's grammar as it is.
func (c *fastCanon) number(out []byte) ([]byte, bool) {
	d, start := c.data, c.i
	i := start
	digits := func() int {
		n := 0
		for i < len(d) && d[i] >= '0' && d[i] <= '9' {
			i++
			n++
		}
		return n
	}
	if d[i] == '-' {
		i++
	}
	switch {
	case i < len(d) && d[i] == '0':
		i++
	case digits() == 0:
		return nil, false
	}
	if i < len(d) && d[i] == '.' {
		i++
		if digits() == 0 {
			return nil, false
		}
	}
	if i < len(d) && (d[i] == 'e' || d[i] == 'E') {
		i++
		if i < len(d) && (d[i] == '+' || d[i] == '-') {
			i++
		}
		if digits() == 0 {
			return nil, false
		}
	}
	c.i = i
	return append(out, d[start:i]...), true
}

func (c *fastCanon) array(out []byte, depth int) ([]byte, bool) {
	c.i++
	out = append(out, '[')
	c.skipSpace()
	if c.i < len(c.data) && c.data[c.i] == ']' {
		c.i++
		return append(out, ']'), true
	}
	for {
		var ok bool
		if out, ok = c.value(out, depth); !ok {
			return nil, false
		}
		c.skipSpace()
		if c.i >= len(c.data) {
			return nil, false
		}
		switch c.data[c.i] {
		case ',':
			c.i++
			out = append(out, ',')
		case ']':
			c.i++
			return append(out, ']'), true
		default:
			return nil, false
		}
	}
}

func (c *fastCanon) object(out []byte, depth int) ([]byte, bool) {
	c.i++
	out = append(out, '{')
	c.skipSpace()
	if c.i < len(c.data) && c.data[c.i] == '}' {
		c.i++
		return append(out, '}'), true
	}
	base, region := len(c.members), len(out)
	defer func() { c.members = c.members[:base] }()
	for {
		c.skipSpace()
		if c.i >= len(c.data) || c.data[c.i] != '"' {
			return nil, false
		}
		name, ok := c.str()
		if !ok {
			return nil, false
		}
		c.skipSpace()
		if c.i >= len(c.data) || c.data[c.i] != ':' {
			return nil, false
		}
		c.i++
		start := len(out)
		out = append(append(out, name...), ':')
		if out, ok = c.value(out, depth); !ok {
			return nil, false
		}
		c.members = append(c.members, fastMember{fold: foldName(name[1 : len(name)-1]), start: start, end: len(out)})
		c.skipSpace()
		if c.i >= len(c.data) {
			return nil, false
		}
		if c.data[c.i] == '}' {
			c.i++
			break
		}
		if c.data[c.i] != ',' {
			return nil, false
		}
		c.i++
	}
	// The members were written one after the other, without commas:
	// write them again, sorted, with commas, from a copy.
	members := c.members[base:]
	slices.SortStableFunc(members, func(a, b fastMember) int { return bytes.Compare(a.fold, b.fold) })
	c.scratch = append(c.scratch[:0], out[region:]...)
	out = out[:region]
	for k, m := range members {
		if k > 0 {
			out = append(out, ',')
		}
		out = append(out, c.scratch[m.start-region:m.end-region]...)
	}
	return append(out, '}'), true
}

// foldName is member.fold of name, a string as str accepts it: without an
// allocation for a name of ASCII without capitals (for ASCII, upper then
// lower case is lower case).
func foldName(name []byte) []byte {
	ascii, lower := true, true
	for _, b := range name {
		if b >= utf8.RuneSelf {
			ascii = false
			break
		}
		if b >= 'A' && b <= 'Z' {
			lower = false
		}
	}
	switch {
	case !ascii:
		return []byte(strings.ToLower(strings.ToUpper(string(name))))
	case lower:
		return name
	}
	f := make([]byte, len(name))
	for i, b := range name {
		if b >= 'A' && b <= 'Z' {
			b += 'a' - 'A'
		}
		f[i] = b
	}
	return f
}
