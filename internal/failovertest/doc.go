// Package failovertest holds the PostgreSQL failover scenario of
// docs/reliability.md ("Failover"): the orders service (examples/orders) on
// a primary with a synchronous standby, reached through a multi-host DSN
// with target_session_attrs=read-write; under load the primary is killed
// with SIGKILL and the standby promoted, and the test checks that no
// acknowledged order was lost and no intent ran twice.
//
// The test has the build tag "failover" and needs the two clusters that
// .ci/pgfailover.sh creates (it exports their addresses); run it with
//
//	make failover
//
// The package has no code of its own: this file keeps `go build ./...` and
// `go vet ./...` from seeing a directory whose every file is excluded.
package failovertest
