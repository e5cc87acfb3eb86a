package mysql

import "database/sql"

// NewSessionVariablePath returns a Dialect that bounds the claim's lock wait
// the way it does on MySQL 8 (session variable set and restored around the
// claim) whatever the server, so that path runs against MariaDB too, which
// accepts its statements.
func NewSessionVariablePath(db *sql.DB, opts ...Option) *Dialect {
	d := New(db, opts...)
	d.server.Store(&serverInfo{mariaDB: false})
	return d
}

// DriverConn is every interface of the driver's connection that
// database/sql uses, for the tests' wrapping connectors.
type DriverConn = driverConn

// Statements whose plans the tests EXPLAIN.
const (
	ListStaleLeasesQuery = listStaleLeases
	DeleteExpiredQuery   = deleteExpired
)
