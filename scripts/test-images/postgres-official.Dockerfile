# Where a registry is reachable: the official image, plus the plpgsql_check
# extension the PostgreSQL DDL suites verify stored code with (the official image
# has PGDG's apt source, which carries postgresql-15-plpgsql-check).
ARG BASE=postgres:15
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql-15-plpgsql-check \
 && rm -rf /var/lib/apt/lists/*
