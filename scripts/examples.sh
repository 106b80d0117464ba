#!/usr/bin/env bash
# Runs the three client examples (Rust, Python, TypeScript) against a running cluster, each in a
# fresh database with the extension installed; each example asserts its own results.
#   scripts/examples.sh PORT [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:?port}
WORK=${2:-/tmp/syncular-test}
export PATH="$HOME/.cargo/bin:$PATH"
# The examples run as two login roles, as a deployment would (docs/SECURITY.md): app_migrator
# (syncular_admin: tables, registration, migration, push schema, checkpoints) and app_server
# (syncular_host: serving). Roles are cluster-wide, so they are created once and kept; the
# cluster's trust authentication lets them log in without a password.
psql -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -c "DO \$\$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'app_migrator') THEN CREATE ROLE app_migrator LOGIN; END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'app_server') THEN CREATE ROLE app_server LOGIN; END IF;
END \$\$"
# The superuser's part per database: the extension (it creates syncular_host / syncular_admin),
# the memberships, and CREATE on the database for the migrator, which creates its own schema
# for the app tables (PostgreSQL 15 grants no CREATE on `public`).
fresh_db() {
  psql -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -c "DROP DATABASE IF EXISTS $1" -c "CREATE DATABASE $1"
  # (client_min_messages: granting a membership a role already holds only notices so.)
  psql -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d "$1" -c "SET client_min_messages = warning" \
    -c "CREATE EXTENSION syncular" -c "GRANT syncular_admin TO app_migrator" -c "GRANT syncular_host TO app_server" \
    -c "GRANT CREATE ON DATABASE $1 TO app_migrator"
}
passed=0; failed=0
run() {
  local name=$1; shift
  echo "== example: $name"
  if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "example $name FAILED"; fi
}

fresh_db example_rust
run rust env SYNCULAR_EXAMPLE_ADMIN_URL="host=127.0.0.1 port=$PORT user=app_migrator dbname=example_rust" \
  SYNCULAR_EXAMPLE_URL="host=127.0.0.1 port=$PORT user=app_server dbname=example_rust" \
  cargo run --quiet --locked --manifest-path examples/rust/Cargo.toml

fresh_db example_python
if [ ! -x "$WORK/venv/bin/python" ]; then python3 -m venv "$WORK/venv"; fi
"$WORK/venv/bin/pip" install --quiet --disable-pip-version-check -r examples/python/requirements.txt
run python env SYNCULAR_EXAMPLE_ADMIN_URL="host=127.0.0.1 port=$PORT user=app_migrator dbname=example_python" \
  SYNCULAR_EXAMPLE_URL="host=127.0.0.1 port=$PORT user=app_server dbname=example_python" \
  "$WORK/venv/bin/python" examples/python/host.py

fresh_db example_node
(cd examples/node && npm ci --no-audit --no-fund --silent && npx tsc -p .)
run node env SYNCULAR_EXAMPLE_ADMIN_URL="postgres://app_migrator@127.0.0.1:$PORT/example_node" \
  SYNCULAR_EXAMPLE_URL="postgres://app_server@127.0.0.1:$PORT/example_node" node examples/node/dist/host.js

echo "examples: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
