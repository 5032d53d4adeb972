# PostgreSQL 15 with plpgsql_check, from Debian's packages, for the test suites
# (scripts/build-test-images).  It answers to the official image's settings
# (POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB, POSTGRES_HOST_AUTH_METHOD,
# PGDATA, /docker-entrypoint-initdb.d), so testcontainers' PostgresContainer and a
# GitHub Actions service container treat it as they treat `postgres:15`.
ARG BASE
FROM ${BASE}
# No cluster at install time: each container makes its own from its settings.
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql-common \
 && sed -ri 's/^#?\s*create_main_cluster\s*=.*/create_main_cluster = false/' \
      /etc/postgresql-common/createcluster.conf \
 && apt-get install -y --no-install-recommends postgresql-15 postgresql-15-plpgsql-check \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /docker-entrypoint-initdb.d /var/run/postgresql \
 && chown postgres:postgres /var/run/postgresql
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
STOPSIGNAL SIGINT
EXPOSE 5432
CMD ["postgres"]
