#!/usr/bin/env bash
# The change feed against per-commit notifications (issue 31), measured by bench/feed.py: a
# throwaway cluster that preloads the library with the feed for database feed_db. Prints the
# table of docs/BENCHMARKS.md's "## Change feed" section. About 3 minutes a round and interval.
# BENCH_PG_MAJOR=18 runs it on PostgreSQL 18; BENCH_SECONDS, BENCH_PUSHERS, BENCH_LISTENERS,
# BENCH_FEED_INTERVALS, BENCH_ROUNDS and BENCH_LISTENER_NICE tune it (bench/feed.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/pg.sh
export PATH="$HOME/.cargo/bin:$PATH"
export SYNCULAR_PG_MAJOR=${BENCH_PG_MAJOR:-15}
DIR=${BENCH_DIR:-/tmp/syncular-bench-feed}
PORT=${BENCH_PORT:-25449}
if [ -z "${BENCH_NO_INSTALL:-}" ]; then
  echo "== building and installing the release build"
  install_extension "$(pg_config_of "$SYNCULAR_PG_MAJOR")" --release
fi
if [ ! -x "$DIR-venv/bin/python" ]; then python3 -m venv "$DIR-venv"; fi
"$DIR-venv/bin/pip" install --quiet --disable-pip-version-check 'psycopg[binary]==3.3.*'
trap 'scripts/cluster.sh stop "$DIR/cluster"' EXIT
mkdir -p "$DIR" && chown postgres:postgres "$DIR" 2>/dev/null || true
SYNCULAR_CLUSTER_FEED_DB=feed_db scripts/cluster.sh fresh "$DIR/cluster" "$PORT"
BENCH_CLUSTER="host=127.0.0.1 port=$PORT user=postgres" "$DIR-venv/bin/python" bench/feed.py
