#!/usr/bin/env bash
# The official mariadb image's start-up contract, for Debian's MariaDB 10.11: on an
# empty data directory, install the system tables, start a server on the socket
# only, set the root password (MARIADB_ROOT_PASSWORD or MYSQL_ROOT_PASSWORD, or
# none with MARIADB_ALLOW_EMPTY_ROOT_PASSWORD / MYSQL_ALLOW_EMPTY_PASSWORD),
# create MARIADB_DATABASE / MYSQL_DATABASE and MARIADB_USER / MYSQL_USER with
# all rights on it, run /docker-entrypoint-initdb.d/*.sql and *.sh, stop it; then
# run the server on every address.
set -euo pipefail

first() { for v in "$@"; do [ -n "${!v:-}" ] && { printf '%s' "${!v}"; return; }; done; true; }
sql_string() { local s=${1//\\/\\\\}; printf "'%s'" "${s//\'/\\\'}"; }

if [ "${1:-}" = mariadbd ] && [ ! -d /var/lib/mysql/mysql ]; then
  root_pw=$(first MARIADB_ROOT_PASSWORD MYSQL_ROOT_PASSWORD)
  allow_empty=$(first MARIADB_ALLOW_EMPTY_ROOT_PASSWORD MYSQL_ALLOW_EMPTY_PASSWORD)
  if [ -z "$root_pw" ] && [ -z "$allow_empty" ]; then
    echo "error: set MARIADB_ROOT_PASSWORD (or MYSQL_ROOT_PASSWORD), or MARIADB_ALLOW_EMPTY_ROOT_PASSWORD" >&2
    exit 1
  fi
  db=$(first MARIADB_DATABASE MYSQL_DATABASE)
  user=$(first MARIADB_USER MYSQL_USER)
  password=$(first MARIADB_PASSWORD MYSQL_PASSWORD)
  mariadb-install-db --user=mysql --datadir=/var/lib/mysql --skip-test-db \
    --auth-root-authentication-method=normal > /dev/null
  mariadbd --user=mysql --skip-networking --socket=/run/mysqld/mysqld.sock &
  pid=$!
  for _ in $(seq 1 120); do
    mariadb --protocol=socket -uroot -e 'SELECT 1' > /dev/null 2>&1 && break
    sleep 0.5
  done
  {
    echo "SET SESSION sql_log_bin = 0;"
    echo "DELETE FROM mysql.global_priv WHERE user = '' OR host NOT IN ('localhost');"
    echo "SET PASSWORD FOR 'root'@'localhost' = PASSWORD($(sql_string "$root_pw"));"
    echo "CREATE USER 'root'@'%' IDENTIFIED BY $(sql_string "$root_pw");"
    echo "GRANT ALL ON *.* TO 'root'@'%' WITH GRANT OPTION;"
    if [ -n "$db" ]; then echo "CREATE DATABASE IF NOT EXISTS \`$db\`;"; fi
    if [ -n "$user" ]; then
      echo "CREATE USER $(sql_string "$user")@'%' IDENTIFIED BY $(sql_string "$password");"
      if [ -n "$db" ]; then echo "GRANT ALL ON \`$db\`.* TO $(sql_string "$user")@'%';"; fi
    fi
    echo "FLUSH PRIVILEGES;"
  } | mariadb --protocol=socket -uroot
  for f in /docker-entrypoint-initdb.d/*; do
    case "$f" in
      *.sql) mariadb --protocol=socket -uroot ${root_pw:+-p"$root_pw"} ${db:+"$db"} < "$f" ;;
      *.sh) . "$f" ;;
    esac
  done
  kill "$pid"
  wait "$pid"
  echo "MariaDB init process done. Ready for start up."
fi

if [ "${1:-}" = mariadbd ]; then
  shift
  exec mariadbd --user=mysql --bind-address=0.0.0.0 --port=3306 "$@"
fi
exec "$@"
