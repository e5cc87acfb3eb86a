#!/usr/bin/env bash
# A 3-node MariaDB Galera cluster on loopback, for the mysql dialect's Galera tests
# (mysql/galera_test.go). Usage:
#
#   bash .ci/galera.sh [COMMAND...]
#
# starts three mariadbd nodes (the installed /usr/sbin/mariadbd with Debian's galera-4
# provider), each with its own datadir and defaults file under a temp directory:
#
#   node  client          galera (gcomm)   IST              SST (rsync)
#   n1    127.0.0.1:13306 127.0.0.1:14567  127.0.0.1:14568  127.0.0.1:14569
#   n2    127.0.0.1:13307 127.0.0.1:14577  127.0.0.1:14578  127.0.0.1:14579
#   n3    127.0.0.1:13308 127.0.0.1:14587  127.0.0.1:14588  127.0.0.1:14589
#
# bootstraps n1 (--wsrep-new-cluster), joins n2 then n3 by rsync SST, waits for
# wsrep_cluster_size=3 and wsrep_ready=ON on every node, exports
#
#   IDEM_TEST_GALERA_DSNS  three go-sql-driver DSNs (database test), comma-separated
#   IDEM_TEST_GALERA_DIR   the temp directory (nodes' pid files: $DIR/nN/mysqld.pid)
#
# runs COMMAND (default: the bounded Galera tests CI runs), then stops the nodes it started and
# removes the directory, also when COMMAND fails or the script is interrupted. It never reads
# the machine's MariaDB configuration (every mariadbd and client gets --defaults-file or
# --no-defaults) and never touches 127.0.0.1:3306. GALERA_KEEP=1 keeps the directory (logs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

MARIADBD=${MARIADBD:-/usr/sbin/mariadbd}
PROVIDER=${GALERA_PROVIDER:-/usr/lib/galera/libgalera_smm.so}
CLIENT=$(command -v mariadb || command -v mysql) || true
INSTALL_DB=$(command -v mariadb-install-db || command -v mysql_install_db) || true
WAIT_SECONDS=${GALERA_WAIT_SECONDS:-120}
PORTS=(13306 13307 13308)
GCOMM=(14567 14577 14587)

fail() {
	echo "galera: FAIL: $*" >&2
	exit 1
}

need_pkg() { # PACKAGE PATH: install PACKAGE with apt-get when PATH is missing
	[ -e "$2" ] && return 0
	echo "galera: $2 is missing; installing $1"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1" >/dev/null || fail "apt-get install $1 failed"
	[ -e "$2" ] || fail "$1 installed but $2 is still missing"
}
need_pkg galera-4 "$PROVIDER"
need_pkg rsync /usr/bin/rsync
need_pkg mariadb-server "$MARIADBD"
[ -n "$CLIENT" ] || fail "the mariadb client is not installed"
[ -n "$INSTALL_DB" ] || fail "mariadb-install-db is not installed"

for p in "${PORTS[@]}" "${GCOMM[@]}"; do
	if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
		fail "127.0.0.1:$p is already in use (another Galera run?)"
	fi
done

DIR=$(mktemp -d "${TMPDIR:-/tmp}/idem-galera.XXXXXX")
# As root the nodes run as mysql: the joiner's rsync daemon, started as root, would switch to
# uid nobody and fail to write the datadir.
RUN_USER=$(id -un)
if [ "$(id -u)" = 0 ]; then
	id mysql >/dev/null 2>&1 || fail "running as root needs the mysql user (from mariadb-server)"
	RUN_USER=mysql
