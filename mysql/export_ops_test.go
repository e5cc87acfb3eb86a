package mysql

// The operators' digest look-up, for the test that checks its plan.
const OpsFindDigest = opsFindDigest
