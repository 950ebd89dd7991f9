#!/bin/sh
# On the official image, its own entrypoint. On Debian's postgresql: initialise PGDATA on
# first start from POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB, as the official
# image does, then run the server in the foreground as the postgres user.
set -eu
if [ -x /usr/local/bin/docker-entrypoint.sh ]; then
    exec /usr/local/bin/docker-entrypoint.sh "$@"
fi
bin="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
export PATH="$bin:$PATH"
: "${PGDATA:=/var/lib/postgresql/data}"
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
# setpriv execs (no extra process), so postgres gets the container's signals itself.
as_postgres=""
if [ "$(id -u)" = 0 ]; then
    install -d -o postgres -g postgres -m 700 "$PGDATA"
    install -d -o postgres -g postgres -m 2775 /var/run/postgresql
    as_postgres="setpriv --reuid=postgres --regid=postgres --init-groups"
fi

# POSTGRES_PASSWORD_FILE, as the official image reads it: the compose file's secret.
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
    if [ -n "${POSTGRES_PASSWORD:-}" ]; then
        echo "POSTGRES_PASSWORD and POSTGRES_PASSWORD_FILE are both set: keep one" >&2
        exit 1
    fi
    if [ ! -r "$POSTGRES_PASSWORD_FILE" ]; then
        echo "POSTGRES_PASSWORD_FILE=$POSTGRES_PASSWORD_FILE cannot be read: put the password there (deploy/secrets/database_password)" >&2
        exit 1
    fi
    POSTGRES_PASSWORD="$(cat "$POSTGRES_PASSWORD_FILE")"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ -z "${POSTGRES_PASSWORD:-}" ]; then
        echo "POSTGRES_PASSWORD is not set: put it in deploy/secrets/database_password (POSTGRES_PASSWORD_FILE)" >&2
        exit 1
    fi
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chmod 0644 "$pwfile"
    $as_postgres initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" \
        --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    if [ "$db" != postgres ]; then
        $as_postgres postgres -D "$PGDATA" -c listen_addresses='' &
        pid=$!
        until $as_postgres pg_isready -q -U "$user"; do sleep 0.2; done
        $as_postgres psql -v ON_ERROR_STOP=1 -q -U "$user" -d postgres \
            -c "CREATE DATABASE \"$db\" OWNER \"$user\""
        kill -INT "$pid"
        wait "$pid" || true
    fi
fi

if [ "${1:-postgres}" = postgres ]; then
    [ "$#" -gt 0 ] && shift
    exec $as_postgres postgres -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
