"""Ledger format 2 (issue 13): constant-size snapshots, the O(1) continuation check,
anchors that find a deleted or rolled-back case, and versioned, migrated tables.

On real SQLite files and PostgreSQL schemas.  The format-1 store the migration
upgrades was written by the format-1 code itself (``tests/data/ledger_v1``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, make_url

from capgate.cli import main
from capgate.executor.ledger import Anchor, Ledger, fold, open_ledger
from capgate.executor.ledger.chain import canonical_text
from capgate.executor.ledger.migrate import MIGRATIONS, head_of_scripts
from capgate.executor.ledger.schema import HEAD_REVISION, metadata
from capgate.registry.errors import AnchorMismatch, LedgerNotMigrated, LedgerTampered
from tests.fix_capgate import in_threads
from tests.fix_db import engine_params, fresh_pg, require_server

KEY = b"test-ledger-v2-key"
V1 = Path(__file__).resolve().parent / "data" / "ledger_v1"
V1_MANIFEST = json.loads((V1 / "manifest.json").read_text())
V1_KEY = str(V1_MANIFEST["hmac_key"]).encode()
CAPABILITIES = Path(__file__).resolve().parent.parent / "capabilities"


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CAPGATE_LEDGER_HMAC_KEY", raising=False)


@contextlib.contextmanager
def raw(url: URL | str) -> Iterator[Connection]:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            yield conn
    finally:
        engine.dispose()


def url_of(led: Ledger) -> URL:
    return led._url


def run_cli(tmp_path: Path, ledger: URL | str, *argv: str,
            env: dict[str, str] | None = None) -> tuple[int, Any]:
    url = ledger.render_as_string(hide_password=False) if isinstance(ledger, URL) else ledger
    config = tmp_path / "capgate.toml"
    config.write_text(f'[capgate]\nledger = "{url}"\ncapabilities = ["{CAPABILITIES}"]\n')
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([*argv, "--json", "--config", str(config)])
    text = out.getvalue().strip()
    return code, json.loads(text) if text else None


def settle(led: Ledger, case: str, n: int) -> None:
    for i in range(n):
        intent = f"i{i}"
        led.append(case, "prepared", {"state": {"operation_id": "op.x", "version": 1,
                                                "inputs": {"n": i}}}, intent_id=intent)
        led.append(case, "attempt_started", {"state": {"attempt": 1}}, intent_id=intent,
                   attempt=1)
        led.append(case, "observed", {"state": {"outcome": "applied_verified",
                                                "outcome_record": {"status": "applied_verified",
                                                                   "n": i}}},
                   intent_id=intent, attempt=1)


# --- constant-size snapshots -----------------------------------------------------------


def test_the_snapshot_does_not_grow_with_the_case(ledger_url: URL) -> None:
    with open_ledger(ledger_url) as led:
        settle(led, "long", 1)
        with raw(ledger_url) as conn:
            after_one = conn.execute(sa.text(
                "SELECT length(snapshot) FROM cg_cases WHERE case_id = 'long'")).scalar_one()
        settle(led, "long", 60)
        with raw(ledger_url) as conn:
            after_many = conn.execute(sa.text(
                "SELECT length(snapshot) FROM cg_cases WHERE case_id = 'long'")).scalar_one()
        # the same shape whatever the length: only the counters' digits and ids differ
        assert abs(after_many - after_one) < 16, (after_one, after_many)
        snap = led.snapshot("long") or {}
        assert snap["intents"] == {} and snap["intent_count"] == 61
        # a settled intent's outcome is read from its own events, by index
        assert led.outcome_of("long", "i7") == {"status": "applied_verified", "n": 7}
        assert led.intent("long", "i59")["status"] == "observed"
        assert led.verify().ok


def test_a_settled_outcome_edited_in_place_is_refused(ledger_url: URL) -> None:
    with open_ledger(ledger_url) as led:
        settle(led, "c", 3)
        (observed,) = [e for e in led.events("c", "i1") if e.kind == "observed"]
        payload = dict(observed.payload)
        payload["state"] = {**payload["state"], "outcome_record": {"status": "rolled_back"}}
        with raw(ledger_url) as conn:
            conn.execute(sa.text("UPDATE cg_events SET payload = :p WHERE case_id = 'c' "
                                 "AND seq = :s"), {"p": canonical_text(payload),
                                                   "s": observed.seq})
        with pytest.raises(LedgerTampered) as raised:
            led.outcome_of("c", "i1")
        assert raised.value.code == "CG410"
        assert led.outcome_of("c", "i2") == {"status": "applied_verified", "n": 2}


# --- the O(1) continuation check -------------------------------------------------------


class Statements:
    def __init__(self, engine: sa.Engine) -> None:
        self.seen: list[str] = []
        sa.event.listen(engine, "before_cursor_execute", self._on)

    def _on(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.strip().upper() not in ("BEGIN", "COMMIT", "ROLLBACK"):
            self.seen.append(statement)


def test_continuing_reads_one_statement_and_no_chain(ledger_url: URL) -> None:
    with open_ledger(ledger_url) as writer:
        settle(writer, "c", 40)
        writer.append("c", "prepared", {"state": {"k": 1}}, intent_id="open-one")
    with open_ledger(ledger_url) as fresh:  # nothing cached: the check itself runs
        seen = Statements(fresh.engine)
        state = fresh.verified_snapshot("c")
        assert state is not None and list(state["intents"]) == ["open-one"]
        assert len(seen.seen) == 1, seen.seen
        assert "head_seq" in seen.seen[0] and "JOIN" in seen.seen[0].upper()


@pytest.mark.parametrize("edit", ["snapshot", "snapshot_and_state_digest", "head_event"])
def test_an_edited_continuation_point_refuses_the_call(ledger_url: URL, edit: str) -> None:
    with open_ledger(ledger_url) as led:
        settle(led, "c", 2)
        led.append("c", "prepared", {"state": {"k": 1}}, intent_id="open-one")
        snap = led.snapshot("c") or {}
        head = led.events("c")[-1]
    forged = {**snap, "intents": {}}  # the open intent "finished" by hand
    with raw(ledger_url) as conn:
        if edit in ("snapshot", "snapshot_and_state_digest"):
            conn.execute(sa.text("UPDATE cg_cases SET snapshot = :s WHERE case_id = 'c'"),
                         {"s": canonical_text(forged)})
        if edit == "snapshot_and_state_digest":
            from capgate.executor.ledger import state_digest
            conn.execute(sa.text("UPDATE cg_events SET state_digest = :d WHERE case_id = 'c' "
                                 "AND seq = :s"), {"d": state_digest(forged), "s": head.seq})
        if edit == "head_event":
            conn.execute(sa.text("UPDATE cg_events SET kind = 'observed' WHERE case_id = 'c' "
                                 "AND seq = :s"), {"s": head.seq})
    with open_ledger(ledger_url) as fresh, pytest.raises(LedgerTampered) as raised:
        fresh.verified_snapshot("c")
    assert raised.value.code == "CG410"


def test_a_consistent_rewrite_of_the_head_needs_the_key(ledger_url: URL) -> None:
    """Snapshot, head event and head digest rewritten together: only the MAC tells."""
    from capgate.executor.ledger import event_digest, state_digest

    with open_ledger(ledger_url, hmac_key=KEY) as led:
        settle(led, "c", 1)
        led.append("c", "prepared", {"state": {"k": 1}}, intent_id="open-one")
        head = led.events("c")[-1]
        snap = led.snapshot("c") or {}
    forged = {**snap, "intents": {}}
    sd = state_digest(forged)
    digest = event_digest(case_id="c", seq=head.seq, kind=head.kind, intent_id=head.intent_id,
                          payload=head.payload, prev_digest=head.prev_digest,
                          recorded_at=head.recorded_at, state_digest=sd)
    forged["head_digest"] = digest
    with raw(ledger_url) as conn:
        conn.execute(sa.text("UPDATE cg_events SET state_digest = :sd, digest = :d "
                             "WHERE case_id = 'c' AND seq = :s"),
                     {"sd": sd, "d": digest, "s": head.seq})
        conn.execute(sa.text("UPDATE cg_cases SET snapshot = :snap, head_digest = :d "
                             "WHERE case_id = 'c'"), {"snap": canonical_text(forged), "d": digest})
    with open_ledger(ledger_url) as keyless:
        assert keyless.verified_snapshot("c") is not None  # undetectable without the key
    with open_ledger(ledger_url, hmac_key=KEY) as signed, pytest.raises(LedgerTampered):
        signed.verified_snapshot("c")


# --- anchors -------------------------------------------------------------------------


def _copy_case(conn: Connection, case: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = [dict(r._mapping) for r in conn.execute(
        sa.text("SELECT * FROM cg_events WHERE case_id = :c ORDER BY seq"), {"c": case})]
    head = dict(conn.execute(sa.text("SELECT * FROM cg_cases WHERE case_id = :c"),
                             {"c": case}).one()._mapping)
    return rows, head


def _restore_case(conn: Connection, case: str, rows: list[dict[str, Any]],
                  head: dict[str, Any]) -> None:
    conn.execute(sa.text("DELETE FROM cg_events WHERE case_id = :c"), {"c": case})
    conn.execute(sa.text("DELETE FROM cg_cases WHERE case_id = :c"), {"c": case})
    for r in rows:
        conn.execute(sa.insert(metadata.tables["cg_events"]).values(**r))
    conn.execute(sa.insert(metadata.tables["cg_cases"]).values(**head))


def test_an_anchor_finds_a_deleted_case_and_a_rolled_back_one(ledger_url: URL,
                                                             tmp_path: Path) -> None:
    with open_ledger(ledger_url, hmac_key=KEY) as led:
        settle(led, "keep", 2)
        settle(led, "gone", 2)
        settle(led, "back", 1)
        with raw(ledger_url) as conn:
            old_rows, old_head = _copy_case(conn, "back")  # a validly signed older copy
        settle(led, "back", 3)
        anchor = led.anchor()
        assert anchor.cases == 3 and anchor.mac is not None and led.verify().ok
        exported = tmp_path / "anchor.json"
        exported.write_text(json.dumps(anchor.to_dict()))
        with raw(ledger_url) as conn:
            for table in ("cg_events", "cg_cases"):
                conn.execute(sa.text(f"DELETE FROM {table} WHERE case_id = 'gone'"))
            _restore_case(conn, "back", old_rows, old_head)
        # every remaining chain verifies on its own, signed heads and all ...
        assert all(f.kind in ("case_deleted", "case_rolled_back") for f in led.verify().findings)
        # ... and the anchor in the store names both
        report = led.verify()
        assert {(f.case_id, f.kind) for f in report.findings} == {
            ("gone", "case_deleted"), ("back", "case_rolled_back")}
        # the exported anchor too, even after the store's own anchors are deleted
        with raw(ledger_url) as conn:
            conn.execute(sa.text("DELETE FROM cg_anchors"))
        outside = Anchor.from_dict(json.loads(exported.read_text()))
        kinds = {(f.case_id, f.kind) for f in led.verify(anchor=outside).findings}
        assert ("gone", "case_deleted") in kinds and ("back", "case_rolled_back") in kinds
        assert ("(ledger)", "anchor_broken") in kinds  # the store no longer records it


def test_anchor_cli_and_an_edited_anchor_file(ledger_url: URL, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPGATE_LEDGER_HMAC_KEY", KEY.decode())
    with open_ledger(ledger_url) as led:
        settle(led, "a", 1)
    out = tmp_path / "anchor.json"
    code, payload = run_cli(tmp_path, ledger_url, "ledger", "anchor", "--out", str(out))
    assert code == 0 and payload["cases"] == 1 and out.exists()
    code, payload = run_cli(tmp_path, ledger_url, "ledger", "verify", "--anchor", str(out))
    assert code == 0 and payload["ok"], payload
    edited = json.loads(out.read_text())
    edited["heads"]["a"][0] = 0  # claim the case was shorter
    out.write_text(json.dumps(edited))
    code, payload = run_cli(tmp_path, ledger_url, "ledger", "verify", "--anchor", str(out))
    assert code != 0 and {f["kind"] for f in payload["findings"]} == {"anchor_broken"}
    out.write_text("{not json")
    with pytest.raises(AnchorMismatch):
        Anchor.from_dict({"format": "other"})
    code, payload = run_cli(tmp_path, ledger_url, "ledger", "verify", "--anchor", str(out))
    assert code == 2 and payload["code"] == "CG415"


# --- versioned tables ------------------------------------------------------------------


def test_the_migrations_head_is_what_the_code_writes() -> None:
    assert head_of_scripts() == HEAD_REVISION
    assert (MIGRATIONS / "env.py").exists()


def _columns(conn: Connection) -> dict[str, Any]:
    inspector = sa.inspect(conn)
    out: dict[str, Any] = {}
    for table in sorted(t for t in inspector.get_table_names() if t.startswith("cg_")):
        out[table] = {
            "columns": sorted((c["name"], str(c["type"]).split("(")[0], bool(c["nullable"]))
                              for c in inspector.get_columns(table)),
            "pk": sorted(inspector.get_pk_constraint(table)["constrained_columns"]),
            "indexes": sorted((i["name"], tuple(i["column_names"]))
                              for i in inspector.get_indexes(table)),
        }
    return out


def test_migrating_an_empty_store_builds_the_same_tables(ledger_url: URL, tmp_path: Path) -> None:
    """The migrations alone build exactly the tables a fresh store is created with."""
    from alembic import command
    from alembic.config import Config

    with open_ledger(ledger_url):
        pass
    with raw(ledger_url) as conn:
        created = _columns(conn)
    other = (make_url(f"sqlite:///{tmp_path / 'migrated.db'}")
             if ledger_url.get_backend_name() == "sqlite" else None)
    with contextlib.ExitStack() as stack:
        if other is None:
            other = stack.enter_context(fresh_pg(require_server("postgresql")))
        engine = sa.create_engine(other)
        with engine.begin() as conn:
            config = Config()
            config.set_main_option("script_location", str(MIGRATIONS))
            config.attributes["connection"] = conn
            command.upgrade(config, "head")
            migrated = _columns(conn)
            version = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
        engine.dispose()
    assert version == HEAD_REVISION
    assert migrated == created


def _v1_sqlite(tmp_path: Path) -> URL:
    target = tmp_path / "ledger-v1.db"
    shutil.copy(V1 / "ledger.db", target)
    return make_url(f"sqlite:///{target}")


@contextlib.contextmanager
def _v1_postgresql() -> Iterator[URL]:
    from alembic import command
    from alembic.config import Config

    with fresh_pg(require_server("postgresql")) as url:
        engine = sa.create_engine(url)
        with engine.begin() as conn:  # the format-1 tables exactly as format 1 made them
            config = Config()
            config.set_main_option("script_location", str(MIGRATIONS))
            config.attributes["connection"] = conn
            command.upgrade(config, "0001_ledger_v1")
            conn.exec_driver_sql("DROP TABLE alembic_version")  # format 1 had none
            for line in (V1 / "postgresql.sql").read_text().splitlines():
                if line.strip():
                    conn.exec_driver_sql(line.replace("%", "%%"))
        engine.dispose()
        yield url


@contextlib.contextmanager
def _v1_store(backend: str, tmp_path: Path) -> Iterator[URL]:
    if backend == "sqlite":
        yield _v1_sqlite(tmp_path)
    else:
        with _v1_postgresql() as url:
            yield url


def _fingerprint(url: URL) -> str:
    with raw(url) as conn:
        rows = [repr(sorted(dict(r._mapping).items(), key=repr)) for t in (
            "cg_events", "cg_cases", "cg_idempotency", "cg_approvals")
            for r in conn.execute(sa.text(f"SELECT * FROM {t}"))]
    return hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()


@pytest.mark.parametrize("backend", engine_params("sqlite", "postgresql"))
def test_a_format_1_ledger_is_refused_then_migrated(backend: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPGATE_LEDGER_HMAC_KEY", V1_KEY.decode())
    with _v1_store(backend, tmp_path) as url:
        before = _fingerprint(url)
        with pytest.raises(LedgerNotMigrated) as refused:
            open_ledger(url)
        assert refused.value.code == "CG414" and "capgate ledger migrate" in refused.value.message
        code, payload = run_cli(tmp_path, url, "cases")
        assert code == 2 and payload["code"] == "CG414"
        assert _fingerprint(url) == before, "a refused store is left exactly as it was"

        code, payload = run_cli(tmp_path, url, "ledger", "migrate")
        assert code == 0, payload
        assert payload["before"] == "0001_ledger_v1" and payload["after"] == HEAD_REVISION
        assert payload["cases_rewritten"] == len(V1_MANIFEST["cases"])
        code, payload = run_cli(tmp_path, url, "ledger", "migrate")
        assert code == 0 and payload["cases_rewritten"] == 0  # idempotent

        with open_ledger(url) as led:
            report = led.verify()
            assert report.ok and report.mac_checked, report.findings
            # (the manifest is the SQLite run's; the PostgreSQL run has its own intent ids)
            for case_id, want in V1_MANIFEST["cases"].items():
                states = led.intents(case_id)
                assert sorted((s["status"], s.get("outcome")) for s in states.values()) == \
                    sorted((w["status"], w["outcome"]) for w in want["intents"].values()), case_id
                snap = led.snapshot(case_id) or {}
                open_now = sorted(s["status"] for s in states.values()
                                  if s["status"] not in ("observed", "reconciled",
                                                         "escalation_resolved"))
                assert sorted(s["status"] for s in snap["intents"].values()) == open_now
                assert snap["intent_count"] == len(want["intents"])
            assert {c.case_id for c in led.cases(open_only=True)} == {
                c for c, w in V1_MANIFEST["cases"].items() if w["open"]}
            # a format-1 case continues in format 2: a mixed chain that still verifies
            led.append("V1-APPLIED", "note", {"case_state": {"migrated": True}})
            assert led.verify("V1-APPLIED").ok
            assert led.verified_snapshot("V1-APPLIED") is not None
            assert led.events("V1-APPLIED")[0].state_digest is None
            assert led.events("V1-APPLIED")[-1].state_digest is not None


def test_a_tampered_format_1_ledger_is_not_laundered(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPGATE_LEDGER_HMAC_KEY", V1_KEY.decode())
    url = _v1_sqlite(tmp_path)
    with raw(url) as conn:  # an open intent "finished" by hand in the format-1 snapshot
        text = conn.execute(sa.text(
            "SELECT snapshot FROM cg_cases WHERE case_id = 'V1-OPEN'")).scalar_one()
        snap = json.loads(text)
        for state in snap["intents"].values():
            state["status"] = "observed"
        conn.execute(sa.text("UPDATE cg_cases SET snapshot = :s WHERE case_id = 'V1-OPEN'"),
                     {"s": canonical_text(snap)})
    before = _fingerprint(url)
    code, payload = run_cli(tmp_path, url, "ledger", "migrate")
    assert code != 0 and payload["code"] == "CG410" and "V1-OPEN" in payload["message"]
    assert _fingerprint(url) == before
    with pytest.raises(LedgerNotMigrated):
        open_ledger(url)


def test_a_store_from_a_newer_capgate_is_refused(ledger_url: URL) -> None:
    with open_ledger(ledger_url):
        pass
    with raw(ledger_url) as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0099_from_the_future'"))
    with pytest.raises(LedgerNotMigrated, match="newer capgate"):
        open_ledger(ledger_url)
    with open_ledger(ledger_url, migrating=True) as led, \
            pytest.raises(LedgerNotMigrated, match="newer capgate"):
        led.migrate()


def test_fold_of_a_migrated_case_is_its_snapshot(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPGATE_LEDGER_HMAC_KEY", V1_KEY.decode())
    url = _v1_sqlite(tmp_path)
    with open_ledger(url, migrating=True) as led:
        led.migrate()
    with open_ledger(url) as led:
        for case_id in V1_MANIFEST["cases"]:
            assert led.snapshot(case_id) == fold(led.events(case_id))
        assert uuid.UUID(str(next(iter(led.intents("V1-OPEN")))))


# --- serialising once gives the very bytes of serialising whole -------------------------


def test_digests_from_parts_are_the_canonical_digests() -> None:
    """The hot path builds event digests and snapshots from canonical parts; a property
    test holds them to the plain, whole-object functions (RFC 8785 bytes)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from capgate.executor.ledger.chain import (
        event_digest,
        event_digest_of_text,
        snapshot_text,
        state_digest,
        state_parts,
    )

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**53) + 1, 2**53 - 1),
                        st.floats(min_value=-1e15, max_value=1e15, allow_nan=False),
                        st.text(max_size=12))
    json_values = st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
        max_leaves=20)

    @settings(max_examples=300, deadline=None)
    @given(payload=st.dictionaries(st.text(max_size=8), json_values, max_size=5),
           intents=st.dictionaries(st.text(min_size=1, max_size=6),
                                   st.dictionaries(st.text(max_size=5), json_values,
                                                   max_size=3), max_size=3),
           intent=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
           sd=st.one_of(st.none(), st.just("sha256:" + "a" * 64)))
    def check(payload: dict[str, Any], intents: dict[str, Any], intent: str | None,
              sd: str | None) -> None:
        text = canonical_text(payload)
        fields = {"case_id": "c\u00e9", "seq": 7, "kind": "observed", "intent_id": intent,
                  "prev_digest": "sha256:" + "0" * 64, "recorded_at": "2026-12-01T00:00:00Z",
                  "state_digest": sd}
        assert event_digest_of_text(payload_text=text, **fields) == event_digest(
            payload=json.loads(text), **fields)
        state = {"case_id": "c", "head_seq": 3, "head_digest": "d", "case": payload,
                 "intents": intents, "intent_count": 2, "last": {"intent_id": intent}}
        parts, digest = state_parts(state)
        assert digest == state_digest(state)
        assert snapshot_text(state, parts) == canonical_text(state)

    check()


