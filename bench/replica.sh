#!/usr/bin/env bash
# Pulls served by a hot standby (issue 32), measured by bench/replica.py: a throwaway primary with
# pg_stat_statements and a hot standby streaming from it (scripts/cluster.sh standby). Writes
# the "## Read replicas" section of docs/BENCHMARKS.md. About 3 minutes.
# BENCH_PG_MAJOR=18 runs it on PostgreSQL 18; BENCH_SECONDS, BENCH_WORKERS, BENCH_PUSH_RATE tune
# the load (bench/replica.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/pg.sh
export PATH="$HOME/.cargo/bin:$PATH"
export SYNCULAR_PG_MAJOR=${BENCH_PG_MAJOR:-15}
DIR=${BENCH_DIR:-/tmp/syncular-bench-replica}
PORT=${BENCH_PORT:-25447}
echo "== building and installing the release build"
install_extension "$(pg_config_of "$SYNCULAR_PG_MAJOR")" --release
# The client: psycopg 3 in a virtualenv of its own.
if [ ! -x "$DIR-venv/bin/python" ]; then python3 -m venv "$DIR-venv"; fi
"$DIR-venv/bin/pip" install --quiet --disable-pip-version-check 'psycopg[binary]==3.3.*'
trap 'scripts/cluster.sh stop "$DIR/standby"; scripts/cluster.sh stop "$DIR/primary"' EXIT
mkdir -p "$DIR" && chown postgres:postgres "$DIR" 2>/dev/null || true
scripts/cluster.sh fresh "$DIR/primary" "$PORT"
# pg_stat_statements on the primary, and on the standby through the base backup's copy of
# postgresql.auto.conf.
sudo -u postgres "$(pg_bindir "$SYNCULAR_PG_MAJOR")/psql" -X -q -h 127.0.0.1 -p "$PORT" -U postgres \
  -c "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'" >/dev/null
scripts/cluster.sh stop "$DIR/primary"
scripts/cluster.sh start "$DIR/primary" "$PORT"
scripts/cluster.sh standby "$DIR/standby" "$((PORT + 1))" "$PORT" 2>/dev/null
BENCH_PRIMARY="host=127.0.0.1 port=$PORT user=postgres" \
BENCH_STANDBY="host=127.0.0.1 port=$((PORT + 1)) user=postgres" \
  "$DIR-venv/bin/python" bench/replica.py
