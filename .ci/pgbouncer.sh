#!/usr/bin/env bash
# PgBouncer in transaction pooling mode in front of the machine's PostgreSQL, and the postgres
# dialect's tests through it (docs/scaling.md, "PgBouncer").
#
#   bash .ci/pgbouncer.sh            every test of ./postgres/... (the conformance suite and the
#                                    dialect's own tests), then the bounded fault suite's
#                                    PostgreSQL scenarios, through the pooler: the CI step, ~3 min
#   bash .ci/pgbouncer.sh run CMD... CMD with IDEM_TEST_POSTGRES_URL pointing at the pooler
#
# It installs Debian's pgbouncer with apt-get when it is missing, starts it on 127.0.0.1:16432
# (PGBOUNCER_PORT) as the postgres OS user (PgBouncer refuses to run as root), with its config,
# pid file and log in a temporary directory of its own, in front of PostgreSQL at 127.0.0.1:5432
# (trust authentication, database test), waits until it answers, and stops it and removes the
# directory on exit. It never touches the PostgreSQL server's configuration. PgBouncer that cannot
# be installed or started is a failure, never a skip.
#
# The tests run in the pgx exec modes that are safe through a transaction pooler
# (IDEM_TEST_POSTGRES_EXEC_MODES): the simple protocol and exec. Not describe_exec: it describes
# and executes the unnamed statement in two round trips, between which the pooler may move the
# client to another server connection (seen here: "bind message supplies 9 parameters, but
# prepared statement "" requires 0"); see postgres/doc.go. And with IDEM_TEST_POSTGRES_POOLER=transaction; the three tests that
# need what the pooler refuses are left out with -skip (NOT_THROUGH_POOLER); any skip fails the run.
#
# The fault suite (faults/, build tag faults, bounded scale) then runs its PostgreSQL scenarios
# through the pooler (IDEM_FAULTS_DIALECTS=postgres, FAULT_SCENARIOS): many instances, kill -9
# of the orders processes, the soak, and the wire faults. The scenarios open every pool in the
# first of the modes above (the simple protocol); the wire scenarios in the first other one (exec),
# because their proxy places faults between protocol messages and the simple protocol sends a
# whole batch as one. The wire proxy sits between the service and PgBouncer (service -> proxy ->
# PgBouncer -> PostgreSQL): the faults are those of the application's network, the side of a
# pooler that crosses one; PgBouncer must then clean up after a client that vanished in the
# middle of a transaction. Left to the direct run: TestOutage (it stops a private PostgreSQL of
# its own, not the shared one behind the pooler) and TestWireProxy (the proxy's own check, which
# asserts pgx's statement-cache messages).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PORT=${PGBOUNCER_PORT:-16432}
UPSTREAM_HOST=127.0.0.1
UPSTREAM_PORT=5432
WAIT_SECONDS=30
MODES=simple_protocol,exec
# The tests that need what a transaction pooler refuses (see their comments): left out with
# go test -skip, so that they are not run here rather than counted as skipped; the direct run of
# .ci/run covers them. Any skip in this run fails it.
NOT_THROUGH_POOLER='TestCancelRequestWatcher|TestDoUnderStricterDefaultIsolation|TestReadOnlyServer|TestClaimDeferredSkipsOutsideReadCommitted'
# The fault suite's scenarios run through the pooler (see above).
FAULT_SCENARIOS='TestInstances|TestKill|TestSoak|TestWire'

start=$SECONDS
fail() {
	echo "PGBOUNCER FAIL: $*" >&2
	exit 1
}

mode=${1:-ci}
[ $# -gt 0 ] && shift
case $mode in
ci) ;;
run) [ $# -gt 0 ] || fail "usage: $0 run CMD..." ;;
*) fail "unknown mode $mode (want ci or run CMD...)" ;;
esac

