package postgres

// Statements whose query plans postgres_test checks with EXPLAIN.
const (
	ListStaleLeasesSQL = listStaleLeases
	DeleteExpiredSQL   = deleteExpired
)
