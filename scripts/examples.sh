#!/usr/bin/env bash
# Runs the three client examples (Rust, Python, TypeScript) against a running cluster, each in a
# fresh database with the extension installed; each example asserts its own results.
#   scripts/examples.sh PORT [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:?port}
WORK=${2:-/tmp/syncular-test}
export PATH="$HOME/.cargo/bin:$PATH"
fresh_db() {
  psql -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -c "DROP DATABASE IF EXISTS $1" -c "CREATE DATABASE $1"
  psql -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d "$1" -c "CREATE EXTENSION syncular"
}
passed=0; failed=0
run() {
  local name=$1; shift
  echo "== example: $name"
  if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "example $name FAILED"; fi
}

fresh_db example_rust
run rust env SYNCULAR_EXAMPLE_URL="host=127.0.0.1 port=$PORT user=postgres dbname=example_rust" \
  cargo run --quiet --locked --manifest-path examples/rust/Cargo.toml

fresh_db example_python
if [ ! -x "$WORK/venv/bin/python" ]; then python3 -m venv "$WORK/venv"; fi
"$WORK/venv/bin/pip" install --quiet --disable-pip-version-check -r examples/python/requirements.txt
run python env SYNCULAR_EXAMPLE_URL="host=127.0.0.1 port=$PORT user=postgres dbname=example_python" \
  "$WORK/venv/bin/python" examples/python/host.py

fresh_db example_node
(cd examples/node && npm ci --no-audit --no-fund --silent && npx tsc -p .)
run node env SYNCULAR_EXAMPLE_URL="postgres://postgres@127.0.0.1:$PORT/example_node" node examples/node/dist/host.js

echo "examples: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
