#!/usr/bin/env bash
# Every test of syncular, from a fresh Debian 12 machine (as root) or a developer's:
#  0. `cargo fmt --check` and `cargo clippy` with warnings denied (both crates), every unsafe
#     block documented (`clippy::undocumented_unsafe_blocks`, `clippy::missing_safety_doc`);
# then, for each supported PostgreSQL major (15 and 18, scripts/pg.sh):
#  1. unit tests and in-backend #[pg_test]s: `cargo pgrx test pgNN` (runs as `postgres`);
#  2. the scenario suite (several real sessions, committed transactions, locks): installs the
#     extension, starts a throwaway cluster as `postgres` (a hot standby of it, and a second one
#     under a memory limit for the argument caps, a third preloading the library with the change
#     feed), and runs tests/multisession against them;
#  3. the walk-through scripts/demo.sql as a pg_regress test (tests/regress/expected/demo.out);
#  4. the scenario suite again on installs updated from 0.1.0;
# and once, on 15: 5. the client examples; 6. the TypeScript storage adapter's tests
# (adapters/typescript: npm ci, tsc --strict, the suite over node-postgres, upstream's node-postgres
# executor and upstream's Bun.SQL executor under bun; scripts/adapter-ts.sh); 7. where a
# Citus is installed, the Citus suite (scripts/citus.sh, tests/multisession/tests/citus.rs),
# else one line saying it was skipped.
# SYNCULAR_TEST_MAJORS="15" (or "18") limits the run to some majors.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/pg.sh
export PATH="$HOME/.cargo/bin:$PATH"
WORK=${SYNCULAR_TEST_DIR:-/tmp/syncular-test}
BASE_PORT=${SYNCULAR_TEST_PORT:-25439}
MAJORS=${SYNCULAR_TEST_MAJORS:-$SYNCULAR_MAJORS}

mkdir -p "$WORK"
chown postgres:postgres "$WORK" 2>/dev/null || true

LOG="$WORK/test-output.log"
: > "$LOG"

echo "== cargo fmt --check, cargo clippy"
cargo fmt --check
cargo fmt --check --manifest-path tests/multisession/Cargo.toml
cargo clippy --quiet -- -D warnings -D clippy::undocumented_unsafe_blocks -D clippy::missing_safety_doc
cargo clippy --manifest-path tests/multisession/Cargo.toml --all-targets --quiet -- -D warnings

CLUSTERS=()
trap 'for c in "${CLUSTERS[@]}"; do SYNCULAR_PG_MAJOR=${c%%:*} scripts/cluster.sh stop "${c#*:}"; done' EXIT

