package postgres

// The operators' digest look-up, for the test that checks its plan.
func OpsFindDigestSQL(d *Dialect) string { return d.opsSt().findDigest }
