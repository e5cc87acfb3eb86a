#!/usr/bin/env bash
# PostgreSQL failover scenario (docs/reliability.md "Failover", docs/scaling.md).
#
#   bash .ci/pgfailover.sh              # build two clusters, run the scenario, stop everything
#   bash .ci/pgfailover.sh CMD ARGS...  # build the clusters and run CMD instead (e.g. bash, psql)
#
# Creates, in a temporary directory of its own, two throwaway PostgreSQL 15 clusters with initdb:
# a primary on 127.0.0.1:15432 and a standby on 127.0.0.1:15433 made with pg_basebackup -R. The
# primary names the standby in synchronous_standby_names (synchronous_commit stays at its
# default, on), so a COMMIT is acknowledged only once the standby has flushed its WAL. It waits
# until the standby streams as the synchronous one, exports the addresses (IDEM_FAILOVER_*), and
# runs the scenario: go test -tags failover ./internal/failovertest/, which SIGKILLs the primary
# under load and promotes the standby. Everything it started is stopped on exit, whatever
# happened. The machine's own cluster (5432) is never touched.
#
# FAILOVER_RUNS=N repeats the whole thing (fresh clusters each time); IDEM_FAILOVER_SCALE=full
# is passed through to the test (longer load, more clients). Run as root (CI), the clusters
# belong to the postgres user: initdb and pg_ctl refuse to run as root.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PGBIN=${PGBIN:-/usr/lib/postgresql/15/bin}
PRIMARY_PORT=15432
STANDBY_PORT=15433
STANDBY_NAME=idem_failover_standby
DBNAME=failover
RUNS=${FAILOVER_RUNS:-1}
WAIT_SECONDS=60
TEST_CMD=(go test -tags failover -race -count=1 -timeout 10m -v ./internal/failovertest/)

fail() {
	echo "pgfailover: FAIL: $*" >&2
	exit 1
}

if [ ! -x "$PGBIN/initdb" ]; then
	command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] || fail "$PGBIN/initdb is missing (install postgresql-15)"
	echo "pgfailover: installing postgresql-15"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql-15 >/dev/null
	[ -x "$PGBIN/initdb" ] || fail "$PGBIN/initdb is still missing after apt-get install postgresql-15"
fi

as_pg=()
if [ "$(id -u)" = 0 ]; then
	as_pg=(runuser -u postgres --)
fi
pg() { "${as_pg[@]}" "$PGBIN/$1" "${@:2}"; }

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

