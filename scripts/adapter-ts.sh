#!/usr/bin/env bash
# The TypeScript storage adapter (adapters/typescript): `npm ci` from its lockfile, `tsc --strict`
# over the package, its tests and its benchmark, then its tests against a running cluster with
# the extension installed (each test file creates its own database and the roles
# ts_adapter_migrator / ts_adapter_server), once per executor the adapter claims
# (docs/TYPESCRIPT.md, "Tests"):
#   pg-pool      node's test runner, a node-postgres Pool
#   pg-executor  node's test runner, upstream's PgExecutor over node-postgres
#   bun-sql      `bun test` (Bun 1.3.14 from the lockfile), upstream's PgExecutor over Bun.SQL
#   scripts/adapter-ts.sh PORT
set -euo pipefail
cd "$(dirname "$0")/../adapters/typescript"
PORT=${1:?port}
npm ci --no-audit --no-fund --silent
npx tsc -p .
export SYNCULAR_TS_PG="postgres://postgres@127.0.0.1:$PORT/postgres"
out=$(mktemp)
status=0
total_pass=0
total_fail=0
# One test file at a time where node supports choosing (Debian 12's node 18 may not).
serial=()
if node --help | grep -q -- --test-concurrency; then serial=(--test-concurrency=1); fi
for executor in pg-pool pg-executor bun-sql; do
  run=0
  if [ "$executor" = bun-sql ]; then
    SYNCULAR_TS_EXECUTOR=$executor node_modules/.bin/bun test ./dist/test/*.test.js >"$out" 2>&1 || run=$?
    cat "$out"
    pass=$(sed -n 's/^ *\([0-9]*\) pass$/\1/p' "$out")
    fail=$(sed -n 's/^ *\([0-9]*\) fail$/\1/p' "$out")
  else
    SYNCULAR_TS_EXECUTOR=$executor node --test "${serial[@]}" --test-reporter=spec dist/test/*.test.js >"$out" 2>&1 || run=$?
    cat "$out"
    pass=$(sed -n 's/^ℹ pass \([0-9]*\)$/\1/p' "$out")
    fail=$(sed -n 's/^ℹ fail \([0-9]*\)$/\1/p' "$out")
  fi
  # A run that printed no count (it did not start) is one failure.
  pass=${pass:-0}
  fail=${fail:-1}
  [ "$run" -ne 0 ] && [ "$fail" -eq 0 ] && fail=1
  echo "adapter-ts [$executor]: $pass passed, $fail failed"
  total_pass=$((total_pass + pass))
  total_fail=$((total_fail + fail))
  [ "$run" -eq 0 ] || status=$run
done
rm -f "$out"
echo "adapter-ts: $total_pass passed, $total_fail failed"
[ "$status" -eq 0 ]
