#!/usr/bin/env bash
# syncular on Citus next to one node (issue 30), measured by bench/citus.py: a throwaway
# PostgreSQL 15 node and a Citus cluster (scripts/citus.sh: a coordinator and two workers),
# pg_stat_statements on the node and the coordinator, the release build. Needs Citus installed
# for PostgreSQL 15 (docs/SCALING.md; nothing of it is in this repository). Writes its table
# for the "## Citus" section of docs/BENCHMARKS.md to stdout. About 2 minutes.
# BENCH_SECONDS and BENCH_WORKERS tune the load (bench/citus.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/pg.sh
export PATH="$HOME/.cargo/bin:$PATH"
export SYNCULAR_PG_MAJOR=15
if ! scripts/citus.sh available; then echo "citus: not installed for PostgreSQL 15, nothing to measure"; exit 0; fi
DIR=${BENCH_DIR:-/tmp/syncular-bench-citus}
PORT=${BENCH_PORT:-25460}
echo "== building and installing the release build"
install_extension "$(pg_config_of 15)" --release
if [ ! -x "$DIR-venv/bin/python" ]; then python3 -m venv "$DIR-venv"; fi
"$DIR-venv/bin/pip" install --quiet --disable-pip-version-check 'psycopg[binary]==3.3.*'
trap 'scripts/cluster.sh stop "$DIR/single"; scripts/citus.sh stop "$DIR/citus"' EXIT
mkdir -p "$DIR" && chown postgres:postgres "$DIR" 2>/dev/null || true
BIN=$(pg_bindir 15)
q() { sudo -u postgres "$BIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$1" -U postgres -d "$2" -c "$3" >/dev/null; }
scripts/cluster.sh fresh "$DIR/single" "$PORT"
q "$PORT" postgres "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"
scripts/cluster.sh stop "$DIR/single"
scripts/cluster.sh start "$DIR/single" "$PORT"
q "$PORT" postgres "CREATE DATABASE bench"
scripts/citus.sh fresh "$DIR/citus" "$((PORT + 10))" bench
q "$((PORT + 10))" postgres "ALTER SYSTEM SET shared_preload_libraries = 'citus', 'syncular', 'pg_stat_statements'"
scripts/cluster.sh stop "$DIR/citus/node0"
scripts/cluster.sh start "$DIR/citus/node0" "$((PORT + 10))"
BENCH_SINGLE="host=127.0.0.1 port=$PORT user=postgres dbname=bench" \
BENCH_COORD="host=127.0.0.1 port=$((PORT + 10)) user=postgres dbname=bench" \
  "$DIR-venv/bin/python" bench/citus.py