dir=
cleanup() {
	local rc=$?
	if [ -n "$dir" ]; then
		for d in "$dir/primary" "$dir/standby"; do
			# Immediate: nothing in these clusters is worth a checkpoint. A primary the
			# scenario killed has left a stale postmaster.pid, which pg_ctl notices.
			[ -f "$d/postmaster.pid" ] && pg pg_ctl stop -D "$d" -m immediate -w -t 30 >/dev/null 2>&1 || true
		done
		if [ "$rc" != 0 ]; then
			for l in "$dir"/*.log; do
				[ -f "$l" ] || continue
				echo "---- last 40 lines of $(basename "$l") ----"
				tail -n 40 "$l"
			done
		fi
		rm -rf "$dir"
	fi
	dir=
	return "$rc"
}
trap cleanup EXIT

wait_until() { # WHAT PROBE...
	local what=$1 deadline=$((SECONDS + WAIT_SECONDS))
	shift
	until "$@"; do
		[ "$SECONDS" -lt "$deadline" ] || fail "$what: not ready after ${WAIT_SECONDS}s"
		sleep 0.5
	done
}

psql_at() { # PORT SQL
	"${as_pg[@]}" "$PGBIN/psql" -X -w -q -tA -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$1" -U postgres -d postgres -c "$2"
}

sync_standby_up() {
	[ "$(psql_at "$PRIMARY_PORT" "SELECT count(*) FROM pg_stat_replication WHERE application_name = '$STANDBY_NAME' AND state = 'streaming' AND sync_state = 'sync'" 2>/dev/null)" = 1 ]
}

setup() {
	port_free "$PRIMARY_PORT" || fail "127.0.0.1:$PRIMARY_PORT is in use (a leftover run? it is not this script's to stop)"
	port_free "$STANDBY_PORT" || fail "127.0.0.1:$STANDBY_PORT is in use (a leftover run? it is not this script's to stop)"
	dir=$(mktemp -d "${TMPDIR:-/tmp}/idem-pgfailover.XXXXXX")
	[ "$(id -u)" = 0 ] && chown postgres: "$dir"

	pg initdb -D "$dir/primary" -U postgres --auth=trust --no-sync -E UTF8 --locale=C.UTF-8 >"$dir/initdb.log"
	# Loopback only, sockets in our directory (not /var/run/postgresql), small. wal_level
	# replica, max_wal_senders and the replication line of pg_hba.conf (trust from
	# 127.0.0.1) are initdb's defaults.
	cat >>"$dir/primary/postgresql.conf" <<-EOF
		listen_addresses = '127.0.0.1'
		port = $PRIMARY_PORT
		unix_socket_directories = '$dir'
		max_connections = 60
		shared_buffers = 32MB
		wal_keep_size = 128MB
	EOF
	pg pg_ctl start -D "$dir/primary" -l "$dir/primary.log" -w -t "$WAIT_SECONDS" >/dev/null
	wait_until "primary" pg pg_isready -q -h 127.0.0.1 -p "$PRIMARY_PORT"
	psql_at "$PRIMARY_PORT" "CREATE DATABASE $DBNAME"

	# -R writes standby.signal and primary_conninfo; the copy carries the configuration as
	# it is now, without synchronous_standby_names, which a promoted standby must not have:
	# alone, it would wait forever for a standby of its own at every commit.
	pg pg_basebackup -D "$dir/standby" -h 127.0.0.1 -p "$PRIMARY_PORT" -U postgres -R -X stream -c fast --no-sync
	cat >>"$dir/standby/postgresql.conf" <<-EOF
		port = $STANDBY_PORT
		cluster_name = '$STANDBY_NAME'
	EOF
	# The walreceiver's application_name is cluster_name when primary_conninfo names none.
	pg pg_ctl start -D "$dir/standby" -l "$dir/standby.log" -w -t "$WAIT_SECONDS" >/dev/null
	wait_until "standby" pg pg_isready -q -h 127.0.0.1 -p "$STANDBY_PORT"

	cat >>"$dir/primary/postgresql.conf" <<-EOF
		synchronous_standby_names = '$STANDBY_NAME'
	EOF
	pg pg_ctl reload -D "$dir/primary" >/dev/null
	wait_until "synchronous standby" sync_standby_up
	[ "$(psql_at "$STANDBY_PORT" 'SELECT pg_is_in_recovery()')" = t ] || fail "the standby is not in recovery"

	primary_pid=$(head -n 1 "$dir/primary/postmaster.pid")
	export IDEM_FAILOVER_DSN="postgres://postgres@127.0.0.1:$PRIMARY_PORT,127.0.0.1:$STANDBY_PORT/$DBNAME?sslmode=disable&target_session_attrs=read-write&connect_timeout=5"
	export IDEM_FAILOVER_PRIMARY_URL="postgres://postgres@127.0.0.1:$PRIMARY_PORT/$DBNAME?sslmode=disable"
	export IDEM_FAILOVER_STANDBY_URL="postgres://postgres@127.0.0.1:$STANDBY_PORT/$DBNAME?sslmode=disable"
	export IDEM_FAILOVER_PRIMARY_PID="$primary_pid"
	echo "pgfailover: primary 127.0.0.1:$PRIMARY_PORT (postmaster $primary_pid), synchronous standby 127.0.0.1:$STANDBY_PORT, in $dir"
	echo "pgfailover: $(psql_at "$PRIMARY_PORT" "SELECT 'synchronous_standby_names=' || current_setting('synchronous_standby_names') || ' synchronous_commit=' || current_setting('synchronous_commit')")"
}

# The scenario's package is behind a build tag, which the plain go vet ./... of .ci/run skips.
[ $# -gt 0 ] || go vet -tags failover ./internal/failovertest/

for run in $(seq "$RUNS"); do
	[ "$RUNS" = 1 ] || echo "== pgfailover: run $run of $RUNS"
	setup
	if [ $# -gt 0 ]; then
		"$@"
	else
		"${TEST_CMD[@]}"
	fi
	cleanup
done
