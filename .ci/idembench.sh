#!/usr/bin/env bash
# The load tool (cmd/idembench) is a module of its own, so that its Redis client (go-redis)
# never lands in the library's go.mod; the root's gofmt, vet, tidy and tests do not reach it.
# This runs them there, outside any go.work (GOWORK=off: the module resolves the library
# through its replace directive), and fails on any skipped test: its smoke test needs
# Redis, which CI starts.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../cmd/idembench"
export GOWORK=off

fail() {
	echo "CI FAIL (cmd/idembench): $*" >&2
	exit 1
}

unformatted=$(gofmt -l .)
[ -z "$unformatted" ] || fail "gofmt would reformat these files (run gofmt -w):
$unformatted"
go vet ./...
go mod tidy -diff || fail "go.mod/go.sum are not tidy (cd cmd/idembench && GOWORK=off go mod tidy)"

log=$(mktemp)
if ! go test -race -count=1 ./... -v >"$log" 2>&1; then
	grep -E -- '^(--- FAIL|FAIL|ok|panic:|\s+--- FAIL)' "$log" || true
	echo "---- last 100 lines of the test log ----"
	tail -n 100 "$log"
	fail "tests failed"
fi
grep -E '^(ok|FAIL|\?)\s' "$log"
skips=$(grep -cE -- '--- SKIP' "$log" || true)
[ "$skips" = 0 ] || { grep -E -- '--- SKIP' "$log"; fail "tests were skipped"; }
passes=$(grep -cE -- '^\s*--- PASS' "$log" || true)
[ "$passes" -gt 0 ] || fail "no test ran"
echo "cmd/idembench: $passes passed, 0 failed"
