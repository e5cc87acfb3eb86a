#!/usr/bin/env bash
# The contrib modules: every contrib/<name>/go.mod is a Go module of its own (so that
# `go get github.com/idemstore/idem` pulls none of their dependencies), which the root's
# `go test ./...` does not reach, workspace or not. For each one this script runs, in its
# directory: gofmt -l, go vet ./..., go mod tidy -diff and go test -race -count=1 ./...,
# and fails on any failure, any skipped test, or a module that ran no test.
#
# Everything runs with GOWORK=off: a module is built as a clean clone without the workspace
# builds it, through its own go.mod (`replace github.com/idemstore/idem => ../..`), with the
# versions its go.sum pins. In the workspace, the build list is the union of every module's
# requirements, so one module's dependency could hide a missing requirement of another.
# The workspace itself is checked too: go.work lists "." and every contrib module, and all of
# them build together (what a developer gets).
#
# Run it alone with `bash .ci/modules.sh`; .ci/run calls it after the root module's tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

fail() {
	echo "CI FAIL: $*" >&2
	exit 1
}

shopt -s nullglob
mods=(contrib/*/go.mod)
[ "${#mods[@]}" -gt 0 ] || fail "no contrib/*/go.mod found"

# The workspace: "." and exactly the contrib modules, and they build together.
[ -f go.work ] || fail "go.work is missing"
pkgs=(./...)
want=$root
for mod in "${mods[@]}"; do
	pkgs+=("./${mod%/go.mod}/...")
	want+=$'\n'"$root/${mod%/go.mod}"
done
want=$(sort <<<"$want")
have=$(GOWORK="$root/go.work" go list -m -f '{{.Dir}}' | sort)
[ "$want" = "$have" ] || fail "go.work does not list \".\" and every contrib module (go work use ./contrib/<name>):
want:
$want
have:
$have"
GOWORK="$root/go.work" go build "${pkgs[@]}" || fail "the workspace does not build"
echo "go.work: . and ${#mods[@]} contrib module(s), building together"

export GOWORK=off
passed=0
for mod in "${mods[@]}"; do
	dir=${mod%/go.mod}
	echo
	echo "-- $dir"
	grep -qE '^replace github\.com/idemstore/idem => \.\./\.\.$' "$mod" ||
		fail "$mod lacks 'replace github.com/idemstore/idem => ../..' (a clean clone must build it against this checkout)"
	(
		cd "$dir"
		unformatted=$(gofmt -l .)
		[ -z "$unformatted" ] || fail "gofmt would reformat these files in $dir (run gofmt -w):
$unformatted"
		go vet ./... || fail "go vet failed in $dir"
		go mod tidy -diff || fail "$dir: go.mod/go.sum are not tidy (cd $dir && go mod tidy)"
	)
	log=$(mktemp)
	if ! (cd "$dir" && go test -race -count=1 ./... -v) >"$log" 2>&1; then
		grep -E -- '^(--- FAIL|FAIL|ok|panic:|\s+--- FAIL)' "$log" || true
		echo "---- last 200 lines of the test log of $dir ----"
		tail -n 200 "$log"
		fail "tests failed in $dir"
	fi
	grep -E '^(ok|FAIL|\?)\s' "$log"
	skips=$(grep -cE -- '--- SKIP' "$log" || true)
	[ "$skips" = 0 ] || {
		grep -E -- '--- SKIP' "$log"
		fail "tests were skipped in $dir"
	}
	n=$(grep -cE -- '^\s*--- PASS' "$log" || true)
	[ "$n" -gt 0 ] || fail "$dir ran no test"
	echo "$dir: $n passed"
	passed=$((passed + n))
	rm -f "$log"
done
echo "contrib modules: $passed passed, 0 failed"
