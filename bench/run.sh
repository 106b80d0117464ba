#!/usr/bin/env bash
# Benchmarks: upstream 0.24's statement replay vs the extension, side by side in one run, on a
# throwaway cluster. Writes docs/BENCHMARKS.md. About 9–10 minutes (BENCH_SECONDS per round).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
DIR=${BENCH_DIR:-/tmp/syncular-bench-cluster}
PORT=${BENCH_PORT:-55437}
echo "== building and installing the release build"
cargo pgrx install --release --pg-config /usr/lib/postgresql/15/bin/pg_config >/dev/null
trap 'scripts/cluster.sh stop "$DIR"' EXIT
scripts/cluster.sh fresh "$DIR" "$PORT"
BENCH_PORT=$PORT python3 bench/run.py
