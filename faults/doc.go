// Package faults holds idem's fault suite: tests that drive the order service
// (examples/orders) and the store through real processes and real database
// servers while processes are killed, servers go away, instances race and
// clients send garbage, and that count what came out: duplicates, lost
// acknowledged orders, answers by error code. On PostgreSQL and MariaDB a
// fault-injecting proxy that reads the wire protocol sits between the
// service and the server (wireproxy_test.go) and loses a COMMIT's
// acknowledgement, resets a connection mid-transaction, leaves one half-open
// or delays every connection past the wait timeout (wire_test.go). Every log
// line the services write is scanned for the raw keys, tenants, scopes and
// bodies the suite sent them (logscan_test.go).
//
// The tests carry the build tag "faults", so `go test ./...` does not run
// them. Run them with
//
//	make faults                                     # full scale, every dialect; figures for docs/reliability.md
//	go test -tags faults -race -count=1 -v ./faults/ # the bounded version .ci/run runs
//
// IDEM_FAULTS_SCALE=full selects the full scale (the default is the bounded CI
// scale) and IDEM_FAULTS_DIALECTS (a comma-separated subset of sqlite,
// postgres, mysql) the dialects. The server addresses come from
// IDEM_TEST_POSTGRES_URL and IDEM_TEST_MYSQL_DSN, as for the other tests, and
// pgx's exec mode from IDEM_TEST_POSTGRES_EXEC_MODES (testdb.PostgresExecModes).
//
// On PostgreSQL every namespace is a schema named in each statement
// (postgres.WithSchema, qualified business tables, the service's -schema
// flag), never a search_path, so the PostgreSQL scenarios also run through
// PgBouncer in transaction pooling mode: .ci/pgbouncer.sh runs them after the
// postgres tests (docs/reliability.md, "Through PgBouncer").
package faults
