#!/usr/bin/env bash
# Benchmarks: upstream 0.24's statement replay vs the extension, side by side in one run, on a
# throwaway cluster. Writes docs/BENCHMARKS.md. About 22 minutes (BENCH_SECONDS per round; BENCH_SKIP_PULL=1,
# BENCH_SKIP_REACTIONS=1 leave those parts out).
# BENCH_PG_MAJOR=18 runs it on PostgreSQL 18 instead (writes docs/BENCHMARKS-pg18.md; the next
# run on 15 shows those ratios next to its own). BENCH_REACTIONS_ONLY=1 runs only the reactions
# next to pgmq (bench/reactions.py; fetches pgmq's install script with cargo) and replaces only
# that section of docs/BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/pg.sh
export PATH="$HOME/.cargo/bin:$PATH"
export BENCH_PG_MAJOR=${BENCH_PG_MAJOR:-15}
export BENCH_PG_BIN=$(pg_bindir "$BENCH_PG_MAJOR") SYNCULAR_PG_MAJOR=$BENCH_PG_MAJOR
DIR=${BENCH_DIR:-/tmp/syncular-bench-cluster}
PORT=${BENCH_PORT:-25437}
echo "== building and installing the release build"
install_extension "$(pg_config_of "$BENCH_PG_MAJOR")" --release
trap 'scripts/cluster.sh stop "$DIR"' EXIT
scripts/cluster.sh fresh "$DIR" "$PORT"
BENCH_PORT=$PORT python3 bench/run.py
