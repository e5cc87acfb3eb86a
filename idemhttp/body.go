package idemhttp

import (
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strings"

	"github.com/idemstore/idem"
)

// fingerprintVersion starts every fingerprint, so that a future change of
// what is hashed can never make an old record match a new request by chance.
const fingerprintVersion = "idemhttp/1"

// requestBody is the request body as the middleware read it.
type requestBody struct {
	// data is the body the handler gets: gzip decoded, otherwise as sent.
	data []byte
	// decoded is true when data was gzip-decoded.
	decoded bool
	// mediaType is the Content-Type's media type, lower case and without
	// parameters (or the header as sent if it does not parse).
	mediaType string
	// canonical is what the fingerprint covers of the body.
	canonical []byte
}

// readBody reads r's body, at most limit bytes as sent and as decoded,
// decodes Content-Encoding gzip, and canonicalises JSON. A failure is the
// *Error to answer.
func readBody(w http.ResponseWriter, r *http.Request, limit int64, maxDepth int) (*requestBody, *Error) {
	raw, e := readLimited(w, r, limit)
	if e != nil {
		return nil, e
	}
	b := &requestBody{data: raw, mediaType: mediaType(r.Header.Get("Content-Type"))}
	switch encodingOf(r.Header.Values("Content-Encoding")) {
	case "gzip":
		if len(raw) == 0 {
			break // an empty body is empty however it claims to be encoded
		}
		if b.data, e = gunzip(raw, limit); e != nil {
			return nil, e
		}
		b.decoded = true
	case "":
	default:
		// An encoding the middleware does not decode: the fingerprint
		// covers the bytes as sent, and the handler gets them unchanged.
		b.canonical = b.data
		return b, nil
	}
	b.canonical = b.data
	// Only JSON's own whitespace makes an empty body: bytes.TrimSpace would
	// also drop Unicode spaces (U+00A0, U+0085), letting a body that is not
	// JSON through to the handler unchecked.
	if isJSON(b.mediaType) && len(bytes.Trim(b.data, jsonSpace)) > 0 {
		c, err := canonicalJSON(b.data, maxDepth)
		switch {
		case errors.Is(err, errJSONTooDeep):
			return nil, &Error{Status: http.StatusBadRequest, Code: CodeBodyInvalid, Message: "The JSON body nests too deeply."}
		case err != nil:
			return nil, &Error{Status: http.StatusBadRequest, Code: CodeBodyInvalid, Message: "The body is not valid JSON."}
		}
		b.canonical = c
	}
	return b, nil
}

// jsonSpace is the whitespace JSON allows around values (RFC 8259 section 2).
const jsonSpace = " \t\r\n"

func tooLarge() *Error {
	return &Error{Status: http.StatusRequestEntityTooLarge, Code: CodeBodyTooLarge, Message: "The request body is too large."}
}

// readLimited reads the whole body, refusing more than limit bytes. Beyond
// the limit, http.MaxBytesReader also tells the server to close the
// connection instead of reading the rest.
func readLimited(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, *Error) {
	if r.Body == nil || r.Body == http.NoBody {
		return []byte{}, nil
	}
	if r.ContentLength > limit {
		return nil, tooLarge()
	}
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	var maxErr *http.MaxBytesError
	switch {
	case errors.As(err, &maxErr):
		return nil, tooLarge()
	case err != nil:
		return nil, &Error{Status: http.StatusBadRequest, Code: CodeBodyInvalid, Message: "The request body could not be read."}
	}
	return data, nil
}

// gunzip decodes a gzip body, refusing a decoded size beyond limit: a small
// compressed body may expand enormously.
func gunzip(data []byte, limit int64) ([]byte, *Error) {
	invalid := &Error{Status: http.StatusBadRequest, Code: CodeBodyInvalid, Message: "The gzip body could not be decoded."}
	zr, err := gzip.NewReader(bytes.NewReader(data))
	if err != nil {
		return nil, invalid
	}
	out, err := io.ReadAll(io.LimitReader(zr, limit+1))
	if err != nil {
		return nil, invalid
	}
	if int64(len(out)) > limit {
		return nil, tooLarge()
	}
	return out, nil
}

// encodingOf returns "" for a body sent without a content coding (or with
// identity only), "gzip" for one gzip layer (or its alias x-gzip), and
// "other" for anything else: another coding, or several.
func encodingOf(values []string) string {
	var codings []string
	for _, v := range values {
		for c := range strings.SplitSeq(v, ",") {
			if c = strings.ToLower(strings.TrimSpace(c)); c != "" && c != "identity" {
				codings = append(codings, c)
			}
		}
	}
	switch {
	case len(codings) == 0:
		return ""
	case len(codings) == 1 && (codings[0] == "gzip" || codings[0] == "x-gzip"):
		return "gzip"
	default:
		return "other"
	}
}

// mediaType returns the media type of a Content-Type, lower case and
// without parameters, or contentType itself if it does not parse.
func mediaType(contentType string) string {
	if contentType == "application/json" {
		// What ParseMediaType returns for it, without its allocations: the
		// usual Content-Type of a request the middleware fingerprints.
		return contentType
	}
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return contentType
	}
	return mt
}

// isJSON reports whether mt is application/json or a +json type.
func isJSON(mt string) bool {
	return mt == "application/json" || strings.HasSuffix(mt, "+json")
}

// fingerprint hashes what identifies the request: the method, the route
// pattern, the request target (escaped path and the query with its
// parameters sorted by name), the tenant, the body's media type and its
// canonical form (or what Config.Fingerprint chose from it). The parts are
// length-prefixed by idem.NewFingerprint, so they cannot run into each other.
func fingerprint(method, route, tenant string, u *url.URL, mediaType string, body []byte) idem.Fingerprint {
	return idem.NewFingerprint(
		[]byte(fingerprintVersion),
		[]byte(method),
		[]byte(route),
		[]byte(u.EscapedPath()),
		[]byte(canonicalQuery(u.RawQuery)),
		[]byte(tenant),
		[]byte(mediaType),
		body,
	)
}

// canonicalQuery sorts the query's parameters by name, keeping the order of
// repeated names; a query that does not parse is kept as sent.
func canonicalQuery(raw string) string {
	if raw == "" {
		return ""
	}
	q, err := url.ParseQuery(raw)
	if err != nil {
		return raw
	}
	return q.Encode()
}
