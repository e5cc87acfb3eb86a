#!/usr/bin/env bash
# Proves that the goose command line applies and reverts idem's shipped migration files
# (migrations/<dialect>/*.sql) on PostgreSQL, MariaDB and SQLite, with the commands that
# docs/migrations.md gives. .ci/run calls it once the servers are up; `make goose-cli` runs it
# alone against the local servers (PostgreSQL and MariaDB on 127.0.0.1, trust/empty-password).
#
# Each dialect gets a throwaway namespace called idem_goose_cli, dropped before and after: a
# schema in PostgreSQL's `test` database (reached through search_path, as an application would
# place idem), a MariaDB database, and an SQLite file in a mktemp directory.
#
# goose is built from the Go module proxy at the version in go.mod, without touching go.mod.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NS=idem_goose_cli
TABLE=idempotency_keys
BODY_TABLE=idempotency_bodies # migration 00004, the table body stores
VERSION_TABLE=idem_goose_db_version # migrations.VersionTable

# cmd/goose compiles in every driver it knows unless told otherwise; these tags (from the
# //go:build lines of cmd/goose/driver_*.go in goose v3.30.0) leave out the ones idem does not
# use. What stays: postgres (pgx/v5 stdlib), mysql (go-sql-driver) and sqlite3 (modernc, no cgo).
GOOSE_TAGS='no_clickhouse no_mssql no_vertica no_ydb no_libsql'
GOOSE_VERSION=$(go list -m -f '{{.Version}}' github.com/pressly/goose/v3)

PSQL=(env PGOPTIONS='-c client_min_messages=warning' psql -X -w -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p 5432 -U postgres -d test)
MARIADB_BIN=$(command -v mariadb || command -v mysql) || { echo "goose-cli: FAIL: neither mariadb nor mysql client found" >&2; exit 1; }
MARIADB=("$MARIADB_BIN" --batch --skip-column-names -h 127.0.0.1 -P 3306 -uroot)

PG_DSN="postgres://postgres@127.0.0.1:5432/test?sslmode=disable&search_path=$NS"
MY_DSN="root@tcp(127.0.0.1:3306)/$NS?parseTime=true"

# A GOOSE_DRIVER/GOOSE_DBSTRING/GOOSE_TABLE... left in the environment would change what the
# commands below mean.
unset GOOSE_DRIVER GOOSE_DBSTRING GOOSE_MIGRATION_DIR GOOSE_TABLE

tmp=$(mktemp -d)
SQLITE_DB="$tmp/idem.db"

drop_namespaces() {
	"${PSQL[@]}" -c "DROP SCHEMA IF EXISTS $NS CASCADE"
	"${MARIADB[@]}" -e "DROP DATABASE IF EXISTS $NS"
	rm -f "$SQLITE_DB"
}
cleanup() {
	drop_namespaces || true
	rm -rf "$tmp"
}
trap cleanup EXIT

fail() {
	echo "goose-cli: FAIL: $*" >&2
	exit 1
}

# table_count DIALECT NAME prints 1 if table NAME exists in DIALECT's idem_goose_cli namespace.
table_count() {
	case $1 in
	postgres) "${PSQL[@]}" -tAc "SELECT count(*) FROM pg_tables WHERE schemaname = '$NS' AND tablename = '$2'" ;;
	mysql) "${MARIADB[@]}" -e "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = '$NS' AND TABLE_NAME = '$2'" ;;
	sqlite3)
		local q="SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '$2'"
		if command -v sqlite3 >/dev/null; then
			sqlite3 "$SQLITE_DB" "$q"
		else
			python3 -c 'import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchone()[0])' "$SQLITE_DB" "$q"
		fi
		;;
	esac
}

expect_table() { # DIALECT NAME WANT(0|1) WHEN
	local got
	got=$(table_count "$1" "$2")
	[ "$got" = "$3" ] || fail "$1: after $4, table $2 exists=$got, want $3"
}

start=$SECONDS
echo "goose-cli: building goose $GOOSE_VERSION (tags: $GOOSE_TAGS)"
GOBIN="$tmp/bin" go install -tags "$GOOSE_TAGS" "github.com/pressly/goose/v3/cmd/goose@$GOOSE_VERSION"
goose="$tmp/bin/goose"
"$goose" -version
echo "goose-cli: built in $((SECONDS - start))s"

drop_namespaces
"${PSQL[@]}" -c "CREATE SCHEMA $NS"
"${MARIADB[@]}" -e "CREATE DATABASE $NS"

# dialect (goose driver name), migration directory, DSN
for spec in "postgres|migrations/postgres|$PG_DSN" "mysql|migrations/mysql|$MY_DSN" "sqlite3|migrations/sqlite|$SQLITE_DB"; do
	IFS='|' read -r driver dir dsn <<<"$spec"
	echo "goose-cli: $driver: up, up again (no-op), status, down, down-to 0"
	# The commands docs/migrations.md documents, word for word but for the DSN. goose logs to
	# stderr; 2>&1 keeps its lines in order with ours.
	"$goose" -dir "$dir" -table "$VERSION_TABLE" "$driver" "$dsn" up 2>&1
	expect_table "$driver" "$TABLE" 1 up
	expect_table "$driver" "$BODY_TABLE" 1 up
	expect_table "$driver" "$VERSION_TABLE" 1 up
	expect_table "$driver" goose_db_version 0 "up (-table must replace goose's default table)"
	"$goose" -dir "$dir" -table "$VERSION_TABLE" "$driver" "$dsn" up 2>&1
	"$goose" -dir "$dir" -table "$VERSION_TABLE" "$driver" "$dsn" status 2>&1
	"$goose" -dir "$dir" -table "$VERSION_TABLE" "$driver" "$dsn" down 2>&1
	expect_table "$driver" "$TABLE" 1 "down (one version: the body table, 00004)"
	expect_table "$driver" "$BODY_TABLE" 0 "down (one version: the body table, 00004)"
	"$goose" -dir "$dir" -table "$VERSION_TABLE" "$driver" "$dsn" down-to 0 2>&1
	expect_table "$driver" "$TABLE" 0 "down-to 0"
done

echo "goose-cli: OK: goose $GOOSE_VERSION migrated up and down on postgres, mysql and sqlite3 in $((SECONDS - start))s"
