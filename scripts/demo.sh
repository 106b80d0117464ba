#!/usr/bin/env bash
# The main job: build and install syncular into the local PostgreSQL 15, start a throwaway
# cluster as `postgres`, CREATE EXTENSION, and walk through a push, a pull, a fence rejection and
# a serve-gate refusal (scripts/demo.sql), printing what happens.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/pg.sh
export PATH="$HOME/.cargo/bin:$PATH"
DIR=${SYNCULAR_DEMO_DIR:-/tmp/syncular-demo}
PORT=${SYNCULAR_DEMO_PORT:-25438}
echo "== building and installing the extension"
install_extension /usr/lib/postgresql/15/bin/pg_config --release
trap 'scripts/cluster.sh stop "$DIR"' EXIT
scripts/cluster.sh fresh "$DIR" "$PORT"
echo "== throwaway cluster on 127.0.0.1:$PORT ($DIR)"
psql -X -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -f scripts/demo.sql