fi
PIDS=()
CMD_PID=
stop_all() {
	local rc=$?
	trap - EXIT INT TERM
	if [ -n "$CMD_PID" ] && kill -0 "$CMD_PID" 2>/dev/null; then
		kill -TERM "$CMD_PID" 2>/dev/null || true
		wait "$CMD_PID" 2>/dev/null || true
	fi
	# A node the tests killed and started again (TestGaleraNodeKilled) is no child of this
	# script: find it by its pid file, and stop it only if its command line names this run's
	# defaults file.
	for n in 1 2 3; do
		local pid
		pid=$(cat "$DIR/n$n/mysqld.pid" 2>/dev/null) || continue
		[[ " ${PIDS[*]} " == *" $pid "* ]] && continue
		if tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "--defaults-file=$DIR/n$n/my.cnf"; then
			PIDS+=("$pid")
		fi
	done
	# Only the processes this script (or its tests) started, by pid; SIGTERM is a clean shutdown.
	for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
	for pid in "${PIDS[@]}"; do
		for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
		if kill -0 "$pid" 2>/dev/null; then
			echo "galera: node pid $pid did not stop in 30s; killing it" >&2
			kill -KILL "$pid" 2>/dev/null || true
		fi
		wait "$pid" 2>/dev/null || true
	done
	# A node that never finished joining (a state transfer that hung) writes no pid file: stop
	# whatever still runs with this run's directory on its command line (mariadbd, the SST's
	# rsync), so that nothing outlives the run and holds its ports.
	if pgrep -f -- "$DIR/" >/dev/null 2>&1; then
		echo "galera: stopping leftover processes of $DIR" >&2
		pkill -KILL -f -- "$DIR/" 2>/dev/null || true
		sleep 1
	fi
	if [ "${GALERA_KEEP:-0}" = 1 ] || [ "$rc" != 0 ]; then
		echo "galera: logs kept in $DIR (n*/error.log)" >&2
		if [ "$rc" != 0 ]; then
			for n in 1 2 3; do
				[ -f "$DIR/n$n/error.log" ] || continue
				echo "---- last 30 lines of n$n/error.log ----" >&2
				tail -n 30 "$DIR/n$n/error.log" >&2
			done
		fi
	else
		rm -rf "$DIR"
	fi
	exit "$rc"
}
trap stop_all EXIT
trap 'exit 130' INT TERM

gcomm_list=$(printf '127.0.0.1:%s,' "${GCOMM[@]}")
gcomm_list=${gcomm_list%,}
for n in 1 2 3; do
	i=$((n - 1))
	base=${GCOMM[$i]}
	mkdir -p "$DIR/n$n/data" "$DIR/n$n/tmp"
	cat >"$DIR/n$n/my.cnf" <<EOF
[mysqld]
user=$RUN_USER
datadir=$DIR/n$n/data
tmpdir=$DIR/n$n/tmp
socket=$DIR/n$n/mysqld.sock
pid-file=$DIR/n$n/mysqld.pid
log-error=$DIR/n$n/error.log
port=${PORTS[$i]}
bind-address=127.0.0.1
skip-name-resolve
skip-log-bin
binlog_format=ROW
default_storage_engine=InnoDB
innodb_autoinc_lock_mode=2
innodb_buffer_pool_size=64M
innodb_log_file_size=32M
# The OS keeps what a SIGKILLed mariadbd wrote: 2 survives the process kills the tests do.
innodb_flush_log_at_trx_commit=2
max_connections=300
performance_schema=OFF
wsrep_on=ON
wsrep_provider=$PROVIDER
wsrep_cluster_name=idem_test
wsrep_cluster_address=gcomm://$gcomm_list
wsrep_node_name=n$n
wsrep_node_address=127.0.0.1:$base
wsrep_node_incoming_address=127.0.0.1:${PORTS[$i]}
wsrep_provider_options="gmcast.listen_addr=tcp://127.0.0.1:$base;ist.recv_addr=127.0.0.1:$((base + 1));gcache.size=64M;pc.recovery=FALSE"
wsrep_sst_receive_address=127.0.0.1:$((base + 2))
wsrep_sst_method=rsync
wsrep_slave_threads=2
[client]
socket=$DIR/n$n/mysqld.sock
user=root
EOF
done
[ "$RUN_USER" = "$(id -un)" ] || chown -R "$RUN_USER" "$DIR"

sql() { # NODE SQL...
	local n=$1
	shift
	"$CLIENT" --defaults-file="$DIR/n$n/my.cnf" --batch --skip-column-names --connect-timeout=2 -e "$*"
}
status() { # NODE VARIABLE
	sql "$1" "SHOW GLOBAL STATUS LIKE '$2'" 2>/dev/null | awk '{ print $2 }'
}
wait_node() { # NODE: wsrep_ready=ON and Synced
	local n=$1 deadline=$((SECONDS + WAIT_SECONDS))
	until [ "$(status "$n" wsrep_ready)" = ON ] && [ "$(status "$n" wsrep_local_state_comment)" = Synced ]; do
		kill -0 "${PIDS[$((n - 1))]}" 2>/dev/null || fail "node n$n exited while starting"
		[ "$SECONDS" -lt "$deadline" ] || fail "node n$n not ready after ${WAIT_SECONDS}s"
		sleep 0.5
	done
}
start_node() { # NODE [EXTRA ARGS]
	local n=$1
	shift
	"$MARIADBD" --defaults-file="$DIR/n$n/my.cnf" "$@" >>"$DIR/n$n/stdout.log" 2>&1 &
	PIDS+=("$!")
}

