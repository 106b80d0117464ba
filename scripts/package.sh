#!/usr/bin/env bash
# Release packages for every supported PostgreSQL major (scripts/pg.sh) in one folder:
#   dist/syncular-<version>-pg<major>/   the files of `cargo pgrx package` (lib/*.so, share/extension/*)
#   dist/INSTALL.md                      how to install one of them
# Usage: scripts/package.sh [OUT_DIR]   (default: dist)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. scripts/pg.sh
export PATH="$HOME/.cargo/bin:$PATH"
OUT=$(realpath -m "${1:-dist}")
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
rm -rf "$OUT" && mkdir -p "$OUT"
for major in $SYNCULAR_MAJORS; do
  pg_config=$(pg_config_of "$major")
  dir="$OUT/syncular-$VERSION-pg$major"
  echo "== PostgreSQL $major: cargo pgrx package"
  cargo pgrx package --pg-config "$pg_config" --out-dir "$dir" >/dev/null
  # The released install scripts travel with the package, so older installs can be updated.
  ext_dir=$(find "$dir" -type d -path '*/extension' | head -1)
  cp sql/released/syncular--*.sql "$ext_dir/"
  (cd "$dir" && find . -type f | sort > FILES)
done
cat > "$OUT/INSTALL.md" <<NOTE
# Installing syncular $VERSION

One folder per PostgreSQL major: \`syncular-$VERSION-pg<major>/\`. Its tree mirrors the target
paths of that major's \`pg_config\` (\`--pkglibdir\` for \`syncular.so\`, \`--sharedir\`/extension
for the control file and SQL scripts); \`FILES\` lists them. As root:

    cp -r --remove-destination syncular-$VERSION-pg15/usr/. /usr/      # Debian/Ubuntu postgresql-15

\`--remove-destination\` matters on a running server: it replaces \`syncular.so\` with a new file
instead of rewriting the one live backends have mapped (a plain \`cp\` over it crashes them and
restarts the cluster). Backends that already loaded the library keep the old one until they
disconnect; new connections load the new one. The same holds for any copy tool: \`install\`,
or a copy to a temporary name and a \`mv\`, also give a new file.

For another layout, copy (\`install -m 755\`, never a plain \`cp\` over a live file)
\`lib/.../syncular.so\` into \`\$(pg_config --pkglibdir)\` and
\`share/.../extension/*\` into \`\$(pg_config --sharedir)/extension\`. Then, as a superuser:

    CREATE EXTENSION syncular;            -- a new database
    ALTER EXTENSION syncular UPDATE;      -- an install of an older version

Requirements: a superuser installs it (the extension creates event triggers, so it is not
\`trusted\` and cannot be installed on managed services that forbid them). Tested on PostgreSQL
15 and 18 (docs/SECURITY.md for the roles it creates).
NOTE
echo "packages in $OUT:"
ls "$OUT"
