#!/usr/bin/env bash
# The official postgres image's start-up contract, for Debian's PostgreSQL 15:
# on an empty PGDATA, initdb with POSTGRES_USER / POSTGRES_PASSWORD, create
# POSTGRES_DB, run /docker-entrypoint-initdb.d/*.sql and *.sh on a server that
# listens on the socket only, stop it; then run the server on every address,
# password-checked (scram-sha-256) unless POSTGRES_HOST_AUTH_METHOD says otherwise.
set -euo pipefail

if [ "${1:-}" = postgres ] && [ "$(id -u)" = 0 ]; then
  mkdir -p "$PGDATA" /var/run/postgresql
  chown postgres:postgres "$PGDATA" /var/run/postgresql
  chmod 700 "$PGDATA"
  exec runuser -u postgres -- "$0" "$@"
fi

if [ "${1:-}" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
  user=${POSTGRES_USER:-postgres}
  db=${POSTGRES_DB:-$user}
  auth=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}
  if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$auth" != trust ]; then
    echo "error: POSTGRES_PASSWORD is not set (or set POSTGRES_HOST_AUTH_METHOD=trust)" >&2
    exit 1
  fi
  pwfile=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:-}" > "$pwfile"
  initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host="$auth" \
    --encoding=UTF8 --locale=C.UTF-8 ${POSTGRES_INITDB_ARGS:-} -D "$PGDATA"
  rm -f "$pwfile"
  printf '\nhost all all all %s\n' "$auth" >> "$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
  if [ "$db" != postgres ]; then
    psql -v ON_ERROR_STOP=1 --username "$user" --dbname postgres \
      --set db="$db" <<<'CREATE DATABASE :"db"'
  fi
  for f in /docker-entrypoint-initdb.d/*; do
    case "$f" in
      *.sql) psql -v ON_ERROR_STOP=1 --username "$user" --dbname "$db" -f "$f" ;;
      *.sh) . "$f" ;;
    esac
  done
  pg_ctl -D "$PGDATA" -m fast -w stop
  echo "PostgreSQL init process complete; ready for start up."
fi

if [ "${1:-}" = postgres ]; then
  shift
  exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
