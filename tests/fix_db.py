"""Real databases for the test suites, chosen by environment.

Order of preference for each engine:

1. a DSN in the environment (``CAPGATE_TEST_PG_DSN``, ``CAPGATE_TEST_MARIADB_DSN``,
   ``CAPGATE_TEST_ORACLE_DSN``), as a SQLAlchemy URL or ``postgresql://`` style URL;
   else a server of the machine's own answering on the default port
   (PostgreSQL 127.0.0.1:5432 as ``postgres``, MariaDB 127.0.0.1:3306 as ``root``);
2. a container started with testcontainers when a Docker daemon answers;
3. otherwise the engine's tests are skipped -- unless the engine is listed in
   ``CAPGATE_REQUIRE_DBS`` (comma separated: ``postgresql,mariadb,oracle``), in
   which case the run stops at once with one clear message.

Each configured server is probed once per session.  Every test gets its own
fresh schema (PostgreSQL), database (MariaDB) or user (Oracle), dropped
afterwards; SQLite gets a file under the test's temp directory.

Fixtures: ``sqlite_url``, ``pg_url``, ``mariadb_url``, ``oracle_url`` (function
scoped, a URL to an empty place of one's own), ``pg_admin_url`` and friends
(session scoped, the server itself), and ``target_url`` parametrised over every
engine (SQLite, PostgreSQL, MariaDB, Oracle) for suites that run the same tests on each.

Every server test carries its engine's marker, so that ``-m "not postgresql and not
mariadb and not oracle"`` runs what needs no server: a parameter naming an engine is
``engine_param(engine)`` (``pytest.param`` with the marker), and a test that asks for
``pg_url``, ``oracle_url`` or another server fixture is marked at collection.

Oracle also gets a service with ``COMMIT_OUTCOME=TRUE`` (Transaction Guard), which
no default service has (``FREEPDB1`` included): ``CAPGATE_TEST_ORACLE_TG_SERVICE``
names one the DSN's database already has; otherwise the fixture creates and starts
``capgate_tg`` through the admin URL (``DBMS_SERVICE``, granted to DBA -- the
container's SYSTEM has it).  ``oracle_tg_url`` is a fresh user on that service.
When ``oracle`` is in ``CAPGATE_REQUIRE_DBS`` a missing Transaction Guard service
fails the run too; otherwise its tests skip and say why.  ``CAPGATE_TEST_ORACLE_IMAGE``
picks the container image (default ``gvenzl/oracle-free:slim``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

ENGINES = ("postgresql", "mariadb", "oracle")
LOCAL_DSN = {
    "postgresql": "postgresql://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql://root@127.0.0.1:3306/test",
}
ENV_DSN = {
    "postgresql": "CAPGATE_TEST_PG_DSN",
    "mariadb": "CAPGATE_TEST_MARIADB_DSN",
    "oracle": "CAPGATE_TEST_ORACLE_DSN",
}


SERVER_FIXTURES = {
    "pg_url": "postgresql", "pg_admin_url": "postgresql", "pg_ledger_url": "postgresql",
    "mariadb_url": "mariadb", "mariadb_admin_url": "mariadb",
    "oracle_url": "oracle", "oracle_admin_url": "oracle", "oracle_tg_url": "oracle",
}
"""Fixtures that need a server, and whose engine's marker a test using them gets."""


def engine_param(engine: str, *more: Any) -> Any:
    """A test parameter naming ``engine`` that carries the engine's marker.

    ``@pytest.fixture(params=engine_params("postgresql", "mariadb"))`` and
    ``parametrize("engine", engine_params(...))``: a plain string gave the server
    tests no marker, and ``-m "not mariadb"`` still ran ``test_x[mariadb]``.
    ``more``: further values of the same parameter set (its id stays the engine's
    when there are none).  SQLite, which needs no server, has no marker.
    """
    marks = [getattr(pytest.mark, engine)] if engine in ENGINES else []
    if more:
        return pytest.param(engine, *more, marks=marks)
    return pytest.param(engine, marks=marks, id=engine)


def engine_params(*engines: str) -> list[Any]:
    """``engine_param`` of each engine, for ``params=`` and ``parametrize``."""
    return [engine_param(engine) for engine in engines]


def required_engines() -> set[str]:
    raw = os.environ.get("CAPGATE_REQUIRE_DBS", "")
    return {e.strip().lower() for e in raw.split(",") if e.strip()}


def normalise_url(engine: str, dsn: str) -> URL:
    """Accept plain ``postgresql://`` / ``mysql://`` / ``oracle://`` URLs and pin our drivers."""
    url = make_url(dsn)
    driver = {"postgresql": "postgresql+psycopg", "mariadb": "mysql+pymysql",
              "oracle": "oracle+oracledb"}[engine]
    if url.drivername in ("mariadb", "mysql", "mariadb+pymysql"):
        url = url.set(drivername="mysql+pymysql")
    return url.set(drivername=driver)


