package sqlite

// The reaper's statements, for the tests that check their query plans.
const (
	StaleLeasesSelect = staleLeasesSelect
	ExpiredDelete     = expiredDelete
)

// Prepared reports whether d's transaction statements are all prepared.
func Prepared(d *Dialect) bool {
	for _, p := range d.stmts.all() {
		if p.st.Load() == nil {
			return false
		}
	}
	return true
}
