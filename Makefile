# Every target with a "## text" comment is listed by `make help` (the default target).
# The server tests read IDEM_TEST_POSTGRES_URL and IDEM_TEST_MYSQL_DSN (see README.md).

GO ?= go

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@echo "usage: make <target>"
	@echo
	@awk 'BEGIN { FS = ":.*## " } /^[a-zA-Z0-9_\/-]+:.*## / { printf "  %-14s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

.PHONY: test
test: ## Run every test (SQLite always; PostgreSQL and MariaDB when reachable, skipped otherwise)
	$(GO) test -race -count=1 ./...

.PHONY: test/sqlite
test/sqlite: ## Run the tests that need no server: root package, sqlite dialect, migrations
	$(GO) test -race -count=1 . ./sqlite/... ./migrations/...

# IDEM_TEST_REQUIRE_DB=1: asking for a server's tests by name and getting skips would be a lie.
.PHONY: test/postgres
test/postgres: ## Run the PostgreSQL dialect tests (fail if the server is unreachable)
	IDEM_TEST_REQUIRE_DB=1 $(GO) test -race -count=1 ./postgres/...

.PHONY: test/mysql
test/mysql: ## Run the MySQL/MariaDB dialect tests (fail if the server is unreachable)
	IDEM_TEST_REQUIRE_DB=1 $(GO) test -race -count=1 ./mysql/...

.PHONY: lint
lint: ## Run golangci-lint with .golangci.yaml (install it first; see the message)
	@if command -v golangci-lint >/dev/null 2>&1; then \
		golangci-lint run; \
	else \
		echo "golangci-lint is not installed. Install v2 outside this module, e.g.:"; \
		echo "  go install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0"; \
		echo "(or see https://golangci-lint.run/welcome/install/)"; \
		exit 1; \
	fi

.PHONY: tidy
tidy: ## Run go mod tidy and fail if it changed go.mod or go.sum
	$(GO) mod tidy
	git diff --exit-code go.mod go.sum

# BenchmarkIdem on the three dialects, BENCH_COUNT times in turn (each run measures every
# scenario of every dialect once, so repetitions interleave), the raw results appended to
# BENCH_OUT (benchstat reads it), then the ratio tables (docs/performance.md). The writing
# scenarios run for both business shapes, small and order (IDEM_BENCH_SHAPES=small picks one).
# About 13 minutes with the defaults. PostgreSQL and MariaDB are skipped when unreachable.
BENCH_TIME ?= 2s
BENCH_COUNT ?= 3
BENCH_OUT ?= bench.out

.PHONY: bench
bench: SHELL := bash
bench: .SHELLFLAGS := -o pipefail -ec
bench: ## Run BenchmarkIdem (shapes small,order: IDEM_BENCH_SHAPES; levels: IDEM_BENCH_CONC) and print the ratio tables
	: > $(BENCH_OUT)
	for i in $$(seq $(BENCH_COUNT)); do \
		$(GO) test -run '^$$' -bench BenchmarkIdem -benchtime $(BENCH_TIME) -count 1 \
			./postgres/ ./mysql/ ./sqlite/ | tee -a $(BENCH_OUT); \
	done
	$(GO) run ./internal/cmd/benchratio < $(BENCH_OUT)

.PHONY: demo
demo: ## Run the orders demo on embedded SQLite (examples/orders)
	$(GO) run ./examples/orders -demo

.PHONY: goose-cli
goose-cli: ## Check the goose CLI migrates the shipped files up and down on all three dialects
	bash .ci/goose-cli.sh

.PHONY: modules
modules: ## Check every contrib/ module (gofmt, vet, tidy, tests) and the go.work workspace, with an S3 server (.ci/s3.sh)
	bash .ci/s3.sh run bash .ci/modules.sh

.PHONY: pgbouncer
pgbouncer: ## Run the postgres tests and the PostgreSQL fault scenarios through PgBouncer, transaction pooling (installs and starts it; see docs/scaling.md)
	bash .ci/pgbouncer.sh

.PHONY: ci
ci: ## Run what CI runs: start the servers, gofmt, vet, tests, goose CLI check, contrib modules
	bash .ci/run

# The fault suite (faults/, build tag "faults") at full scale on every dialect; the rows it
# prints with the "FAULTS|" prefix are the tables of docs/reliability.md. The servers must run.
FAULTS_TIMEOUT ?= 90m

.PHONY: faults
faults: SHELL := bash
faults: .SHELLFLAGS := -o pipefail -ec
faults: ## Run the fault suite at full scale (see docs/reliability.md; about 30 minutes)
	IDEM_FAULTS_SCALE=full IDEM_TEST_REQUIRE_DB=1 $(GO) test -tags faults -count=1 -timeout $(FAULTS_TIMEOUT) -v ./faults/ | tee faults.out
	@echo; echo "rows for docs/reliability.md:"; grep -o 'FAULTS|.*' faults.out | sed 's/^FAULTS//'

