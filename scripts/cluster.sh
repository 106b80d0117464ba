#!/usr/bin/env bash
# Throwaway PostgreSQL cluster run as the `postgres` OS user (PostgreSQL refuses root), of the
# major in SYNCULAR_PG_MAJOR (15 by default; scripts/pg.sh says where each major lives).
#   scripts/cluster.sh start DIR PORT   initdb if needed, start, wait until it accepts connections
#   scripts/cluster.sh stop DIR         stop it (fast shutdown), if running
#   scripts/cluster.sh fresh DIR PORT   stop and remove whatever is in DIR, then start anew
#   scripts/cluster.sh standby DIR PORT PRIMARY_PORT
#                                       remove whatever is in DIR, take a base backup of the cluster
#                                       on PRIMARY_PORT (pg_basebackup -R: a hot standby streaming
#                                       from it), start it on PORT, wait until it accepts connections
# Listens on 127.0.0.1 only; trust authentication (a throwaway test cluster, nothing else).
# With SYNCULAR_CLUSTER_FEED_DB set, a new cluster preloads the library and runs the change feed
# for that database (syncular.feed_database; docs/API.md "Change feed"), which the caller creates.
# With SYNCULAR_CLUSTER_MEMORY_KB set, every server process runs under that address-space limit
# (ulimit -v), so an allocation beyond it fails inside the server (the argument-cap test).
set -euo pipefail
. "$(dirname "$0")/pg.sh"
BIN=$(pg_bindir "${SYNCULAR_PG_MAJOR:-15}")
cmd=${1:?start|stop}; dir=${2:?cluster directory}
as_postgres() { if [ "$(id -u)" = 0 ]; then sudo -u postgres "$@"; else "$@"; fi; }
case "$cmd" in
  start)
    port=${3:?port}
    if [ ! -f "$dir/PG_VERSION" ]; then
      mkdir -p "$dir"
      [ "$(id -u)" = 0 ] && chown postgres:postgres "$dir"
      as_postgres "$BIN/initdb" -D "$dir" -U postgres --auth=trust --no-sync -E UTF8 --locale=C.UTF-8 >/dev/null
      cat >>"$dir/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
fsync = off
max_connections = 100
shared_preload_libraries = '${SYNCULAR_CLUSTER_FEED_DB:+pg_stat_statements,syncular}'
CONF
      if [ -n "${SYNCULAR_CLUSTER_FEED_DB:-}" ]; then
        printf "syncular.feed_database = '%s'\nmax_prepared_transactions = 2\n" \
          "$SYNCULAR_CLUSTER_FEED_DB" >>"$dir/postgresql.conf"
      fi
    fi
    # A port taken by any other process (the machine's own client connections use 32768-60999,
    # which is why the scripts' defaults lie below it) is named here rather than left to
    # pg_ctl's "could not start server".
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "cluster.sh: port $port on 127.0.0.1 is already in use; choose another (SYNCULAR_TEST_PORT, SYNCULAR_DEMO_PORT, BENCH_PORT)" >&2
      exit 1
    fi
    limit=${SYNCULAR_CLUSTER_MEMORY_KB:-unlimited}
    # RUST_BACKTRACE=1: the servers capture Rust backtraces, so a test sees one that would reach
    # a client (tests/multisession/tests/security.rs, a_caught_error_is_raised_again_…).
    if ! as_postgres env RUST_BACKTRACE=1 bash -c 'ulimit -v "$1" && exec "$2" -D "$3" -l "$3/server.log" -w -t 60 start' \
      _ "$limit" "$BIN/pg_ctl" "$dir" >/dev/null; then
      echo "cluster.sh: the server in $dir did not start on port $port; its log is $dir/server.log, ending:" >&2
      tail -n 20 "$dir/server.log" >&2 || true
      exit 1
    fi
    ;;
  stop)
    if [ -f "$dir/postmaster.pid" ]; then
      as_postgres "$BIN/pg_ctl" -D "$dir" -m fast -w stop >/dev/null || true
    fi
    ;;
  fresh)
    "$0" stop "$dir"
    rm -rf "$dir"
    "$0" start "$dir" "${3:?port}"
    ;;
  standby)
    port=${3:?port}; primary=${4:?primary port}
    # The primary keeps enough WAL for a standby that falls behind on a busy machine (no slot: a
    # promoted or removed standby must not make the primary keep WAL forever).
    as_postgres "$BIN/psql" -X -q -h 127.0.0.1 -p "$primary" -U postgres -d postgres \
      -c "ALTER SYSTEM SET wal_keep_size = '4GB'" -c "SELECT pg_reload_conf()" >/dev/null
    "$0" stop "$dir"
    rm -rf "$dir"
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres:postgres "$dir"
    chmod 700 "$dir"
    as_postgres "$BIN/pg_basebackup" -D "$dir" -h 127.0.0.1 -p "$primary" -U postgres -R -X stream --no-sync
    # The primary's settings came with the backup; these lines (last one wins) move the standby
    # to its own port and socket directory, and keep replay from cancelling a test's query on it
    # (a recovery conflict: the tests pause and resume replay on purpose).
    cat >>"$dir/postgresql.conf" <<CONF
port = $port
unix_socket_directories = '$dir'
hot_standby = on
hot_standby_feedback = on
max_standby_streaming_delay = -1
CONF
    rm -f "$dir/postmaster.pid" "$dir/server.log"
    "$0" start "$dir" "$port"
    ;;
  *) echo "usage: $0 start DIR PORT | stop DIR | fresh DIR PORT | standby DIR PORT PRIMARY_PORT" >&2; exit 2 ;;
esac
