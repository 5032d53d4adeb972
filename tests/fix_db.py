"""Real databases for the test suites, chosen by environment.

Order of preference for each engine:

0. with ``CAPGATE_TEST_DB=containers``, PostgreSQL and MariaDB always come from
   containers started through testcontainers, whatever DSN or local server there
   is (the path a user's CI takes; ``.ci/run`` runs the suites both ways).  The
   images are settings: ``CAPGATE_TEST_PG_IMAGE`` (default
   ``capgate-test/postgres:15``, PostgreSQL 15 with plpgsql_check) and
   ``CAPGATE_TEST_MARIADB_IMAGE`` (default ``capgate-test/mariadb:10.11``), which
   ``scripts/build-test-images`` builds from Debian's packages where no registry
   answers.  No Docker daemon, or an image that is not there and cannot be
   pulled, stops the run at once;
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

Containers.  Ryuk, testcontainers' reaper, is used when its image is here or can be
pulled; otherwise it is disabled for the session (``TESTCONTAINERS_RYUK_DISABLED=true``,
exported so that child processes, such as the CI example's pytest, do the same) and
the fixtures remove what they started: every container at the end of the session,
and at the start of the next one any container a killed session left behind (each
carries the label ``capgate.test.owner`` naming the process that started it).  How
long each container took to answer is printed at the end of the run.
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


PG_IMAGE = "capgate-test/postgres:15"
MARIADB_IMAGE = "capgate-test/mariadb:10.11"
CONTAINER_PASSWORD = "capgate"
OWNER_LABEL = "capgate.test.owner"
"""Label on every container the fixtures start: ``host:pid:start`` of the starting process."""
_STARTED: dict[str, float] = {}
"""Seconds each engine's container took from ``start()`` to answering."""
_DOCKER_READY: list[bool] = []


def containers_mode() -> bool:
    """Whether ``CAPGATE_TEST_DB=containers`` asks for containers instead of servers."""
    value = os.environ.get("CAPGATE_TEST_DB", "").strip().lower()
    if value in ("", "servers"):
        return False
    if value == "containers":
        return True
    pytest.exit(f"CAPGATE_TEST_DB={value!r}: expected 'containers' or 'servers'", returncode=3)


def image_for(engine: str) -> str:
    """The container image for ``engine``, from its setting."""
    if engine == "postgresql":
        return os.environ.get("CAPGATE_TEST_PG_IMAGE") or PG_IMAGE
    if engine == "mariadb":
        return os.environ.get("CAPGATE_TEST_MARIADB_IMAGE") or MARIADB_IMAGE
    return os.environ.get("CAPGATE_TEST_ORACLE_IMAGE") or "gvenzl/oracle-free:slim"


