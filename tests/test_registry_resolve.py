"""``Registry.resolve``: the only way from an operation name to a row, failing closed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from capgate.registry import errors
from capgate.registry.errors import (
    CapgateError,
    EnvironmentNotAllowed,
    RetiredRow,
    UnknownOperation,
    UnknownVersion,
)
from capgate.registry.loader import load_registry, validate_texts
from capgate.registry.model import EffectClass, Row
from capgate.registry.registry import Registry

GOOD = Path(__file__).resolve().parent / "data" / "good"

ROW = """
  - operation_id: {op}
    version: {version}
    connector: db
    description: version {version}
    retired: {retired}
    input: {{type: object, additionalProperties: false}}
    target: {{system: db, object: t}}
    effect_class: read
    authorization: {{kind: read_grant}}
    environments: [{envs}]
    timeout: {{seconds: 1, on_timeout: rolled_back}}
    recovery: retryable
    statements:
      - sql: SELECT count(*) FROM t
"""


def rows_text(*specs: tuple[str, int, bool], envs: str = "dev, qa") -> str:
    body = "".join(ROW.format(op=op, version=v, retired=str(r).lower(), envs=envs)
                   for op, v, r in specs)
    return "connectors:\n  db: {}\nrows:" + body


def registry_of(*texts: str) -> Registry:
    result = validate_texts((f"f{i}.yaml", t) for i, t in enumerate(texts))
    assert result.ok, [p.render() for p in result.problems]
    return Registry(result.rows)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry([GOOD], check_lock=False)


def test_resolve_returns_the_frozen_row(registry: Registry) -> None:
    row = registry.resolve("policy.get")
    assert isinstance(row, Row)
    assert row.ref == "policy.get@1"
    assert row.effect_class is EffectClass.READ
    assert not row.is_write
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.version = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        row.input["type"] = "array"  # type: ignore[index]
    assert isinstance(row.statements, tuple)
    assert row.statements[0].sql.startswith("SELECT")


def test_the_newest_live_version_is_chosen(registry: Registry) -> None:
    row = registry.resolve("policy.rename_holder")
    assert row.version == 2
    assert registry.versions("policy.rename_holder") == [1, 2]


def test_an_explicit_version_is_returned(registry: Registry) -> None:
    assert registry.resolve("policy.rename_holder", 2).version == 2
    assert registry.resolve("code.replace_premium_fn", 3).version == 3


def test_unknown_operation_is_refused(registry: Registry) -> None:
    for name in ("policy.delete_all", "POLICY.GET", "policy.get ", "policy", "", "policy.get@1"):
        with pytest.raises(UnknownOperation) as info:
            registry.resolve(name)
        assert info.value.code == "CG140"
        assert info.value.details["operation_id"] == name
        assert repr(name) in info.value.message


def test_unknown_operation_with_a_version_is_still_unknown_operation(registry: Registry) -> None:
    with pytest.raises(UnknownOperation):
        registry.resolve("no.such", 1)


def test_unknown_version_is_refused_and_names_the_registered_ones(registry: Registry) -> None:
    with pytest.raises(UnknownVersion) as info:
        registry.resolve("policy.rename_holder", 3)
    err = info.value
    assert err.code == "CG141"
    assert err.details["registered"] == [1, 2]
    assert "registered: 1, 2" in err.message


def test_a_retired_version_is_refused_with_a_hint(registry: Registry) -> None:
    with pytest.raises(RetiredRow) as info:
        registry.resolve("policy.rename_holder", 1)
    err = info.value
    assert err.code == "CG142"
    assert err.details == {"operation_id": "policy.rename_holder", "version": 1}
    assert "call version 2" in err.message


def test_retired_check_comes_before_the_environment_check(registry: Registry) -> None:
    with pytest.raises(RetiredRow):
        registry.resolve("policy.rename_holder", 1, environment="prod")


def test_an_operation_whose_every_version_is_retired_is_refused() -> None:
    reg = registry_of(rows_text(("old.op", 1, True), ("old.op", 2, True)))
    with pytest.raises(RetiredRow) as info:
        reg.resolve("old.op")
    assert info.value.details["version"] == 2
    assert "every version of old.op is retired" in info.value.message
    with pytest.raises(RetiredRow) as info:
        reg.resolve("old.op", 1)
    assert "call version" not in info.value.message  # there is nothing to call instead
    assert reg.current_rows() == []
    assert [r.ref for r in reg.rows()] == ["old.op@1", "old.op@2"]
    assert reg.rows(include_retired=False) == []


def test_environment_not_allowed(registry: Registry) -> None:
    assert registry.resolve("policy.rename_holder", environment="staging").version == 2
    with pytest.raises(EnvironmentNotAllowed) as info:
        registry.resolve("policy.rename_holder", environment="prod")
    err = info.value
    assert err.code == "CG143"
    assert err.details["environment"] == "prod"
    assert err.details["allowed"] == ["dev", "qa", "staging"]
    assert err.details["version"] == 2
    with pytest.raises(EnvironmentNotAllowed):
        registry.resolve("policy.rename_holder", 2, environment="prod")
    with pytest.raises(EnvironmentNotAllowed):
        registry.resolve("policy.get", environment="production")


@pytest.mark.parametrize(
    ("specs", "expected"),
    [
        ([("op", 1, False), ("op", 2, False), ("op", 3, False)], 3),
        ([("op", 1, False), ("op", 2, False), ("op", 3, True)], 2),
        ([("op", 1, False), ("op", 2, True), ("op", 3, False)], 3),
        ([("op", 3, False), ("op", 1, False), ("op", 10, False), ("op", 2, False)], 10),
        ([("op", 1, True), ("op", 5, False), ("op", 7, True)], 5),
    ],
)
def test_latest_version_choice(specs: list[tuple[str, int, bool]], expected: int) -> None:
    assert registry_of(rows_text(*specs)).resolve("op").version == expected


def test_versions_spread_over_files_resolve_to_the_newest() -> None:
    reg = registry_of(rows_text(("op", 4, False)), rows_text(("op", 9, False)),
                      rows_text(("op", 1, False)))
    assert reg.resolve("op").version == 9
    assert reg.versions("op") == [1, 4, 9]
    assert reg.resolve("op", 4).description == "version 4"


def test_refusals_are_capgate_errors_with_stable_codes() -> None:
    for cls, code in ((UnknownOperation, "CG140"), (UnknownVersion, "CG141"),
                      (RetiredRow, "CG142"), (EnvironmentNotAllowed, "CG143")):
        assert issubclass(cls, CapgateError)
        assert cls.code == code
        assert errors.lookup(code) is cls
        assert cls.exit_code == errors.EXIT_REFUSED
        assert not cls.retryable


def test_refusal_to_dict_is_machine_readable(registry: Registry) -> None:
    with pytest.raises(CapgateError) as info:
        registry.resolve("policy.get", 9)
    d = info.value.to_dict()
    assert d["code"] == "CG141"
    assert d["error"] == "UnknownVersion"
    assert d["details"]["registered"] == [1]
    assert str(info.value).startswith("CG141: ")


def test_listing(registry: Registry) -> None:
    assert len(registry) == 7
    assert [r.ref for r in registry] == [
        "code.replace_premium_fn@3", "cover.add@1", "document.number@1",
        "policy.delete_orphan@1", "policy.get@1", "policy.rename_holder@1",
        "policy.rename_holder@2",
    ]
    assert "policy.rename_holder@1" not in [r.ref for r in registry.rows(include_retired=False)]
    assert [r.ref for r in registry.current_rows()] == [
        "code.replace_premium_fn@3", "cover.add@1", "document.number@1",
        "policy.delete_orphan@1", "policy.get@1", "policy.rename_holder@2",
    ]
    assert registry.versions("nope") == []


def test_empty_registry_refuses_everything() -> None:
    reg = Registry([])
    assert len(reg) == 0
    with pytest.raises(UnknownOperation):
        reg.resolve("policy.get")
