#!/bin/sh
# trainbot's database backup: one pg_dump (custom format) into BACKUP_DIR, written under
# a temporary name, read back with pg_restore --list, then renamed, so a dump that
# exists is whole; the newest BACKUP_KEEP (default 14) are kept.
#
#   DATABASE_URL      postgresql://user@host:5432/db (TRAINBOT_DATABASE_URL works as it
#                     is; a +driver suffix is dropped), else libpq's PGHOST, PGUSER…
#   PGPASSWORD_FILE   a file holding the password (the database_password secret)
#   BACKUP_DIR        where the dumps go (a volume); BACKUP_KEEP how many stay
#
# Run by the CronJob in this directory and by compose's backup service; restore with
# restore.sh (README, "Backups and the restore drill").
set -eu

: "${BACKUP_DIR:?set BACKUP_DIR to the directory the dumps go to}"
keep="${BACKUP_KEEP:-14}"
case "$keep" in
  '' | *[!0-9]* | 0) echo "backup: BACKUP_KEEP must be a whole number of dumps, at least 1 (got '$keep')" >&2; exit 2 ;;
esac
if [ -n "${PGPASSWORD_FILE:-}" ]; then
  PGPASSWORD="$(cat "$PGPASSWORD_FILE")"
  export PGPASSWORD
fi
url="$(printf '%s' "${DATABASE_URL:-}" | sed -E 's#^postgres(ql)?(\+[A-Za-z0-9_]+)?://#postgresql://#')"

mkdir -p "$BACKUP_DIR"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
final="$BACKUP_DIR/trainbot-$stamp.dump"
partial="$BACKUP_DIR/.trainbot-$stamp.dump.partial"
trap 'rm -f "$partial"' EXIT

if [ -n "$url" ]; then
  pg_dump --format=custom --no-owner --no-privileges --file="$partial" --dbname="$url"
else
  pg_dump --format=custom --no-owner --no-privileges --file="$partial"
fi
pg_restore --list "$partial" > /dev/null
mv "$partial" "$final"

# The newest $keep dumps stay (their names sort by time).
count=0
for dump in $(ls -1 "$BACKUP_DIR" | grep -E '^trainbot-[0-9]{8}T[0-9]{6}Z\.dump$' | sort -r); do
  count=$((count + 1))
  if [ "$count" -gt "$keep" ]; then
    rm -f -- "$BACKUP_DIR/$dump"
  fi
done
echo "backup: $final ($(wc -c < "$final") bytes; $keep kept)"
