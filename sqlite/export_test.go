package sqlite

// The reaper's statements, for the tests that check their query plans.
const (
	StaleLeasesSelect = staleLeasesSelect
	ExpiredDelete     = expiredDelete
)