PGBOUNCER=$(command -v pgbouncer || true)
[ -n "$PGBOUNCER" ] || [ ! -x /usr/sbin/pgbouncer ] || PGBOUNCER=/usr/sbin/pgbouncer
if [ -z "$PGBOUNCER" ]; then
	echo "pgbouncer is not installed; installing Debian's package"
	command -v apt-get >/dev/null || fail "pgbouncer is missing and there is no apt-get to install it"
	export DEBIAN_FRONTEND=noninteractive
	apt-get install -y --no-install-recommends pgbouncer ||
		{ apt-get update && apt-get install -y --no-install-recommends pgbouncer; } ||
		fail "apt-get could not install pgbouncer"
	PGBOUNCER=/usr/sbin/pgbouncer
fi
[ -x "$PGBOUNCER" ] || fail "no pgbouncer executable at $PGBOUNCER"
"$PGBOUNCER" --version | head -n 1
id postgres >/dev/null 2>&1 || fail "the postgres OS user is needed to run pgbouncer (it refuses to run as root)"
pg_isready -q -h "$UPSTREAM_HOST" -p "$UPSTREAM_PORT" -t 5 ||
	fail "PostgreSQL at $UPSTREAM_HOST:$UPSTREAM_PORT is not answering"
if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
	fail "127.0.0.1:$PORT is already in use (another run of this script?)"
fi

# mktemp -d under /tmp: the postgres user must reach the directory.
dir=$(mktemp -d /tmp/idem-pgbouncer.XXXXXX)
pid=
stop() {
	local rc=$?
	if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
		kill -TERM "$pid" # immediate shutdown
		for _ in $(seq 50); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.2
		done
		if kill -0 "$pid" 2>/dev/null; then
			echo "pgbouncer (pid $pid) ignored SIGTERM; killing it"
			kill -KILL "$pid" || true
		fi
	fi
	if [ "$rc" != 0 ] && [ -f "$dir/pgbouncer.log" ]; then
		echo "---- last 40 lines of the pgbouncer log ----"
		tail -n 40 "$dir/pgbouncer.log"
	fi
	rm -rf "$dir"
	exit "$rc"
}
trap stop EXIT

cat >"$dir/userlist.txt" <<'EOF'
"postgres" ""
EOF
# pool_mode = transaction is what is tested. unix_socket_dir empty: TCP only, so nothing lands
# outside $dir. default_pool_size stays well under the shared server's max_connections.
cat >"$dir/pgbouncer.ini" <<EOF
[databases]
test = host=$UPSTREAM_HOST port=$UPSTREAM_PORT dbname=test

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PORT
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
admin_users = postgres
pool_mode = transaction
default_pool_size = 20
max_client_conn = 500
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
log_connections = 0
log_disconnections = 0
EOF
chown -R postgres: "$dir"

echo "starting pgbouncer on 127.0.0.1:$PORT (transaction pooling) in front of $UPSTREAM_HOST:$UPSTREAM_PORT; files in $dir"
runuser -u postgres -- "$PGBOUNCER" -d "$dir/pgbouncer.ini" || fail "pgbouncer did not start"
deadline=$((SECONDS + WAIT_SECONDS))
until [ -s "$dir/pgbouncer.pid" ]; do
	[ "$SECONDS" -lt "$deadline" ] || fail "pgbouncer wrote no pid file in ${WAIT_SECONDS}s"
	sleep 0.2
done
pid=$(cat "$dir/pgbouncer.pid")
until psql -X -w -q -h 127.0.0.1 -p "$PORT" -U postgres -d test -tAc 'SELECT 1' >/dev/null 2>&1; do
	kill -0 "$pid" 2>/dev/null || fail "pgbouncer (pid $pid) exited"
	[ "$SECONDS" -lt "$deadline" ] || fail "pgbouncer is not answering after ${WAIT_SECONDS}s"
	sleep 0.5
