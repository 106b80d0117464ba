#!/usr/bin/env bash
# A throwaway Citus cluster for tests/multisession/tests/citus.rs, from a Citus already installed
# into PostgreSQL 15 (nothing of Citus is in this repository; docs/SCALING.md): a coordinator
# on PORT and two workers on PORT+1 and PORT+2, all on 127.0.0.1, each a scripts/cluster.sh
# cluster with shared_preload_libraries = 'citus, syncular', and a database DB with Citus on every node and
# the workers added to the coordinator.
#   scripts/citus.sh available          exit 0 if Citus is installed for PostgreSQL 15
#   scripts/citus.sh fresh DIR PORT DB  (re)create and start the three nodes
#   scripts/citus.sh stop DIR           stop them
set -euo pipefail
here=$(dirname "$0")
. "$here/pg.sh"
export SYNCULAR_PG_MAJOR=15
BIN=$(pg_bindir 15)
psql_on() { sudo -u postgres "$BIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$1" -U postgres -d "$2" -c "$3" >/dev/null; }
case "${1:?available|fresh|stop}" in
  available)
    [ -f "$("$BIN/pg_config" --pkglibdir)/citus.so" ] && [ -f "$("$BIN/pg_config" --sharedir)/extension/citus.control" ]
    ;;
  fresh)
    dir=${2:?dir}; port=${3:?port}; db=${4:?database}
    for i in 0 1 2; do
      node="$dir/node$i"
      "$here/cluster.sh" fresh "$node" "$((port + i))"
      psql_on "$((port + i))" postgres "ALTER SYSTEM SET shared_preload_libraries = citus, syncular"
      # Every database with Citus keeps a maintenance worker on every node, and the rebalancer's
      # moves run in background workers too: room for the suite's databases of their own.
      psql_on "$((port + i))" postgres "ALTER SYSTEM SET max_worker_processes = 32"
      "$here/cluster.sh" stop "$node"
      "$here/cluster.sh" start "$node" "$((port + i))"
      psql_on "$((port + i))" postgres "CREATE DATABASE $db"
      psql_on "$((port + i))" "$db" "CREATE EXTENSION citus"
    done
    psql_on "$port" "$db" "SELECT citus_set_coordinator_host('127.0.0.1', $port)"
    for i in 1 2; do
      psql_on "$port" "$db" "SELECT citus_add_node('127.0.0.1', $((port + i)))"
    done
    ;;
  stop)
    dir=${2:?dir}
    for i in 0 1 2; do "$here/cluster.sh" stop "$dir/node$i"; done
    ;;
  *) echo "usage: $0 available | fresh DIR PORT DB | stop DIR" >&2; exit 2 ;;
esac