def process_token(pid: int) -> str:
    """``host:pid:start``: names one process, and not a later one that reuses its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        start = stat[stat.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        start = "?"
    return f"{socket.gethostname()}:{pid}:{start}"


def _owner_gone(token: str) -> bool:
    host, _, rest = token.partition(":")
    pid, _, _ = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine's, or not ours to judge
    return process_token(int(pid)) != token


def ensure_docker_session() -> None:
    """Once per session, before the first container: Ryuk or not, and leftovers removed.

    Ryuk stays on when its image is here or can be pulled.  Otherwise it is disabled
    (testcontainers would fail every start trying to pull it) and exported, so that
    child processes decide the same way; the fixtures then remove what they start.
    Containers left by a session that died (its process is gone) are removed now.

    Published ports are reached on this machine's loopback
    (``TESTCONTAINERS_CONNECTION_MODE=docker_host``, exported too): testcontainers
    takes a ``/.dockerenv`` file, which some machines have, for a sign that it runs
    inside a container, and would connect through the bridge's gateway address
    instead.  Set the variable yourself where the tests do run in a container.
    """
    if _DOCKER_READY:
        return
    import docker
    from testcontainers.core.config import ConnectionMode, testcontainers_config

    if "TESTCONTAINERS_CONNECTION_MODE" not in os.environ:
        testcontainers_config.connection_mode_override = ConnectionMode.docker_host
        os.environ["TESTCONTAINERS_CONNECTION_MODE"] = ConnectionMode.docker_host.value
    client = docker.from_env()
    try:
        if "TESTCONTAINERS_RYUK_DISABLED" not in os.environ:
            try:
                client.images.get(testcontainers_config.ryuk_image)
            except docker.errors.ImageNotFound:
                try:
                    client.images.pull(testcontainers_config.ryuk_image)
                except docker.errors.APIError:
                    testcontainers_config.ryuk_disabled = True
                    os.environ["TESTCONTAINERS_RYUK_DISABLED"] = "true"
        for leftover in client.containers.list(all=True, filters={"label": OWNER_LABEL}):
            if _owner_gone(leftover.labels.get(OWNER_LABEL, "")):
                with contextlib.suppress(docker.errors.APIError):
                    leftover.remove(force=True)
    finally:
        client.close()
    _DOCKER_READY.append(True)


def _require_image(image: str, hint: str) -> None:
    """The image is here, or can be pulled; else say so, and what to do (``hint``)."""
    import docker

    client = docker.from_env()
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        try:
            client.images.pull(image)
        except docker.errors.APIError as exc:
            raise RuntimeError(f"image {image} is not here and cannot be pulled "
                               f"({str(exc).splitlines()[0]}); {hint}") from exc
    finally:
        client.close()


def _start_container(engine: str) -> Server:
    ensure_docker_session()
    image = image_for(engine)
    labels = {OWNER_LABEL: process_token(os.getpid())}
    container: Any
    built_here = "build it with scripts/build-test-images, or name another image"
    if engine == "postgresql":
        _require_image(image, built_here)
        container = postgres_container_class()(
            image, username="postgres", password=CONTAINER_PASSWORD, dbname="test",
            driver="psycopg").with_kwargs(labels=labels)
    elif engine == "mariadb":
        _require_image(image, built_here)
        container = mysql_container_class()(
            image, username="root", password=CONTAINER_PASSWORD, dbname="test"
        ).with_kwargs(labels=labels)
    else:
        _require_image(image, "Oracle's image comes from a registry only; set "
                              "CAPGATE_TEST_ORACLE_DSN to an Oracle you have")
        container = oracle_container_class()(image).with_kwargs(labels=labels)
    began = time.monotonic()
    try:
        container.start()
    except BaseException:
        with contextlib.suppress(Exception):
            container.stop()  # created but never answered: remove it now
        raise
    _STARTED[engine] = time.monotonic() - began
    url = normalise_url(engine, container.get_connection_url())
    if url.host == "localhost":
        url = url.set(host="127.0.0.1")  # the published port listens on IPv4
    return Server(engine, url, container)


def postgres_container_class() -> Any:
    """testcontainers' ``PostgresContainer``, from where this version keeps it.

    4.x moved the modules under ``testcontainers.community``; the old path warns on
    import (an error under ``filterwarnings = error``) and stays only as a fallback.
    """
    try:
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from testcontainers.postgres import PostgresContainer
    return PostgresContainer


def mysql_container_class() -> Any:
    """testcontainers' ``MySqlContainer`` (it starts MariaDB images too), wherever it lives."""
    try:
        from testcontainers.community.mysql import MySqlContainer
    except ImportError:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from testcontainers.mysql import MySqlContainer
    return MySqlContainer


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
    if engine in LOCAL_DSN and containers_mode():
        return _container_server(engine)
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


def _container_server(engine: str) -> Server:
    """``CAPGATE_TEST_DB=containers``: the engine's container, or the run stops."""
    if not docker_available():
        pytest.exit(f"CAPGATE_TEST_DB=containers: no Docker daemon answers for {engine} "
                    f"(DOCKER_HOST or /var/run/docker.sock; scripts/start-docker starts one)",
                    returncode=3)
    try:
        server = _start_container(engine)
        _probe(server)
    except Exception as exc:
        pytest.exit(f"CAPGATE_TEST_DB=containers: {engine} container ({image_for(engine)}) "
                    f"did not start: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                    returncode=3)
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
    containers_mode()  # a misspelt CAPGATE_TEST_DB stops the run here
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
    """Remove every container this session started (``stop`` removes it)."""
    for server in _SERVERS.values():
        if server is not None and server.container is not None:
            container, server.container = server.container, None
            with contextlib.suppress(Exception):
                container.stop()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How long each container took to answer: the figure docs/ci/README.md quotes."""
    for engine, seconds in sorted(_STARTED.items()):
        terminalreporter.write_line(
            f"container {engine} ({image_for(engine)}) answered in {seconds:.1f} s")


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
