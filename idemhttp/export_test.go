package idemhttp

// Exported for the tests of package idemhttp_test.
var (
	ParseKey         = parseKey
	CanonicalJSON    = canonicalJSON
	CanonicalDecoded = canonicalDecoded
	ErrJSONTooDeep   = errJSONTooDeep
	DefaultKeyFormat = defaultKeyFormat
)
