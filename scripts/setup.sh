#!/usr/bin/env bash
# Idempotent machine setup for building and testing syncular on Debian 12 as root:
# PostgreSQL 15 server + headers, libclang/clang, sudo, pkg-config, cargo-pgrx 0.18.0, and
# `cargo pgrx init` against the system PostgreSQL 15. Skips whatever is already there.
set -euo pipefail
PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config
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

if ! grep -qs '^pg15' "${PGRX_HOME:-$HOME/.pgrx}/config.toml"; then
  cargo pgrx init --pg15 "$PG_CONFIG" >/dev/null
fi
