# MariaDB 10.11 from Debian's packages, for the test suites (scripts/build-test-images).
# It answers to the official image's settings (MARIADB_/MYSQL_ROOT_PASSWORD,
# _ALLOW_EMPTY_ROOT_PASSWORD, _DATABASE, _USER, _PASSWORD, /docker-entrypoint-initdb.d),
# and like it logs "ready for connections" twice (the set-up server, then the real
# one), which is what testcontainers' MySqlContainer waits for.
ARG BASE
FROM ${BASE}
# The package's own data directory is emptied: each container makes its own from its settings.
RUN apt-get update \
 && apt-get install -y --no-install-recommends mariadb-server \
 && rm -rf /var/lib/apt/lists/* /var/lib/mysql \
 && mkdir -p /var/lib/mysql /run/mysqld /docker-entrypoint-initdb.d \
 && chown mysql:mysql /var/lib/mysql /run/mysqld
COPY mariadb-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
EXPOSE 3306
CMD ["mariadbd"]
