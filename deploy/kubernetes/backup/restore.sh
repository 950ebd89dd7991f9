#!/bin/sh
# Restore a dump made by backup.sh into a fresh, empty database:
#
#   restore.sh /backups/trainbot-20261206T031700Z.dump postgresql://trainbot@host:5432/trainbot_restored
#
# The target is the second argument, else RESTORE_DATABASE_URL (PGPASSWORD_FILE as for
# backup.sh). It refuses a database that already has tables, so a restore never mixes
# with live rows; the restore is one transaction: all of it or nothing.
set -eu

dump="${1:?usage: restore.sh DUMP_FILE [DATABASE_URL]}"
target="${2:-${RESTORE_DATABASE_URL:-}}"
if [ -z "$target" ]; then
  echo "restore: name the database to restore into (an argument or RESTORE_DATABASE_URL)" >&2
  exit 2
fi
if [ ! -r "$dump" ]; then
  echo "restore: cannot read $dump" >&2
  exit 2
fi
if [ -n "${PGPASSWORD_FILE:-}" ]; then
  PGPASSWORD="$(cat "$PGPASSWORD_FILE")"
  export PGPASSWORD
fi
target="$(printf '%s' "$target" | sed -E 's#^postgres(ql)?(\+[A-Za-z0-9_]+)?://#postgresql://#')"

tables="$(psql --no-psqlrc --tuples-only --no-align --dbname="$target" \
  --command="SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'")"
if [ "$tables" != "0" ]; then
  echo "restore: the target database already has $tables tables: restore into a fresh one (CREATE DATABASE …)" >&2
  exit 3
fi
pg_restore --exit-on-error --single-transaction --no-owner --no-privileges --dbname="$target" "$dump"
echo "restore: $dump restored"