# suite MAJOR PORT: steps 1-4 against PostgreSQL MAJOR, clusters on PORT and PORT + 1.
suite() {
  local major=$1 port=$2
  local pg_config work="$WORK/pg$1"
  pg_config=$(pg_config_of "$major")
  mkdir -p "$work" && chown postgres:postgres "$work" 2>/dev/null || true
  export SYNCULAR_PG_MAJOR=$major SYNCULAR_TEST_PG_BIN
  SYNCULAR_TEST_PG_BIN=$(pg_bindir "$major")

  echo "== PostgreSQL $major: cargo pgrx test pg$major"
  cargo pgrx test "pg$major" --runas postgres --pgdata "$work/pgrx-data" 2>&1 | tee -a "$LOG"

  echo "== PostgreSQL $major: scenario suite against a throwaway cluster"
  install_extension "$pg_config"
  # Released install scripts, so older versions can be installed and updated (upgrade tests).
  cp sql/released/syncular--*.sql "$("$pg_config" --sharedir)/extension/"
  local cluster="$work/cluster" limited="$work/cluster-limited" standby="$work/cluster-standby"
  local promote="$work/cluster-promote" feed="$work/cluster-feed"
  CLUSTERS+=("$major:$standby" "$major:$promote" "$major:$cluster" "$major:$limited" "$major:$feed")
  scripts/cluster.sh fresh "$cluster" "$port"
  # Hot standbys of it, streaming from base backups: pulls served by a read replica, and one that
  # a test promotes, made anew before each run of the suite (tests/multisession/tests/standby.rs).
  scripts/cluster.sh standby "$standby" "$((port + 2))" "$port" 2>/dev/null
  export SYNCULAR_TEST_PG_STANDBY="host=127.0.0.1 port=$((port + 2)) user=postgres"
  export SYNCULAR_TEST_PG_PROMOTE="host=127.0.0.1 port=$((port + 3)) user=postgres"
  scripts/cluster.sh standby "$promote" "$((port + 3))" "$port" 2>/dev/null
  # A second cluster whose server processes run under a 1.5 GiB address-space limit: the
  # argument caps test (tests/multisession/tests/limits.rs) shows no argument can abort a
  # backend there.
  SYNCULAR_CLUSTER_MEMORY_KB=1572864 scripts/cluster.sh fresh "$limited" "$((port + 1))"
  export SYNCULAR_TEST_PG_LIMITED="host=127.0.0.1 port=$((port + 1)) user=postgres"
  # A cluster that preloads the library and runs the change feed for one database
  # (tests/multisession/tests/feed.rs).
  SYNCULAR_CLUSTER_FEED_DB=syncular_feed scripts/cluster.sh fresh "$feed" "$((port + 4))"
  "$(pg_bindir "$major")/psql" -X -q -h 127.0.0.1 -p "$((port + 4))" -U postgres -d postgres \
    -c "CREATE DATABASE syncular_feed"
  export SYNCULAR_TEST_PG_FEED="host=127.0.0.1 port=$((port + 4)) user=postgres"
  SYNCULAR_TEST_PG="host=127.0.0.1 port=$port user=postgres" \
    cargo test --manifest-path tests/multisession/Cargo.toml -- --test-threads=4 2>&1 | tee -a "$LOG"

  # The walk-through of the API (scripts/demo.sql) with its expected output: it cannot rot.
  echo "== PostgreSQL $major: demo walk-through (pg_regress)"
  mkdir -p "$work/regress" && chown postgres:postgres "$work/regress" 2>/dev/null || true
  if "$("$pg_config" --pkglibdir)/pgxs/src/test/regress/pg_regress" --inputdir=tests/regress \
       --outputdir="$work/regress" --bindir="$("$pg_config" --bindir)" --host=127.0.0.1 \
       --port="$port" --user=postgres --dbname=syncular_demo demo 2>&1 | tee -a "$LOG"; then
    echo "regress: 1 passed, 0 failed" | tee -a "$LOG"
  else
    cat "$work/regress/regression.diffs" 2>/dev/null || true
    echo "regress: 0 passed, 1 failed" | tee -a "$LOG"
    exit 1
  fi

  # The whole scenario suite again, on installs created at the first released version and
  # updated.
  echo "== PostgreSQL $major: scenario suite on an install updated from 0.1.0"
  scripts/cluster.sh standby "$promote" "$((port + 3))" "$port" 2>/dev/null
  "$(pg_bindir "$major")/psql" -X -q -h 127.0.0.1 -p "$port" -U postgres -d postgres \
    -c "DROP DATABASE IF EXISTS syncular_fixture"
  SYNCULAR_TEST_PG="host=127.0.0.1 port=$port user=postgres" SYNCULAR_TEST_UPGRADE_FROM=0.1.0 \
    cargo test --manifest-path tests/multisession/Cargo.toml -- --test-threads=4 2>&1 | tee -a "$LOG"
}

offset=0
for major in $MAJORS; do
  suite "$major" "$((BASE_PORT + offset))"
  offset=$((offset + 10))
done

if [[ " $MAJORS " == *" 15 "* ]]; then
  echo "== client examples (Rust, Python, TypeScript), PostgreSQL 15"
  scripts/examples.sh "$BASE_PORT" "$WORK" 2>&1 | tee -a "$LOG"
  echo "== TypeScript storage adapter (adapters/typescript), PostgreSQL 15"
  scripts/adapter-ts.sh "$BASE_PORT" 2>&1 | tee -a "$LOG"
  # Distributed by partition on Citus (issue 30, docs/SCALING.md), where a Citus is installed for
  # PostgreSQL 15: nothing of Citus is in this repository.
  if scripts/citus.sh available; then
    echo "== Citus (a coordinator and two workers), PostgreSQL 15"
    citus_port=$((BASE_PORT + 30))
    for i in 0 1 2; do CLUSTERS+=("15:$WORK/citus/node$i"); done
    scripts/citus.sh fresh "$WORK/citus" "$citus_port" citus_db
    SYNCULAR_TEST_CITUS="host=127.0.0.1 port=$citus_port user=postgres dbname=citus_db" \
      cargo test --manifest-path tests/multisession/Cargo.toml --test citus -- --ignored \
      --test-threads=1 2>&1 | tee -a "$LOG"
  else
    echo "citus: skipped, Citus is not installed for PostgreSQL 15 (tests/multisession/tests/citus.rs needs one; docs/SCALING.md)" | tee -a "$LOG"
  fi
fi

# One closing line over every runner (pipefail already failed the script on any red run).
awk '/^test result:/ { p += $4; f += $6 } /^(examples|regress|adapter-ts):/ { p += $2; f += $4 } END { printf "syncular: %d passed, %d failed\n", p, f; exit (f > 0 || p == 0) }' "$LOG"