def docker_available() -> bool:
    """Whether a Docker daemon answers ``/_ping`` (probed on its socket, closed after)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: Any = host[len("unix://"):]
        elif host.startswith("tcp://"):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            name, _, port = host[len("tcp://"):].partition(":")
            address = (name, int(port or 2375))
        else:
            return False
        with sock:
            sock.settimeout(3)
            sock.connect(address)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in sock.recv(64)
    except OSError:
        return False


@dataclass
class Server:
    engine: str
    url: URL
    container: Any = None
    tg_service: str | None = None
    """Oracle: a service with COMMIT_OUTCOME=TRUE on the same database (or None)."""
    tg_problem: str = ""
    """Oracle: why there is no such service."""


_SERVERS: dict[str, Server | None] = {}
_SKIP_REASON: dict[str, str] = {}


def _start_container(engine: str) -> Server:
    if engine == "postgresql":
        from testcontainers.postgres import PostgresContainer

        pgc = PostgresContainer("postgres:16", driver="psycopg").start()
        return Server(engine, normalise_url(engine, pgc.get_connection_url()), pgc)
    if engine == "mariadb":
        from testcontainers.mysql import MySqlContainer

        myc = MySqlContainer("mariadb:10.11", username="root", password="capgate",
                             dbname="test").start()
        return Server(engine, normalise_url(engine, myc.get_connection_url()), myc)
    image = os.environ.get("CAPGATE_TEST_ORACLE_IMAGE", "gvenzl/oracle-free:slim")
    orc = oracle_container_class()(image).start()
    return Server(engine, normalise_url(engine, orc.get_connection_url()), orc)


def oracle_container_class() -> Any:
    """testcontainers' ``OracleDbContainer``, from where this version keeps it.

    testcontainers 4.x moved it to ``testcontainers.community.oracle``; the old module
    still works but raises a DeprecationWarning on import, which ``filterwarnings =
    error`` turns into an exception (the Oracle suites then never got a container, and
    ``CAPGATE_REQUIRE_DBS=oracle`` exited 3).  The old path is only a fallback, for a
    testcontainers from before the move, with its warning silenced.
    """
    try:
        from testcontainers.community.oracle import OracleDbContainer
    except ImportError:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from testcontainers.oracle import OracleDbContainer
    return OracleDbContainer


TG_SERVICE = "capgate_tg"
TG_SETUP = f"""
DECLARE
  params DBMS_SERVICE.SVC_PARAMETER_ARRAY;
BEGIN
  params('commit_outcome') := 'true';
  params('retention_timeout') := '86400';
  BEGIN
    DBMS_SERVICE.CREATE_SERVICE(service_name => '{TG_SERVICE}', network_name => '{TG_SERVICE}',
                                parameter_array => params);
  EXCEPTION WHEN OTHERS THEN
    IF SQLCODE = -44303 THEN  -- the service exists: make sure it records outcomes
      DBMS_SERVICE.MODIFY_SERVICE(service_name => '{TG_SERVICE}', parameter_array => params);
    ELSE
      RAISE;
    END IF;
  END;
  BEGIN
    DBMS_SERVICE.START_SERVICE('{TG_SERVICE}');
  EXCEPTION WHEN OTHERS THEN
    IF SQLCODE != -44305 THEN RAISE; END IF;  -- already running
  END;
END;"""
"""A Transaction Guard service in the admin URL's database (DBMS_SERVICE needs DBA)."""


def _ltxid_on(url: URL) -> bool:
    """Whether a session on ``url`` gets a logical transaction id (Transaction Guard on)."""
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as conn:
            raw: Any = conn.connection.driver_connection
            return bool(raw.ltxid)
    finally:
        eng.dispose()


def _with_service(url: URL, service: str) -> URL:
    query = dict(url.query)
    query["service_name"] = service
    return url.set(query=query, database=None)


