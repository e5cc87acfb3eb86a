// Package codec converts the parts of an idem record that every dialect
// stores the same way: response headers as JSON and times as UTC.
package codec

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// EncodeHeader returns h as JSON, or nil for an empty header so that no
// bytes are stored for responses without headers.
func EncodeHeader(h http.Header) ([]byte, error) {
	if len(h) == 0 {
		return nil, nil
	}
	b, err := json.Marshal(h)
	if err != nil {
		return nil, fmt.Errorf("idem: encode response header: %w", err)
	}
	return b, nil
}

// DecodeHeader is the inverse of EncodeHeader; nil or empty input gives a nil header.
func DecodeHeader(b []byte) (http.Header, error) {
	if len(b) == 0 {
		return nil, nil
	}
	var h http.Header
	if err := json.Unmarshal(b, &h); err != nil {
		return nil, fmt.Errorf("idem: decode stored response header: %w", err)
	}
	return h, nil
}
