#!/usr/bin/env bash
# The TypeScript adapter's push next to upstream 0.24's replayed statements (docs/BENCHMARKS.md,
# "TypeScript adapter"): installs nothing (run bench/run.sh or `cargo pgrx install` first), starts a
# throwaway PostgreSQL 15 cluster, runs adapters/typescript/bench/push.ts, stops the cluster.
#   bench/adapter-ts.sh            BENCH_TS_PORT (25436), BENCH_SECONDS, BENCH_ROUNDS, BENCH_CLIENTS
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg.sh
PORT=${BENCH_TS_PORT:-25436}
DIR=${BENCH_TS_DIR:-/tmp/syncular-bench-ts}
export BENCH_PG_BIN=${BENCH_PG_BIN:-$(pg_bindir 15)}
scripts/cluster.sh fresh "$DIR" "$PORT"
trap 'scripts/cluster.sh stop "$DIR"' EXIT
(cd adapters/typescript && npm ci --no-audit --no-fund --silent && npx tsc -p .)
BENCH_TS_PG="postgres://postgres@127.0.0.1:$PORT/postgres" node adapters/typescript/dist/bench/push.js
