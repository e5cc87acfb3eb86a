package postgres

// Statements whose query plans postgres_test checks with EXPLAIN.
const (
	ListStaleLeasesSQL = listStaleLeases
	DeleteExpiredSQL   = deleteExpired
)

// InSchema is Migrate's rewrite of the migrations for WithSchema, for the
// test that migrates down.
var InSchema = inSchema

// InterpretError is the dialect's error classification.
var InterpretError = interpretError
