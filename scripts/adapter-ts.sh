#!/usr/bin/env bash
# The TypeScript storage adapter (adapters/typescript): `npm ci` from its lockfile, `tsc --strict`
# over the package, its tests and its benchmark, then its tests with node's test runner against
# a running cluster with the extension installed (each test file creates its own database and
# the roles ts_adapter_migrator / ts_adapter_server).
#   scripts/adapter-ts.sh PORT
set -euo pipefail
cd "$(dirname "$0")/../adapters/typescript"
PORT=${1:?port}
npm ci --no-audit --no-fund --silent
npx tsc -p .
out=$(mktemp)
status=0
# One test file at a time where node supports choosing (Debian 12's node 18 may not).
serial=()
if node --help | grep -q -- --test-concurrency; then serial=(--test-concurrency=1); fi
SYNCULAR_TS_PG="postgres://postgres@127.0.0.1:$PORT/postgres" \
  node --test "${serial[@]}" --test-reporter=spec dist/test/*.test.js >"$out" 2>&1 || status=$?
cat "$out"
pass=$(sed -n 's/^ℹ pass \([0-9]*\)$/\1/p' "$out")
fail=$(sed -n 's/^ℹ fail \([0-9]*\)$/\1/p' "$out")
rm -f "$out"
echo "adapter-ts: ${pass:-0} passed, ${fail:-1} failed"
[ "$status" -eq 0 ]