done
pool_mode=$(psql -X -w -q -h 127.0.0.1 -p "$PORT" -U postgres -d pgbouncer -tA -F ' ' -c 'SHOW CONFIG' | awk '$1 == "pool_mode" { print $2 }')
[ "$pool_mode" = transaction ] || fail "pgbouncer runs with pool_mode=$pool_mode, not transaction"
echo "pgbouncer (pid $pid, pool_mode=$pool_mode) is up after $((SECONDS - start))s"

export IDEM_TEST_REQUIRE_DB=1
export IDEM_TEST_POSTGRES_URL="postgres://postgres@127.0.0.1:$PORT/test?sslmode=disable"
export IDEM_TEST_POSTGRES_POOLER=transaction
export IDEM_TEST_POSTGRES_EXEC_MODES=$MODES
echo "IDEM_TEST_POSTGRES_URL=$IDEM_TEST_POSTGRES_URL IDEM_TEST_POSTGRES_EXEC_MODES=$MODES"

if [ "$mode" = run ]; then
	"$@"
	exit
fi

cmd=(go test -race -count=1 -timeout 15m -skip "^($NOT_THROUGH_POOLER)\$" ./postgres/... -v)
echo "${cmd[*]}"
log="$dir/test.log"
if ! "${cmd[@]}" >"$log" 2>&1; then
	grep -E -- '^(--- FAIL|FAIL|ok|panic:|\s+--- FAIL)' "$log" || true
	echo "---- last 150 lines of the test log ----"
	tail -n 150 "$log"
	fail "tests failed through pgbouncer"
fi
grep -E '^(ok|FAIL|\?)\s' "$log"
kill -0 "$pid" 2>/dev/null || fail "pgbouncer (pid $pid) died during the tests"
skips=$(grep -E -- '--- SKIP' "$log" || true)
[ -z "$skips" ] || fail "tests were skipped through pgbouncer:
$skips"
passes=$(grep -cE -- '--- PASS' "$log" || true)
[ "$passes" -gt 0 ] || fail "no test ran"
for m in SimpleProtocol Exec; do
	echo "conformance cases passed under $m: $(grep -cE -- "^\s+--- PASS: TestConformance/$m/" "$log" || true)"
done
echo "pgbouncer run ($mode), ./postgres/...: $passes passed, 0 failed, in $((SECONDS - start))s"

faults_start=$SECONDS
cmd=(go test -tags faults -race -count=1 -timeout 20m -run "^($FAULT_SCENARIOS)\$" ./faults/ -v)
echo "IDEM_FAULTS_DIALECTS=postgres ${cmd[*]}"
flog="$dir/faults.log"
if ! IDEM_FAULTS_DIALECTS=postgres "${cmd[@]}" >"$flog" 2>&1; then
	grep -E -- '^(--- FAIL|FAIL|ok|panic:|\s+--- FAIL)' "$flog" || true
	echo "---- last 150 lines of the fault suite's log ----"
	tail -n 150 "$flog"
	fail "fault scenarios failed through pgbouncer"
fi
grep -o 'FAULTS|.*' "$flog" | sed 's/^FAULTS//' || true
kill -0 "$pid" 2>/dev/null || fail "pgbouncer (pid $pid) died during the fault scenarios"
skips=$(grep -E -- '--- SKIP' "$flog" || true)
[ -z "$skips" ] || fail "fault scenarios were skipped through pgbouncer:
$skips"
# Each scenario must have run on postgres: a selection that matched nothing would pass silently.
for s in ${FAULT_SCENARIOS//|/ }; do
	grep -qE -- "^\s*--- PASS: $s/postgres( |\$)" "$flog" || fail "$s/postgres did not run (or did not pass) through pgbouncer"
done
fpasses=$(grep -cE -- '^\s*--- PASS' "$flog" || true)
echo "pgbouncer run ($mode), fault scenarios: $fpasses passed, 0 failed, in $((SECONDS - faults_start))s; total $((SECONDS - start))s"
