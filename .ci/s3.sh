#!/usr/bin/env bash
# A real S3-compatible server on loopback for contrib/idems3's tests: SeaweedFS (Apache-2.0),
# `weed server -s3` (master, volume, filer and S3 gateway in one process), built from the Go
# module proxy at the pinned version below into a cache outside the repository, keyed by that
# version, so later runs on the same machine reuse the binary.
#
#   bash .ci/s3.sh run CMD [ARGS...]  build if missing, start the server with its data in a new
#                                     temporary directory, wait until it answers, create the
#                                     bucket, run CMD with IDEM_TEST_S3_* exported, then stop
#                                     the server it started (trap on exit) and exit with CMD's
#                                     status; fails if the server does not come up
#                                     (`bash .ci/s3.sh run bash`: a shell with the server up)
#   bash .ci/s3.sh build              only build (or find) the binary and print its path
#
# Ports (loopback only, clear of the project's other servers): S3 18336, and the server's own
# components on 18330-18335 and 18337 (master, volume, filer and their gRPC ports). Its
# telemetry is off and it is bound to 127.0.0.1.
set -euo pipefail
# No cd: CMD runs in the caller's directory (`cd contrib/idems3 && bash ../../.ci/s3.sh run go test ./...`).

SEAWEEDFS_MODULE=github.com/seaweedfs/seaweedfs
SEAWEEDFS_VERSION=v0.0.0-20261109003541-7506e5f91cd6
CACHE=${IDEM_S3_CACHE:-${HOME:-/root}/.cache/idem-s3}
WEED=$CACHE/seaweedfs-$SEAWEEDFS_VERSION/weed

S3_PORT=18336
BUCKET=idem-test
ACCESS_KEY=idemtestaccess
SECRET_KEY=idemtestsecret0123456789
WAIT_SECONDS=60

fail() {
	echo "CI FAIL: s3.sh: $*" >&2
	exit 1
}

build() {
	[ -x "$WEED" ] && return 0
	echo "s3.sh: building SeaweedFS $SEAWEEDFS_VERSION into $WEED (once per machine)" >&2
	local t0=$SECONDS dir tmp
	# Its go.mod has replace directives, which `go install pkg@version` refuses: build in the
	# module's own directory of the module cache, where they apply.
	GOWORK=off GOFLAGS= go mod download "$SEAWEEDFS_MODULE@$SEAWEEDFS_VERSION" >&2 || fail "cannot download $SEAWEEDFS_MODULE@$SEAWEEDFS_VERSION"
	dir=$(GOWORK=off GOFLAGS= go list -m -f '{{.Dir}}' "$SEAWEEDFS_MODULE@$SEAWEEDFS_VERSION" 2>/dev/null) ||
		dir=$(go env GOMODCACHE)/$SEAWEEDFS_MODULE@$SEAWEEDFS_VERSION
	[ -d "$dir/weed" ] || fail "no weed/ in $dir"
	mkdir -p "$(dirname "$WEED")"
	tmp=$WEED.tmp.$$
	(cd "$dir" && GOWORK=off GOFLAGS= CGO_ENABLED=0 go build -buildvcs=false -trimpath -o "$tmp" ./weed) >&2 ||
		{ rm -f "$tmp"; fail "cannot build SeaweedFS"; }
	mv "$tmp" "$WEED" # whole or not at all: an interrupted build caches nothing
	echo "s3.sh: built in $((SECONDS - t0))s" >&2
}

# s3curl METHOD PATH: a SigV4-signed request to the S3 gateway; prints the HTTP status.
s3curl() {
	curl -s -o /dev/null -w '%{http_code}' --max-time 5 --aws-sigv4 "aws:amz:us-east-1:s3" \
		-u "$ACCESS_KEY:$SECRET_KEY" -X "$1" "http://127.0.0.1:$S3_PORT$2" || true
}

# stop stops the server this run started (SIGTERM, then SIGKILL after 2s: its data is thrown
# away), and removes its data.
stop() {
	if [ -n "${pid:-}" ] && kill -0 "$pid" 2>/dev/null; then
		kill "$pid" 2>/dev/null || true
		local i
		for i in $(seq 4); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.5
		done
		kill -KILL "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	fi
	[ -z "${data:-}" ] || rm -rf "$data"
}

run() {
	[ "$#" -gt 0 ] || fail "usage: s3.sh run CMD [ARGS...]"
	command -v curl >/dev/null || fail "curl is not installed"
	build
	if [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$S3_PORT/" || true)" != 000 ]; then
		fail "something already listens on 127.0.0.1:$S3_PORT (another s3.sh run?)"
	fi
	# Globals: the EXIT trap runs after this function has returned.
	pid=
	data=$(mktemp -d "${TMPDIR:-/tmp}/idem-s3.XXXXXX")
	# Stop only the server this run started, then remove its data.
	trap stop EXIT
	cat >"$data/s3.json" <<EOF
{"identities": [{"name": "idem", "credentials": [{"accessKey": "$ACCESS_KEY", "secretKey": "$SECRET_KEY"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
EOF
	mkdir -p "$data/store"
	"$WEED" server -ip=127.0.0.1 -ip.bind=127.0.0.1 -dir="$data/store" \
		-master.port=18330 -master.port.grpc=18331 -master.telemetry=false -master.volumeSizeLimitMB=64 \
		-volume.port=18332 -volume.port.grpc=18333 -volume.max=16 \
		-filer -filer.port=18334 -filer.port.grpc=18335 \
		-s3 -s3.autoCreateBucket=false -s3.port=$S3_PORT -s3.port.grpc=18337 -s3.port.iceberg=0 -s3.port.lance=0 -s3.config="$data/s3.json" \
		>"$data/weed.log" 2>&1 &
	pid=$!
	local t0=$SECONDS deadline=$((SECONDS + WAIT_SECONDS)) code
	# Up when a signed CreateBucket succeeds (200), or the bucket is already there (409).
	until code=$(s3curl PUT "/$BUCKET") && { [ "$code" = 200 ] || [ "$code" = 409 ]; }; do
		kill -0 "$pid" 2>/dev/null || { tail -n 50 "$data/weed.log" >&2; fail "SeaweedFS exited"; }
		[ "$SECONDS" -lt "$deadline" ] || { tail -n 50 "$data/weed.log" >&2; fail "SeaweedFS S3 gateway did not answer on 127.0.0.1:$S3_PORT within ${WAIT_SECONDS}s (last status $code)"; }
		sleep 0.5
	done
	code=$(s3curl HEAD "/$BUCKET")
	[ "$code" = 200 ] || { tail -n 50 "$data/weed.log" >&2; fail "bucket $BUCKET is not there (HEAD answered $code)"; }
	echo "s3.sh: SeaweedFS $SEAWEEDFS_VERSION S3 gateway up at http://127.0.0.1:$S3_PORT in $((SECONDS - t0))s, bucket $BUCKET"
	export IDEM_TEST_S3_ENDPOINT=http://127.0.0.1:$S3_PORT
	export IDEM_TEST_S3_BUCKET=$BUCKET
	export IDEM_TEST_S3_ACCESS_KEY=$ACCESS_KEY
	export IDEM_TEST_S3_SECRET_KEY=$SECRET_KEY
	export IDEM_TEST_REQUIRE_S3=1
	local rc=0
	"$@" || rc=$?
	return "$rc"
}

case ${1:-} in
build)
	build
	echo "$WEED"
	;;
run)
	shift
	run "$@"
	;;
*) fail "usage: s3.sh build | run CMD [ARGS...]" ;;
esac