def ensure_tg_service(server: Server) -> None:
    """Find or create the Oracle service with COMMIT_OUTCOME; note why when there is none."""
    named = os.environ.get("CAPGATE_TEST_ORACLE_TG_SERVICE")
    service = named or TG_SERVICE
    problem = ""
    if not named:
        admin = sa.create_engine(server.url, poolclass=sa.pool.NullPool)
        try:
            with admin.connect() as conn:
                conn.exec_driver_sql(TG_SETUP)
                with contextlib.suppress(sa.exc.DBAPIError):  # not allowed inside a PDB
                    conn.exec_driver_sql("ALTER SYSTEM REGISTER")
        except sa.exc.DBAPIError as exc:
            problem = f"could not create {service} (DBMS_SERVICE): {str(exc.orig).splitlines()[0]}"
        finally:
            admin.dispose()
    if not problem:
        url = _with_service(server.url, service)
        deadline = time.monotonic() + 90  # the listener learns of a new service shortly
        while True:
            try:
                if _ltxid_on(url):
                    server.tg_service = service
                    return
                problem = f"service {service} gives no LTXID (COMMIT_OUTCOME is off)"
                break
            except Exception as exc:  # not registered with the listener yet
                problem = f"service {service} is unreachable: {str(exc).splitlines()[0]}"
                if time.monotonic() > deadline:
                    break
                time.sleep(3)
    server.tg_problem = problem
    if "oracle" in required_engines():
        pytest.exit(f"required database unavailable: oracle has no Transaction Guard service "
                    f"(CAPGATE_TEST_ORACLE_TG_SERVICE): {problem}", returncode=3)


def _local_answers(engine: str) -> bool:
    """A server of the machine's own on the default port (the fresh-machine case)."""
    try:
        _probe(Server(engine, normalise_url(engine, LOCAL_DSN[engine])))
        return True
    except Exception:
        return False


