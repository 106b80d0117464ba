#!/usr/bin/env bash
# Every test of syncular, from a fresh Debian 12 machine (as root) or a developer's:
#  1. unit tests and in-backend #[pg_test]s: `cargo pgrx test pg15` (runs as `postgres`);
#  0. `cargo fmt --check` (both crates) and `cargo clippy` with warnings denied, every unsafe
#     block documented (`clippy::undocumented_unsafe_blocks`, `clippy::missing_safety_doc`);
#  2. the scenario suite (several real sessions, committed transactions, locks): installs the
#     extension into PostgreSQL 15, starts a throwaway cluster as `postgres` (and a second one
#     under a memory limit for the argument caps), and runs tests/multisession against them;
#  3. the walk-through scripts/demo.sql as a pg_regress test (tests/regress/expected/demo.out);
#  4. the scenario suite again on installs updated from 0.1.0; 5. the client examples.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
WORK=${SYNCULAR_TEST_DIR:-/tmp/syncular-test}
PORT=${SYNCULAR_TEST_PORT:-55439}

mkdir -p "$WORK"
chown postgres:postgres "$WORK" 2>/dev/null || true

LOG="$WORK/test-output.log"
: > "$LOG"

echo "== cargo fmt --check, cargo clippy"
cargo fmt --check
cargo fmt --check --manifest-path tests/multisession/Cargo.toml
cargo clippy --quiet -- -D warnings -D clippy::undocumented_unsafe_blocks -D clippy::missing_safety_doc

echo "== cargo pgrx test pg15"
cargo pgrx test pg15 --runas postgres --pgdata "$WORK/pgrx-data" 2>&1 | tee -a "$LOG"

echo "== scenario suite against a throwaway cluster"
cargo pgrx install --pg-config "$PG_CONFIG" >/dev/null
# Released install scripts, so older versions can be installed and updated (upgrade tests).
cp sql/released/syncular--*.sql "$("$PG_CONFIG" --sharedir)/extension/"
CLUSTER="$WORK/cluster"
# A second cluster whose server processes run under a 1.5 GiB address-space limit: the argument
# caps test (tests/multisession/tests/limits.rs) shows no argument can abort a backend there.
LIMITED="$WORK/cluster-limited"
LIMITED_PORT=$((PORT + 1))
trap 'scripts/cluster.sh stop "$CLUSTER"; scripts/cluster.sh stop "$LIMITED"' EXIT
scripts/cluster.sh fresh "$CLUSTER" "$PORT"
SYNCULAR_CLUSTER_MEMORY_KB=1572864 scripts/cluster.sh fresh "$LIMITED" "$LIMITED_PORT"
export SYNCULAR_TEST_PG_LIMITED="host=127.0.0.1 port=$LIMITED_PORT user=postgres"
SYNCULAR_TEST_PG="host=127.0.0.1 port=$PORT user=postgres" \
  cargo test --manifest-path tests/multisession/Cargo.toml -- --test-threads=4 2>&1 | tee -a "$LOG"

# The walk-through of the API (scripts/demo.sql) with its expected output: the demo cannot rot.
echo "== demo walk-through (pg_regress)"
mkdir -p "$WORK/regress" && chown postgres:postgres "$WORK/regress" 2>/dev/null || true
if "$("$PG_CONFIG" --pkglibdir)/pgxs/src/test/regress/pg_regress" --inputdir=tests/regress \
     --outputdir="$WORK/regress" --bindir="$("$PG_CONFIG" --bindir)" --host=127.0.0.1 \
     --port="$PORT" --user=postgres --dbname=syncular_demo demo 2>&1 | tee -a "$LOG"; then
  echo "regress: 1 passed, 0 failed" | tee -a "$LOG"
else
  cat "$WORK/regress/regression.diffs" 2>/dev/null || true
  echo "regress: 0 passed, 1 failed" | tee -a "$LOG"
  exit 1
fi

# The whole scenario suite again, on installs created at the first released version and updated.
echo "== scenario suite on an install updated from 0.1.0"
psql -X -q -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -c "DROP DATABASE IF EXISTS syncular_fixture"
SYNCULAR_TEST_PG="host=127.0.0.1 port=$PORT user=postgres" SYNCULAR_TEST_UPGRADE_FROM=0.1.0 \
  cargo test --manifest-path tests/multisession/Cargo.toml -- --test-threads=4 2>&1 | tee -a "$LOG"

echo "== client examples (Rust, Python, TypeScript)"
scripts/examples.sh "$PORT" "$WORK" 2>&1 | tee -a "$LOG"

# One closing line over every runner (pipefail already failed the script on any red run).
awk '/^test result:/ { p += $4; f += $6 } /^(examples|regress):/ { p += $2; f += $4 } END { printf "syncular: %d passed, %d failed\n", p, f; exit (f > 0 || p == 0) }' "$LOG"