# --- many cases, one commit (issue 13, item 4: resume in bulk) ---------------------------


def _open(led: Ledger, case: str) -> None:
    led.append(case, "prepared", {"state": {"operation_id": "op.x", "version": 1}},
               intent_id="i0")


def test_append_each_records_what_one_append_each_would(ledger_url: URL) -> None:
    """The same chains, snapshots and heads as separate appends; every case verifies."""
    with open_ledger(ledger_url) as led:
        cases = [f"bulk-{i:03d}" for i in range(30)]
        for case in cases:
            _open(led, case)
            _open(led, "one-" + case)
        items = [(case, "reconciled", {"state": {"outcome": "applied", "n": i}}, "i0")
                 for i, case in enumerate(cases)]
        written = led.append_each(items, chunk=7)  # several chunks, sorted inside each
        for (case, kind, payload, intent), event in zip(items, sorted(
                written, key=lambda e: e.case_id), strict=True):
            one = led.append("one-" + case, kind, payload, intent_id=intent)
            assert (event.case_id, event.seq, event.kind, event.payload) == (
                case, one.seq, one.kind, one.payload)
            assert led.snapshot(case)["intents"] == led.snapshot("one-" + case)["intents"] == {}
        report = led.verify()
        assert report.ok, report
        # a case's several events: in the order given, in the one transaction of its chunk
        pair = led.append_each([(cases[0], "recovery_point", {"n": 1}, None),
                                (cases[1], "recovery_point", {"n": 1}, None),
                                (cases[0], "continuation", {"n": 2}, None)])
        assert [(e.case_id, e.kind) for e in pair] == [
            (cases[0], "recovery_point"), (cases[0], "continuation"),
            (cases[1], "recovery_point")]
        assert [e.kind for e in led.events(cases[0])][-2:] == ["recovery_point",
                                                                "continuation"]
        assert pair[1].seq == pair[0].seq + 1
        assert led.verify().ok