def _probe(server: Server) -> None:
    eng = sa.create_engine(server.url, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as conn:
            conn.execute(sa.text("SELECT 1 FROM dual" if server.engine == "oracle" else "SELECT 1"))
    finally:
        eng.dispose()


def server_for(engine: str) -> Server | None:
    """The session's server for ``engine``, probing it once; None if unavailable."""
    if engine in _SERVERS:
        return _SERVERS[engine]
    dsn = os.environ.get(ENV_DSN[engine])
    server: Server | None = None
    try:
        if dsn:
            server = Server(engine, normalise_url(engine, dsn))
        elif engine in LOCAL_DSN and _local_answers(engine):
            dsn = LOCAL_DSN[engine]
            server = Server(engine, normalise_url(engine, dsn))
        elif docker_available():
            server = _start_container(engine)
        else:
            _SKIP_REASON[engine] = f"{engine}: no {ENV_DSN[engine]} and no Docker daemon"
    except Exception as exc:  # a container that fails to start
        _fail_or_skip(engine, f"{engine}: could not start a container: {exc}")
    if server is not None:
        try:
            _probe(server)
        except Exception as exc:
            where = ENV_DSN[engine] if dsn else "the container"
            _fail_or_skip(
                engine,
                f"{engine} from {where} ({server.url.render_as_string(hide_password=True)}) "
                f"is unreachable: {type(exc).__name__}: {str(exc).splitlines()[0]}",
            )
            server = None
    if server is not None and engine == "oracle":
        ensure_tg_service(server)
    _SERVERS[engine] = server
    return server


def _fail_or_skip(engine: str, reason: str) -> None:
    _SKIP_REASON[engine] = reason
    if engine in required_engines():
        pytest.exit(f"required database unavailable: {reason}", returncode=3)


def require_server(engine: str) -> Server:
    server = server_for(engine)
    if server is None:
        reason = _SKIP_REASON.get(engine, f"{engine} unavailable")
        if engine in required_engines():
            pytest.fail(f"required database unavailable (CAPGATE_REQUIRE_DBS): {reason}")
        pytest.skip(reason)  # only engines not listed in CAPGATE_REQUIRE_DBS skip
    return server


def ensure_plpgsql_check(url: URL) -> None:
    """Create ``plpgsql_check`` in the database of ``url``, or skip (fail under CI).

    The PostgreSQL DDL suites verify stored code with it.  The server needs the
    extension's package (``postgresql-NN-plpgsql-check``, which
    ``scripts/install-test-extensions`` installs where it can); a server
    without it skips those tests, unless PostgreSQL is required.
    """
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with eng.begin() as conn:
            available = conn.execute(sa.text(
                "SELECT 1 FROM pg_available_extensions WHERE name = 'plpgsql_check'")).first()
            if available is not None:
                conn.execute(sa.text(
                    "SELECT pg_advisory_xact_lock(hashtext('capgate:plpgsql_check'))"))
                conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS plpgsql_check SCHEMA public"))
    finally:
        eng.dispose()
    if available is None:
        reason = ("the PostgreSQL server has no plpgsql_check extension; install "
                  "postgresql-NN-plpgsql-check (scripts/install-test-extensions does it)")
        if "postgresql" in required_engines():
            pytest.fail(f"required (CAPGATE_REQUIRE_DBS): {reason}")
        pytest.skip(reason)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Warm up: probe every required engine now, so an outage stops the run at once."""
    for engine in sorted(required_engines()):
        if engine not in ENGINES:
            pytest.exit(f"CAPGATE_REQUIRE_DBS names an unknown engine {engine!r}", returncode=3)
        if server_for(engine) is None:
            pytest.exit(
                f"required database unavailable: {_SKIP_REASON.get(engine, engine)}", returncode=3
            )


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that asks for a server fixture (``pg_url``...) gets that engine's marker."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        for fixture, engine in SERVER_FIXTURES.items():
            if fixture in names and item.get_closest_marker(engine) is None:
                item.add_marker(getattr(pytest.mark, engine))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for server in _SERVERS.values():
        if server is not None and server.container is not None:
            with contextlib.suppress(Exception):
                server.container.stop()


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


# --- per-test places ----------------------------------------------------------


@contextlib.contextmanager
def fresh_pg(server: Server) -> Iterator[URL]:
    schema = _unique("cgt")
    admin = sa.create_engine(server.url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        query = dict(server.url.query)
        query["options"] = f"-csearch_path={schema}"
        yield server.url.set(query=query)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@contextlib.contextmanager
def fresh_mariadb(server: Server) -> Iterator[URL]:
    db = _unique("cgt")
    admin = sa.create_engine(server.url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{db}`"))
    try:
        yield server.url.set(database=db)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{db}`"))
        admin.dispose()


@contextlib.contextmanager
def fresh_oracle(server: Server) -> Iterator[URL]:
    user = _unique("CGT").upper()
    password = uuid.uuid4().hex[:16]
    admin = sa.create_engine(server.url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(
            f'CREATE USER {user} IDENTIFIED BY "{password}" QUOTA UNLIMITED ON USERS'))
        conn.execute(sa.text(f"GRANT CREATE SESSION, CREATE TABLE, CREATE VIEW, CREATE PROCEDURE, "
                             f"CREATE TRIGGER, CREATE SEQUENCE TO {user}"))
    try:
        yield server.url.set(username=user, password=password)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP USER {user} CASCADE"))
        admin.dispose()


FRESH = {"postgresql": fresh_pg, "mariadb": fresh_mariadb, "oracle": fresh_oracle}


@pytest.fixture
def sqlite_url(tmp_path: Path) -> URL:
    return make_url(f"sqlite:///{tmp_path / 'target.db'}")


@pytest.fixture
def pg_admin_url() -> URL:
    return require_server("postgresql").url


@pytest.fixture
def mariadb_admin_url() -> URL:
    return require_server("mariadb").url


@pytest.fixture
def pg_url() -> Iterator[URL]:
    with fresh_pg(require_server("postgresql")) as url:
        yield url


@pytest.fixture
def pg_ledger_url() -> Iterator[URL]:
    """A second fresh PostgreSQL schema: a ledger beside a ``pg_url`` target, or shared
    by processes."""
    with fresh_pg(require_server("postgresql")) as url:
        yield url


@pytest.fixture
def mariadb_url() -> Iterator[URL]:
    with fresh_mariadb(require_server("mariadb")) as url:
        yield url


@pytest.fixture
def oracle_url() -> Iterator[URL]:
    with fresh_oracle(require_server("oracle")) as url:
        yield url


@pytest.fixture
def oracle_admin_url() -> URL:
    return require_server("oracle").url


@pytest.fixture
def oracle_tg_url() -> Iterator[URL]:
    """A fresh user reached through the service with COMMIT_OUTCOME (Transaction Guard)."""
    server = require_server("oracle")
    if server.tg_service is None:
        pytest.skip(f"oracle: no Transaction Guard service: {server.tg_problem}")
    with fresh_oracle(server) as url:
        yield _with_service(url, server.tg_service)


TARGET_ENGINES = ["sqlite", "postgresql", "mariadb", "oracle"]


@pytest.fixture(params=engine_params(*TARGET_ENGINES))
def target_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[URL]:
    """An empty target on each engine in turn: the same suite on every database.

    Oracle too, where one answers (``CAPGATE_TEST_ORACLE_DSN`` or a container);
    elsewhere its tests skip, unless ``CAPGATE_REQUIRE_DBS`` lists it.
    """
    engine = request.param
    if engine == "sqlite":
        yield make_url(f"sqlite:///{tmp_path / 'target.db'}")
        return
    with FRESH[engine](require_server(engine)) as url:
        yield url


@pytest.fixture(params=engine_params("sqlite", "postgresql"))
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[URL]:
    """A fresh ledger store on each backend: SQLite file and PostgreSQL schema."""
    if request.param == "sqlite":
        yield make_url(f"sqlite:///{tmp_path / 'ledger.db'}")
        return
    with fresh_pg(require_server("postgresql")) as url:
        yield url
