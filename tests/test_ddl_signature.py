"""Normalisation recipe v1, the block-hash signature, and its speed on a 50,000-line source."""

from __future__ import annotations

import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capgate.ddl.catalog import ObjectRef, adapter_for
from capgate.ddl.signature import (
    ABSENT,
    BLOCK_LINES,
    Signature,
    diff,
    normalise,
    parse,
    sign,
    signature_of,
)


def test_normalise_line_endings_trailing_whitespace_and_blank_lines() -> None:
    raw = "\ufeff\r\n\r\nCREATE X\r\n  a := 1;   \t\r  b\tc \n\n\n"
    assert normalise(raw) == "CREATE X\n  a := 1;\n  b\tc\n"


def test_normalise_keeps_inner_blank_lines_and_leading_indent() -> None:
    assert normalise("a\n\n\n  b\n") == "a\n\n\n  b\n"
    assert normalise("") == ""
    assert normalise("\n \n\t\n") == ""


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab \t\r\n;:'-"), max_size=300))
def test_normalise_is_idempotent_and_ignores_cosmetics(text: str) -> None:
    once = normalise(text)
    assert normalise(once) == once
    noisy = text.replace("\n", "  \r\n")
    assert sign(normalise(noisy)) == sign(normalise(text.replace("\r", "\n")))


def test_signature_format_blocks_and_determinism() -> None:
    text = "".join(f"line {i}\n" for i in range(200))
    sig = sign(text)
    recipe, algo, digest = parse(str(sig))
    assert (recipe, algo, len(digest)) == ("v2", "sha256", 64)
    assert len(sig.blocks) == 4 == -(-200 // BLOCK_LINES)
    assert sig.lines == 200
    assert sign(text) == sig
    assert str(sign(text + "x\n")) != str(sig)
    assert Signature.from_dict(sig.to_dict()) == sig


def test_signature_of_absent_and_empty_differ() -> None:
    assert str(Signature.absent()) == ABSENT == "v2:absent"
    empty = sign("")
    assert empty.exists and str(empty).startswith("v2:sha256:")
    assert str(empty) != ABSENT


def test_tampered_blocks_are_detected() -> None:
    d = sign("a\nb\n").to_dict()
    d["blocks"] = ["00" * 32]
    with pytest.raises(ValueError, match="does not match its blocks"):
        Signature.from_dict(d)
    with pytest.raises(ValueError, match="not a content signature"):
        parse("sha256:abc")


def test_diff_names_the_changed_block_and_its_lines() -> None:
    lines = [f"  v_{i} NUMBER := {i};" for i in range(300)]
    old = sign("\n".join(lines) + "\n")
    lines[130] = "  v_130 NUMBER := -1;"
    new = sign("\n".join(lines) + "\n")
    d = diff(old, new)
    assert not d.same
    assert [c.index for c in d.changed] == [2]
    assert (d.changed[0].first_line, d.changed[0].last_line) == (129, 192)
    grown = sign("\n".join([*lines, "  extra NUMBER;"]) + "\n")
    assert [c.index for c in diff(new, grown).changed] == [4]
    assert diff(new, new).same


def test_dialect_cosmetics_mariadb_definer_and_label() -> None:
    ad = adapter_for("mariadb")
    ref = ObjectRef("package_body", "billing", "app")
    show_create = (
        'CREATE OR REPLACE DEFINER="root"@"127.0.0.1" PACKAGE BODY "billing" AS\n'
        "  x INT := 0;\nEND"
    )
    written = "create or replace package body billing\nAS\n  x INT := 0;\nEND billing;\n"
    assert ad.normalise(ref, show_create) == ad.normalise(ref, written)
    assert ad.normalise(ref, show_create).startswith("CREATE PACKAGE BODY billing AS\n")


def test_dialect_cosmetics_oracle_keeps_plsql_semicolon() -> None:
    ad = adapter_for("oracle")
    ref = ObjectRef("package", "PKG", "APP")
    a = 'CREATE OR REPLACE EDITIONABLE PACKAGE "APP"."PKG" AS\n  x NUMBER;\nEND pkg;\n/\n'
    b = "create or replace package pkg AS\n  x NUMBER;\nEND pkg;"
    assert ad.normalise(ref, a) == ad.normalise(ref, b) == (
        "CREATE PACKAGE PKG AS\n  x NUMBER;\nEND pkg;\n"
    )
    view = ObjectRef("view", "V", "APP")
    assert ad.normalise(view, "create view v as select 1 x from dual;\n/").endswith("dual\n")


def test_dialect_cosmetics_postgresql_and_sqlite_terminators() -> None:
    pg = adapter_for("postgresql")
    ref = ObjectRef("function", "f", "s", "integer")
    assert pg.normalise(ref, "select 1;\n") == "select 1\n"
    lite = adapter_for("sqlite")
    v = ObjectRef("view", "v", "main")
    assert lite.normalise(v, 'CREATE VIEW IF NOT EXISTS "v" AS SELECT 1;') == (
        lite.normalise(v, "CREATE VIEW v AS SELECT 1")
    )


def _big_package(lines: int) -> str:
    out = ["CREATE OR REPLACE PACKAGE BODY big_pkg AS"]
    i = 0
    while len(out) < lines - 1:
        out += [
            f"  FUNCTION f_{i}(p_amount NUMBER) RETURN NUMBER IS   ",
            "    v_total NUMBER := 0; ",
            "  BEGIN",
            f"    v_total := p_amount * {i % 97} + {i};  -- rate {i}",
            "    RETURN v_total;\t",
            f"  END f_{i};",
        ]
        i += 1
    out = [*out[: lines - 1], "END big_pkg;"]
    return "\r\n".join(out) + "\r\n"


def test_signature_of_50000_lines() -> None:
    """Normalise (with the dialect's cosmetics) and sign 50,000 lines.

    The time is printed, not asserted (timed assertions belong in bench/ddl.py,
    whose results are in bench/RESULTS.md).
    """
    source = _big_package(50_000)
    ad = adapter_for("mariadb")
    ref = ObjectRef("package_body", "big_pkg", "app")
    cpu, wall = [], []
    for _ in range(5):
        c0, w0 = time.process_time(), time.perf_counter()
        sig = sign(ad.normalise(ref, source))
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    print(f"\n50k-line normalise+sign ({len(source) / 1e6:.1f} MB): cpu best "
          f"{min(cpu) * 1000:.1f} ms, wall best {min(wall) * 1000:.1f} ms, "
          f"wall median {statistics.median(wall) * 1000:.1f} ms")
    assert sig.lines == 50_000
    assert len(sig.blocks) == -(-50_000 // BLOCK_LINES)
    assert signature_of(source) != sig  # the dialect cosmetics are part of the recipe