def test_append_each_falls_back_to_one_by_one_and_refuses_an_edited_case(
        ledger_url: URL) -> None:
    """A case whose head was edited fails the batch: the others are still recorded one by
    one (each exactly once), and the edited case is refused as a single append would be."""
    with open_ledger(ledger_url) as led:
        for case in ("a", "b", "c"):
            _open(led, case)
    with raw(ledger_url) as conn:  # edit b's snapshot: its continuation check must fail
        conn.execute(sa.text("UPDATE cg_cases SET snapshot = replace(snapshot, 'op.x', "
                             "'op.y') WHERE case_id = 'b'"))
    with open_ledger(ledger_url) as led:
        items = [(c, "reconciled", {"state": {"outcome": "applied"}}, "i0") for c in "abc"]
        with pytest.raises(LedgerTampered):
            led.append_each(items)
        assert [e.kind for e in led.events("a")] == ["prepared", "reconciled"]
        assert [e.kind for e in led.events("b")] == ["prepared"]


def test_append_each_can_skip_what_a_best_effort_writer_would_not_raise(
        ledger_url: URL) -> None:
    """``skip``: the edited case's event is left out; every other case's is recorded once."""
    with open_ledger(ledger_url) as led:
        for case in ("a", "b", "c"):
            _open(led, case)
    with raw(ledger_url) as conn:
        conn.execute(sa.text("UPDATE cg_cases SET snapshot = replace(snapshot, 'op.x', "
                             "'op.y') WHERE case_id = 'b'"))
    with open_ledger(ledger_url) as led:
        items = [(c, "reconciled", {"state": {"outcome": "applied"}}, "i0") for c in "abc"]
        written = led.append_each(items, skip=(LedgerTampered,))
        assert sorted(e.case_id for e in written) == ["a", "c"]
        assert [e.kind for e in led.events("a")] == ["prepared", "reconciled"]
        assert [e.kind for e in led.events("b")] == ["prepared"]
        assert [e.kind for e in led.events("c")] == ["prepared", "reconciled"]