# The load tool (cmd/idembench, docs/performance.md "How to measure" and "Load tool"): every
# scenario of both business shapes on every dialect at 1, 8, 32 and 64 workers, LOADTEST_REPS
# interleaved repetitions, medians; about 90 minutes with the defaults. The servers and Redis
# must run. The tool is a module of its own (go-redis stays out of the library's go.mod), run
# from its directory outside any go.work; a relative -json path is relative to cmd/idembench.
# LOADTEST_ARGS adds flags, e.g. '-shape order', '-rtt direct,0,200us,1ms' (a proxy adding that
# round-trip time in front of every server, 0 = the proxy without delay; round trips per
# operation are counted through it), or '-prefill 10000000 -reuse-prefill' for the 10M-record run.
LOADTEST_DIALECT ?= all
LOADTEST_WORKERS ?= 1,8,32,64
LOADTEST_DURATION ?= 5s
LOADTEST_REPS ?= 3
LOADTEST_ARGS ?=

.PHONY: loadtest
loadtest: ## Run the load tool on every dialect (LOADTEST_ARGS='-shape small,order -rtt direct,0,200us,1ms'; docs/performance.md)
	cd cmd/idembench && GOWORK=off $(GO) run . -dialect $(LOADTEST_DIALECT) -workers $(LOADTEST_WORKERS) \
		-duration $(LOADTEST_DURATION) -reps $(LOADTEST_REPS) $(LOADTEST_ARGS)

.PHONY: loadtest/quick
loadtest/quick: ## Run the load tool briefly (1 and 8 workers, 1s, one repetition, small tables)
	cd cmd/idembench && GOWORK=off $(GO) run . -dialect $(LOADTEST_DIALECT) -workers 1,8 -duration 1s -reps 1 \
		-prefill 20000 -reaper-rows 10000 $(LOADTEST_ARGS)

# The PostgreSQL failover scenario (docs/reliability.md "Failover"): .ci/pgfailover.sh makes a
# primary (127.0.0.1:15432) and a synchronous standby (15433) with initdb and pg_basebackup in a
# temporary directory, and runs internal/failovertest (build tag failover), which SIGKILLs the
# primary under load and promotes the standby; the clusters are removed afterwards.
# FAILOVER_RUNS fresh pairs of clusters, one failover each. The row it prints with "FAULTS|" is
# the one in docs/reliability.md.
FAILOVER_RUNS ?= 3

.PHONY: failover
failover: SHELL := bash
failover: .SHELLFLAGS := -o pipefail -ec
failover: ## Run the PostgreSQL failover scenario at full scale, FAILOVER_RUNS times (about a minute each)
	FAILOVER_RUNS=$(FAILOVER_RUNS) IDEM_FAILOVER_SCALE=full bash .ci/pgfailover.sh | tee failover.out
	@echo; echo "rows for docs/reliability.md:"; grep -o 'FAULTS|.*' failover.out | sed 's/^FAULTS//'
# A 3-node MariaDB Galera cluster on 127.0.0.1:13306-13308 (.ci/galera.sh: Debian galera-4 and the
# installed mariadbd, temp datadirs, stopped afterwards) and the mysql dialect's Galera tests
# (build tag galera; docs/scaling.md "Galera"). make galera is the bounded run CI does;
# make galera/full the scale docs/reliability.md quotes.
.PHONY: galera
galera: ## Start a 3-node Galera cluster and run the Galera tests (bounded, as in CI; about 2 minutes)
	bash .ci/galera.sh

.PHONY: galera/full
galera/full: ## Run the Galera tests at full scale on a 3-node cluster (see docs/reliability.md)
	bash .ci/galera.sh env IDEM_TEST_GALERA_SCALE=full IDEM_TEST_REQUIRE_DB=1 \
		$(GO) test -tags galera -count=1 -timeout 30m -run '^TestGalera' -v ./mysql/

# Mutation testing of the decision code (internal/cmd/mutate; docs/reliability.md "Mutation
# testing"): MUTATE_SAMPLE Go operator mutants and MUTATE_SQL SQL mutants, drawn with
# MUTATE_SEED, each run on the SQLite then the PostgreSQL conformance suite (needs
# IDEM_TEST_POSTGRES_URL). About 35 minutes with the defaults on 2 shared cores.
MUTATE_SAMPLE ?= 16
MUTATE_SQL ?= 8
MUTATE_SEED ?= 1
MUTATE_FLAGS ?=

.PHONY: mutation
mutation: ## Run the mutation tester on the decision code and print the score and the survivors
	$(GO) run ./internal/cmd/mutate -sample $(MUTATE_SAMPLE) -sample-sql $(MUTATE_SQL) -seed $(MUTATE_SEED) $(MUTATE_FLAGS)
