"""One exception tree with a stable code on every class; ``explain`` for every code."""

from __future__ import annotations

import re

import pytest

from capgate.registry import errors
from capgate.registry.errors import CapgateError, Problem, RegistryError, UnknownErrorCode

ALL = errors.all_codes()


def test_codes_are_unique_well_formed_and_ordered() -> None:
    codes = [c.code for c in ALL]
    assert codes == sorted(codes)
    assert len(codes) == len(set(codes))
    for code in codes:
        assert re.fullmatch(r"CG\d{3}", code), code
    # the registry codes the loader and resolve produce are all there
    for code in ["CG100", *(f"CG{n}" for n in range(101, 105)),
                 *(f"CG{n}" for n in range(110, 124)),
                 "CG130", "CG131", "CG132", "CG133", "CG140", "CG141", "CG142", "CG143", "CG150"]:
        assert code in codes


@pytest.mark.parametrize("cls", ALL, ids=[c.code for c in ALL])
def test_explain_every_code(cls: type[CapgateError]) -> None:
    assert issubclass(cls, CapgateError)
    assert errors.lookup(cls.code) is cls
    assert errors.lookup(cls.code.lower()) is cls
    doc = (cls.__doc__ or "").strip()
    assert doc, f"{cls.__name__} has no docstring for `capgate explain`"
    text = errors.explain(cls.code)
    first = text.splitlines()[0]
    assert first == f"{cls.code} {cls.__name__} (exit {cls.exit_code})"
    assert doc.splitlines()[0] in text
    assert text.endswith("\n")
    assert cls.exit_code in (errors.EXIT_REFUSED, errors.EXIT_USAGE, errors.EXIT_UNKNOWN,
                             errors.EXIT_APPROVAL_REQUIRED, errors.EXIT_INTERNAL)
    # the internal-error exit code is the bug's alone: no refusal a user causes shares it
    assert (cls.exit_code == errors.EXIT_INTERNAL) == (cls is errors.InternalError)


def test_lookup_of_an_unknown_code_is_a_usage_error() -> None:
    with pytest.raises(UnknownErrorCode) as info:
        errors.lookup("CG998")
    assert info.value.code == "CG901"
    assert info.value.exit_code == errors.EXIT_USAGE
    assert "capgate explain --all" in info.value.message
    with pytest.raises(UnknownErrorCode):
        errors.explain("nonsense")


def test_a_code_cannot_be_registered_twice() -> None:
    with pytest.raises(TypeError, match="CG140 is already taken by UnknownOperation"):
        class Again(CapgateError, code="CG140"):
            pass


def test_subclasses_inherit_exit_code_and_retryable() -> None:
    assert errors.UnknownErrorCode.exit_code == errors.EXIT_USAGE  # via UsageError
    assert errors.ImpactConflict.retryable
    assert not errors.UnknownOperation.retryable
    for cls in ALL:
        if 100 <= int(cls.code[2:]) < 140 or cls.code == "CG150":
            assert issubclass(cls, RegistryError), cls


def test_to_dict_carries_the_details() -> None:
    err = errors.EnvironmentNotAllowed("nope", operation_id="a", environment="prod")
    assert err.to_dict() == {
        "error": "EnvironmentNotAllowed",
        "code": "CG143",
        "message": "nope",
        "retryable": False,
        "details": {"operation_id": "a", "environment": "prod"},
    }
    assert str(err) == "CG143: nope"


def test_registry_error_carries_its_problems() -> None:
    problem = Problem("caps/a.yaml", 14, 7, "CG104", "statements[1].expect_rows",
                      "expected an integer or a range, got 'many'")
    assert problem.render() == ("caps/a.yaml:14:7: CG104: statements[1].expect_rows: "
                                "expected an integer or a range, got 'many'")
    err = RegistryError("invalid", problems=[problem])
    d = err.to_dict()
    assert d["problems"] == [{
        "path": "caps/a.yaml", "line": 14, "col": 7, "code": "CG104",
        "field": "statements[1].expect_rows",
        "message": "expected an integer or a range, got 'many'",
    }]
    assert "caps/a.yaml:14:7" in repr(problem)