def test_intents_many_is_intents_of_each_case(ledger_url: URL) -> None:
    """Resume reads back a thousand settled cases at once: the same states as one by one,
    an unknown case empty, and a payload that is not JSON refused as tampering."""
    with open_ledger(ledger_url) as led:
        cases = [f"m-{i:02d}" for i in range(12)]
        for i, case in enumerate(cases):
            _open(led, case)
            if i % 2:
                led.append(case, "reconciled", {"state": {"outcome": "applied"}},
                           intent_id="i0")
        many = led.intents_many([*cases, "no-such-case", cases[0]])
        assert set(many) == {*cases, "no-such-case"}
        for case in cases:
            assert many[case] == led.intents(case)
        assert many["no-such-case"] == {}
    with raw(ledger_url) as conn:
        conn.execute(sa.text("UPDATE cg_events SET payload = 'not json' "
                             "WHERE case_id = 'm-03' AND seq = 1"))
    with open_ledger(ledger_url) as led, pytest.raises(LedgerTampered):
        led.intents_many(cases)


def test_append_each_from_eight_threads_on_overlapping_cases(ledger_url: URL) -> None:
    """Batches that share cases serialise (one lock order): no deadlock, nothing lost."""

    with open_ledger(ledger_url) as led:
        cases = [f"t{i}" for i in range(12)]
        for case in cases:
            led.append(case, "noted", {"case_state": {"n": 0}})

        def work(k: int) -> None:
            mine = cases[k % 4:] + cases[:k % 4]  # different orders, the same cases
            led.append_each([(c, "noted", {"case_state": {"by": k}}, None) for c in mine])

        errors = in_threads(8, work)
        assert not errors, errors
        for case in cases:
            assert len(led.events(case)) == 9  # its first event and one from each thread
        assert led.verify().ok
