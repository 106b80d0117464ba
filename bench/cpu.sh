#!/usr/bin/env bash
# Server CPU per push (issue 28), measured by bench/cpu.py: the four-client push of upstream
# 0.24's statements, `push_commit` and the one-statement floor on two throwaway clusters — the
# benchmark's own (`fsync = off`, autovacuum off, no timed checkpoint) and a durable one that
# does not wait for its WAL flush (`synchronous_commit = off`, PostgreSQL's defaults otherwise)
# — with pg_stat_statements (`track = all`), the release build; then the pull (upstream's
# statements, `pull`, its floor; catch-up and idle; BENCH_CPU_PULL=0 leaves it out). Prints one
# line per side and setting; about 7 minutes per setting. BENCH_PG_MAJOR=18 for PostgreSQL 18; BENCH_CPU_SETTINGS="bench" for
# one setting; BENCH_SECONDS, BENCH_ROUNDS, BENCH_CLIENTS tune the load. docs/BENCHMARKS.md
# "Server CPU (issue 28)" is written from its output.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/pg.sh
export PATH="$HOME/.cargo/bin:$PATH"
export BENCH_PG_MAJOR=${BENCH_PG_MAJOR:-15}
export BENCH_PG_BIN=$(pg_bindir "$BENCH_PG_MAJOR") SYNCULAR_PG_MAJOR=$BENCH_PG_MAJOR
export BENCH_SECONDS=${BENCH_SECONDS:-5}
DIR=${BENCH_DIR:-/tmp/syncular-bench-cpu}
PORT=${BENCH_PORT:-25480}
export BENCH_PORT=$PORT BENCH_DIR=$DIR
echo "== building and installing the release build"
install_extension "$(pg_config_of "$BENCH_PG_MAJOR")" --release
trap 'scripts/cluster.sh stop "$DIR"' EXIT
q() { sudo -u postgres "$BENCH_PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -c "$1" >/dev/null; }
for setting in ${BENCH_CPU_SETTINGS:-bench async}; do
  scripts/cluster.sh fresh "$DIR" "$PORT"
  q "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"
  if [ "$setting" = bench ]; then
    q "ALTER SYSTEM SET autovacuum = off"
    q "ALTER SYSTEM SET checkpoint_timeout = '1h'"
    q "ALTER SYSTEM SET max_wal_size = '32GB'"
  else
    q "ALTER SYSTEM SET fsync = on"
    q "ALTER SYSTEM SET synchronous_commit = off"
  fi
  scripts/cluster.sh stop "$DIR"
  scripts/cluster.sh start "$DIR" "$PORT"
  q "ALTER SYSTEM SET pg_stat_statements.track = 'all'"
  q "SELECT pg_reload_conf()"
  BENCH_CPU_SETTING=$setting python3 bench/cpu.py
  scripts/cluster.sh stop "$DIR"
done
