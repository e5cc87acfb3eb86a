#!/usr/bin/env bash
# Issue 17 round 10: the full grid on today's code, one dialect after the other, nothing else running.
set -u
cd /work/main/cmd/idembench
B=/tmp/r10/idembench
S=bare,floor,floortx,tx,do,leased,redis,httpplain,http,replay,cachedreplay,pkselect,httppk,httpreplay
echo "start $(date -u +%FT%TZ) $(git rev-parse --short HEAD)"
$B -dialect postgres -shape small,order -workers 8,32 -rtt direct,0,200us,1ms -scenarios $S \
  -duration 1s -warmup 300ms -reps 4 -json /tmp/r10/perf17r10-postgres.json > /tmp/r10/perf17r10-postgres.txt 2>&1; echo "pg rc=$? $(date -u +%T)"
$B -dialect mysql -shape small,order -workers 8,32 -rtt direct,0,200us,1ms -scenarios $S,doopt,httpopt \
  -duration 1s -warmup 300ms -reps 4 -json /tmp/r10/perf17r10-mysql.json > /tmp/r10/perf17r10-mysql.txt 2>&1; echo "mysql rc=$? $(date -u +%T)"
$B -dialect sqlite -shape small,order -workers 8,32 -rtt direct,0 -scenarios $S \
  -duration 1s -warmup 300ms -reps 4 -json /tmp/r10/perf17r10-sqlite.json > /tmp/r10/perf17r10-sqlite.txt 2>&1; echo "sqlite rc=$? $(date -u +%T)"
for d in postgres mysql sqlite; do
  $B -dialect $d -shape small -workers 8 -rtt direct -scenarios tx,reaper -reaper-rows 100000 \
    -duration 3s -warmup 500ms -reps 3 -json /tmp/r10/perf17r10-reaper-$d.json > /tmp/r10/perf17r10-reaper-$d.txt 2>&1; echo "reaper $d rc=$? $(date -u +%T)"
done
$B -dialect postgres -shape small -workers 8 -rtt direct -scenarios tx,reaper -reaper-rows 100000 -reaper-pause 15ms \
  -duration 3s -warmup 500ms -reps 3 -json /tmp/r10/perf17r10-reaperpause-postgres.json > /tmp/r10/perf17r10-reaperpause-postgres.txt 2>&1; echo "reaperpause pg rc=$? $(date -u +%T)"
echo "end $(date -u +%FT%TZ)"