t0=$SECONDS
echo "galera: initialising three datadirs in $DIR"
for n in 1 2 3; do
	"$INSTALL_DB" --defaults-file="$DIR/n$n/my.cnf" --auth-root-authentication-method=socket \
		--skip-test-db >"$DIR/n$n/install.log" 2>&1 || { cat "$DIR/n$n/install.log" >&2; fail "mariadb-install-db n$n"; }
done

echo "galera: bootstrapping n1 on 127.0.0.1:${PORTS[0]}"
start_node 1 --wsrep-new-cluster
wait_node 1
# root over TCP without a password, like the machine's own server (loopback only), and the
# database the tests use. Replicated to the joiners by their SST.
sql 1 "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1'; GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION; CREATE DATABASE IF NOT EXISTS test"

# One joiner at a time: a donor serves one SST at once.
for n in 2 3; do
	echo "galera: joining n$n on 127.0.0.1:${PORTS[$((n - 1))]} (rsync SST)"
	start_node "$n"
	wait_node "$n"
done
deadline=$((SECONDS + WAIT_SECONDS))
for n in 1 2 3; do
	until [ "$(status "$n" wsrep_cluster_size)" = 3 ]; do
		[ "$SECONDS" -lt "$deadline" ] || fail "n$n does not see wsrep_cluster_size=3"
		sleep 0.5
	done
done
echo "galera: cluster of 3 ready in $((SECONDS - t0))s: $(sql 1 "SELECT VERSION()"), $(status 1 wsrep_provider_version)"

dsns=
for p in "${PORTS[@]}"; do dsns+="root@tcp(127.0.0.1:$p)/test?parseTime=true,"; done
export IDEM_TEST_GALERA_DSNS=${dsns%,}
export IDEM_TEST_GALERA_DIR=$DIR
echo "galera: IDEM_TEST_GALERA_DSNS=$IDEM_TEST_GALERA_DSNS"

t1=$SECONDS
if [ "$#" != 0 ]; then
	# In the background, so that a SIGTERM or SIGINT to this script stops the nodes at once.
	"$@" &
	CMD_PID=$!
	wait "$CMD_PID"
	CMD_PID=
	echo "galera: command passed in $((SECONDS - t1))s (cluster start $((t1 - t0))s)"
	exit 0
fi

# The bounded run CI does: the Galera tests of the mysql package (build tag galera): conformance
# on node 1, cross-node races, a callback's certification failure, cross-node replay, Migrate on
# three nodes, a node SIGKILLed under load. Every one must run and pass; a skip is a failure.
log="$DIR/test.log"
env IDEM_TEST_REQUIRE_DB=1 go test -tags galera -race -count=1 -timeout 15m -run '^TestGalera' -v ./mysql/ >"$log" 2>&1 &
CMD_PID=$!
if ! wait "$CMD_PID"; then
	CMD_PID=
	grep -E -- '^(--- FAIL|FAIL|ok|panic:|\s+--- FAIL)' "$log" || true
	echo "---- failures ----"
	grep -E -B3 -A14 -- 'Error Trace|panic:' "$log" | head -n 200 || true
	echo "---- last 100 lines of the Galera test log ----"
	tail -n 100 "$log"
	fail "Galera tests failed"
fi
CMD_PID=
grep -o 'GALERA|.*' "$log" | sed 's/^GALERA//' || true
skips=$(grep -cE -- '--- SKIP' "$log" || true)
[ "$skips" = 0 ] || { grep -E -- '--- SKIP' "$log"; fail "Galera tests were skipped"; }
want=(TestGaleraConformance TestGaleraCrossNodeRace TestGaleraCallbackCertificationFailure
	TestGaleraCertificationFailureAtCompletion TestGaleraReplayOnOtherNode TestGaleraMigrateOnTwoNodes TestGaleraNodeKilled)
for name in "${want[@]}"; do
	grep -qE -- "^--- PASS: $name " "$log" || fail "$name did not run and pass"
done
echo "galera: $(grep -cE -- '--- PASS' "$log") tests and subtests passed in $((SECONDS - t1))s (cluster start $((t1 - t0))s)"
