"""A row's SQL checked against the dialects its connector declares, and against commits.

A capability file's connector may declare the databases it runs on
(``connectors: {insurance: {dialects: [postgresql, oracle]}}``).  A DBA should
learn at ``capgate validate`` time -- not on the first call against a real
estate -- that a check written for PostgreSQL does not run on Oracle 19c.  So:

* **CG170** (error): every SQL text of the row parses with sqlglot's parser for
  each declared dialect, and fits that dialect's rules that a parse alone does
  not catch.  On Oracle: every query has a FROM clause (``SELECT 1`` needs 23ai),
  no ``LIMIT``/``OFFSET`` (Oracle has ``FETCH FIRST``), no ``TRUE``/``FALSE``
  literals (SQL booleans need 23ai).  A PL/SQL block (``BEGIN ... END;``) cannot
  be parsed as SQL; on Oracle it is accepted as written.
* **CG171** (error, every row): a write statement must not end or split the
  transaction capgate opens and marks: no COMMIT, ROLLBACK or SAVEPOINT
  anywhere (a PL/SQL block included), no DDL or session/transaction control as
  the statement (``CREATE``, ``ALTER SESSION``, ``TRUNCATE``, ``START
  TRANSACTION`` ...), no dynamic SQL (``EXECUTE IMMEDIATE``, ``DBMS_SQL``,
  ``PREPARE``) whose text nobody reviewed.
* **CG172** (warning, Oracle): a string input whose pattern admits ISO dates and
  that declares no ``format: date`` -- Oracle would convert it through the
  session's ``NLS_DATE_FORMAT``; with the format capgate binds a DATE.
* **CG173** (warning, Oracle): a leased row -- refused on Oracle at call time.
* **CG139**, **CG144** (error, every row): SQL that may only read -- a read row's
  statements, every verify, replay, probe, check -- calls only side-effect-free
  functions and writes no file or variable (:mod:`registry.sql_functions`).

Retired rows are left out of the dialect checks (they can no longer run).  The
findings name the file, the row and the statement, like every other finding.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from capgate.registry.checks import RowContext, _sql_sites, binds_of
from capgate.registry.errors import Problem
from capgate.registry.fastload.yamlpos import Path
from capgate.registry.rules import (
    DATE_BOUND_AS_TEXT,
    DIALECT_SQL_INVALID,
    LEASED_ON_ORACLE,
    TRANSACTION_CONTROL_IN_WRITE,
)
from capgate.registry.sql_functions import COMMON_SAFE, Engine, names, read_findings
from capgate.registry.sqltext import LEADING_COMMENTS as _LEADING_COMMENTS
from capgate.registry.sqltext import LITERALS as _LITERALS
from capgate.registry.sqltext import QuietSqlglot as _QuietSqlglot
from capgate.registry.sqltext import is_plsql_block, tokens


@dataclass(frozen=True)
class Grammar:
    """What validation knows of one engine's SQL, as flags and rules.

    ``registry`` is the lowest layer: it cannot ask the executor's dialects, so
    the facts about each engine's SQL that validation needs live in one table
    here (:data:`GRAMMARS`) and the checks below only read its flags.
    """

    sqlglot: str
    """sqlglot's name for the dialect (its parser and tokenizer)."""
    plsql_blocks: bool = False
    """An anonymous PL/SQL block (``BEGIN ... END;``) is accepted as written: it is not
    SQL, and sqlglot cannot read it."""
    rules: Callable[[Any], str | None] | None = None
    """The engine's rules a parse does not enforce: why a parsed statement does not run
    there, or None."""
    dates_as_text: bool = False
    """A string bound to a DATE is converted through a session setting (``NLS_DATE_FORMAT``):
    an input that takes ISO dates should declare ``format: date`` (CG172)."""
    refuses_leases: bool = False
    """Leased rows are refused at call time here (CG173)."""
    safe_functions: frozenset[str] = COMMON_SAFE
    """Functions read and verify SQL may call here (CG139), beyond sqlglot's modelled
    built-ins and the row's own ``allow_functions``."""


def oracle_reason(tree: Any) -> str | None:
    """Oracle's rules a parse does not enforce (before 23ai), or None."""
    from sqlglot import exp

    for select in tree.find_all(exp.Select):
        if select.args.get("from") is None and select.args.get("from_") is None:
            return "a query without FROM needs Oracle 23ai (write FROM dual, or select " \
                   "from a derived table that every declared dialect accepts)"
    if tree.find(exp.Limit) is not None or tree.find(exp.Offset) is not None:
        return "Oracle has no LIMIT/OFFSET (FETCH FIRST n ROWS ONLY)"
    if tree.find(exp.Boolean) is not None:
        return "SQL TRUE/FALSE literals need Oracle 23ai (compare with 1/0)"
    return None


_POSTGRESQL_SAFE = COMMON_SAFE | names("""
age array_agg array_length array_lower array_position array_positions array_to_json
array_to_string array_upper ascii bit_length btrim cardinality cbrt chr clock_timestamp
col_description convert_from convert_to current_database current_schema current_schemas
current_setting current_user date_bin date_part date_trunc decode div encode every
factorial format format_type gcd generate_series generate_subscripts
has_any_column_privilege has_column_privilege has_database_privilege
has_schema_privilege has_sequence_privilege has_table_privilege host inet_client_addr
initcap isfinite json_agg json_array_elements json_array_elements_text json_array_length
json_build_array json_build_object json_each json_each_text json_extract_path
json_extract_path_text json_object json_object_agg json_object_keys json_populate_record
json_strip_nulls json_typeof jsonb_agg jsonb_array_elements jsonb_array_elements_text
jsonb_array_length jsonb_build_array jsonb_build_object jsonb_each jsonb_each_text
jsonb_extract_path jsonb_extract_path_text jsonb_object_agg jsonb_object_keys
jsonb_path_exists jsonb_path_match jsonb_path_query jsonb_path_query_array
jsonb_path_query_first jsonb_pretty jsonb_set jsonb_strip_nulls jsonb_typeof
justify_days justify_hours justify_interval lcm make_date make_interval make_time
make_timestamp make_timestamptz mode now num_nonnulls num_nulls obj_description
octet_length overlay pg_backend_pid pg_column_size pg_get_constraintdef pg_get_expr
pg_get_function_arguments pg_get_function_identity_arguments pg_get_function_result
pg_get_functiondef pg_get_indexdef pg_get_triggerdef pg_get_viewdef pg_has_role
pg_postmaster_start_time pg_relation_size pg_table_is_visible pg_total_relation_size
pg_typeof pg_xact_status quote_ident quote_literal quote_nullable random regexp_count
regexp_instr regexp_like regexp_match regexp_matches regexp_replace
regexp_split_to_array regexp_split_to_table regexp_substr row_to_json scale session_user
split_part starts_with statement_timestamp string_agg string_to_array strpos timeofday
to_char to_date to_hex to_json to_jsonb to_number to_timestamp transaction_timestamp
trim_scale txid_status unnest version width_bucket xmlagg xmlelement
""")
_MARIADB_SAFE = COMMON_SAFE | names("""
addtime adddate any_value bin bit_count char charset coercibility collation
connection_id conv convert_tz crc32 curdate current_role current_user curtime database
date date_add date_format date_sub datediff day dayname dayofmonth dayofweek dayofyear
elt export_set field find_in_set format found_rows from_days from_unixtime get_format
group_concat hex hour if ifnull inet_aton inet_ntoa insert instr isnull json_array
json_arrayagg json_contains json_contains_path json_depth json_exists json_extract
json_keys json_length json_merge json_merge_patch json_object json_objectagg json_query
json_quote json_search json_type json_unquote json_valid json_value last_day lcase
locate lower makedate maketime microsecond mid minute month monthname now oct
octet_length ord period_add period_diff quarter quote regexp_instr regexp_replace
regexp_substr row_count schema sec_to_time second sha sha1 sha2 soundex space
str_to_date strcmp subdate substring_index subtime sysdate time time_format time_to_sec
timediff timestamp timestampadd timestampdiff to_days to_seconds truncate ucase unhex
unix_timestamp user utc_date utc_time utc_timestamp uuid version week weekday weekofyear
year yearweek
""")
_ORACLE_SAFE = COMMON_SAFE | names("""
add_months bin_to_num bitand cardinality chr collect convert cosh current_timestamp
dbtimezone decode dump empty_blob empty_clob from_tz initcap instr json_array
json_arrayagg json_object json_objectagg json_query json_value last_day lengthb listagg
lnnvl lpad months_between nanvl new_time next_day nls_initcap nls_lower nls_upper
numtodsinterval numtoyminterval nvl nvl2 ora_hash rawtohex regexp_count regexp_instr
regexp_like regexp_replace regexp_substr remainder rowidtochar sessiontimezone sinh
soundex standard_hash sys_context sys_extract_utc sysdate systimestamp tanh
to_binary_double to_binary_float to_char to_clob to_date to_dsinterval to_lob
to_multi_byte to_nchar to_number to_single_byte to_timestamp to_timestamp_tz
to_yminterval tz_offset uid user userenv vsize width_bucket xmlagg xmlelement
""")
_SQLITE_SAFE = COMMON_SAFE | names("""
changes char date datetime glob group_concat hex ifnull iif instr json json_array
json_array_length json_each json_extract json_group_array json_group_object json_object
json_quote json_tree json_type json_valid julianday last_insert_rowid like likelihood
likely printf quote random randomblob sqlite_version strftime time total total_changes
typeof unicode unixepoch unlikely zeroblob
""")
"""Per engine: the functions a read may call beyond sqlglot's modelled built-ins
(:mod:`registry.sql_functions`); each computes a value from its arguments, the clock or
the catalog, and acts on nothing."""

GRAMMARS: Mapping[str, Grammar] = {
    "postgresql": Grammar("postgres", safe_functions=_POSTGRESQL_SAFE),
    "mariadb": Grammar("mysql", safe_functions=_MARIADB_SAFE),
    "oracle": Grammar("oracle", plsql_blocks=True, rules=oracle_reason, dates_as_text=True,
                      refuses_leases=True, safe_functions=_ORACLE_SAFE),
    "sqlite": Grammar("sqlite", safe_functions=_SQLITE_SAFE),
}
"""capgate's dialect names (a connector's declared ``dialects``) -> what validation knows."""

CONTROL_FIRST_WORDS = frozenset({
    "CREATE", "DROP", "ALTER", "TRUNCATE", "GRANT", "REVOKE", "RENAME", "COMMENT", "ANALYZE",
    "AUDIT", "NOAUDIT", "PURGE", "FLASHBACK", "COMMIT", "ROLLBACK", "SAVEPOINT", "START",
    "SET", "PREPARE", "EXECUTE", "DEALLOCATE", "VACUUM", "REINDEX", "CLUSTER", "DISCARD",
    "RESET", "USE", "LOAD", "UNLOCK", "FLUSH", "OPTIMIZE", "REPAIR", "INSTALL", "ATTACH",
    "DETACH", "PRAGMA",
})
"""A write statement that *is* one of these (DDL, session or transaction control)."""
TRANSACTION_WORDS = frozenset({"COMMIT", "ROLLBACK", "SAVEPOINT"})
"""Refused anywhere in a write statement (a PL/SQL block's body included)."""
ISO_DATE_SAMPLE = "2024-08-15"
ISO_DATETIME_SAMPLE = "2024-08-15T10:30:00"
NOT_A_DATE = "not a date"

def _write_sites(row: Mapping[str, Any]) -> Iterator[tuple[Path, str]]:
    """The SQL that writes: a write row's statements, SQL steps, compensations."""
    writes = row["effect_class"] in ("transactional", "compensable", "irreversible")
    for path, sql, must_read in _sql_sites(row):
        if must_read:
            continue
        if path[0] == "statements" and not writes:
            continue
        yield path, sql


def _tokens(sql: str, dialects: Sequence[str]) -> list[Any] | None:
    return tokens(sql, [GRAMMARS[d].sqlglot for d in dialects if d in GRAMMARS])


_SUSPECT_FIRST = re.compile(r"^\s*(" + "|".join(sorted(CONTROL_FIRST_WORDS | {"BEGIN"}))
                            + r")\b", re.IGNORECASE)
_SUSPECT_ANYWHERE = re.compile(r"\b(COMMIT|ROLLBACK|SAVEPOINT|IMMEDIATE|DBMS_SQL|DBMS_UTILITY)"
                               r"\b", re.IGNORECASE)


def control_reason(sql: str, dialects: Sequence[str] = ()) -> str | None:
    """Why a write statement would end or split its transaction, or None.

    A regular expression finds the suspects cheaply (validation of a large registry
    tokenizes nothing for ordinary DML); sqlglot's tokens then decide, so a word in
    a string literal or a comment is no finding.
    """
    body = _LEADING_COMMENTS.sub("", sql, count=1)
    if not (_SUSPECT_FIRST.match(body) or _SUSPECT_ANYWHERE.search(sql)):
        return None
    return _control_reason(sql, tuple(dialects))


@functools.lru_cache(maxsize=4096)
def _control_reason(sql: str, dialects: tuple[str, ...]) -> str | None:
    tokens = _tokens(sql, dialects)
    if tokens is None:
        return None  # unparseable everywhere: CG120/CG170 say so where it matters
    # words outside string literals and quoted identifiers
    words = [t.text.upper() for t in tokens
             if t.token_type.name not in _LITERALS or t.text.upper().startswith("IMMEDIATE")]
    if not words:
        return None
    plsql = is_plsql_block(sql)
    first = words[0]
    if first == "BEGIN" and not plsql:
        return "starts a transaction of its own (BEGIN)"
    if not plsql and first in CONTROL_FIRST_WORDS:
        return f"is a {first} statement (DDL or session/transaction control)"
    for i, word in enumerate(words):
        following = words[i + 1] if i + 1 < len(words) else ""
        if word in TRANSACTION_WORDS:
            return f"contains {word}"
        if word == "EXECUTE" and following.startswith("IMMEDIATE"):
            return "runs dynamic SQL (EXECUTE IMMEDIATE)"
        if word in ("DBMS_SQL", "DBMS_UTILITY") and following == ".":
            return f"runs dynamic SQL ({word})"
    return None


def transaction_control_problems(ctx: RowContext, dialects: Sequence[str] = ()
                                 ) -> list[Problem]:
    """CG171 for every write statement of the row."""
    out: list[Problem] = []
    for path, sql in _write_sites(ctx.row):
        reason = control_reason(sql, dialects)
        if reason:
            out.append(ctx.at(path, TRANSACTION_CONTROL_IN_WRITE.code,
                              f"a write statement must not commit, roll back or run DDL: it "
                              f"{reason}; capgate owns the transaction (marker, COMMIT)"))
    return out


@functools.lru_cache(maxsize=16384)
def dialect_reason(sql: str, dialect: str) -> str | None:
    """Why ``sql`` does not fit ``dialect`` (a capgate dialect name), or None."""
    import sqlglot

    grammar = GRAMMARS.get(dialect)
    if grammar is None:
        return None
    if grammar.plsql_blocks and is_plsql_block(sql):
        return None  # PL/SQL is not SQL: accepted as written, sqlglot cannot read it
    try:
        with _QuietSqlglot():
            trees = [t for t in sqlglot.parse(sql, read=grammar.sqlglot) if t is not None]
    except sqlglot.errors.SqlglotError as exc:
        return f"does not parse as {dialect}: {str(exc).splitlines()[0]}"
    except RecursionError:
        return f"does not parse as {dialect}: nested too deeply"
    if grammar.rules is not None:
        for tree in trees:
            reason = grammar.rules(tree)
            if reason:
                return reason
    return None


def dialect_problems(ctx: RowContext, dialects: Sequence[str]) -> list[Problem]:
    """CG170 for every SQL text of a (non-retired) row, for each declared dialect."""
    if not dialects or ctx.row.get("retired"):
        return []
    out: list[Problem] = []
    for path, sql, _ in _sql_sites(ctx.row):
        for dialect in dialects:
            reason = dialect_reason(sql, dialect)
            if reason:
                out.append(ctx.at(path, DIALECT_SQL_INVALID.code, f"{dialect}: {reason}"))
                break  # one finding per statement
    return out


def _admits_iso_dates(pattern: Any) -> bool:
    if not isinstance(pattern, str):
        return False
    try:
        compiled = re.compile(pattern)
    except re.error:
        return False
    return bool(compiled.search(ISO_DATE_SAMPLE) or compiled.search(ISO_DATETIME_SAMPLE)) \
        and not compiled.search(NOT_A_DATE)


def dialect_warnings(ctx: RowContext, dialects: Sequence[str]) -> list[Problem]:
    """CG172 and CG173 for a (non-retired) row whose connector declares Oracle."""
    row = ctx.row
    declared = [GRAMMARS[d] for d in dialects if d in GRAMMARS]
    dates = any(g.dates_as_text for g in declared)
    leases = any(g.refuses_leases for g in declared)
    if not (dates or leases) or row.get("retired"):
        return []
    out: list[Problem] = []
    props = row.get("input", {}).get("properties")
    used: set[str] = set()
    for _, sql, _ in _sql_sites(row):
        used |= binds_of(sql)
    if dates and isinstance(props, Mapping) and row.get("shape") != "leased":  # CG173 says it
        for name, spec in props.items():
            if not isinstance(spec, Mapping) or name not in used:
                continue
            if spec.get("type") == "string" and "format" not in spec \
                    and _admits_iso_dates(spec.get("pattern")):
                out.append(ctx.at(("input", "properties", name), DATE_BOUND_AS_TEXT.code,
                                  f"input {name!r} takes ISO dates but is bound as text: on "
                                  "Oracle a DATE column meets it through NLS_DATE_FORMAT; "
                                  "declare `format: date` and capgate binds a DATE"))
    if leases and row.get("shape") == "leased":
        out.append(ctx.at(("shape",), LEASED_ON_ORACLE.code,
                          "a leased row is refused on Oracle (CG326): nothing there ends a "
                          "hung executor's transaction at the deadline"))
    return out


def read_site_problems(ctx: RowContext, dialects: Sequence[str]) -> list[Problem]:
    """CG139 and CG144 for every SQL text of a (non-retired) row that may only read.

    A read row's statements and every row's verify, replay, probe, check and
    symptom queries call only side-effect-free functions (the engine's list in
    :mod:`registry.sql_functions`, or the row's reviewed ``allow_functions``) and
    write nothing (no ``INTO OUTFILE``).  The finding is located at the SQL field
    and names the call's line and column within the SQL.
    """
    row = ctx.row
    if row.get("retired"):
        return []
    allow = frozenset(str(name).lower() for name in row.get("allow_functions") or ())
    engines = tuple(Engine(d, GRAMMARS[d].sqlglot, GRAMMARS[d].safe_functions)
                    for d in (dialects or GRAMMARS) if d in GRAMMARS)
    out: list[Problem] = []
    for path, sql, must_read in _sql_sites(row):
        if not must_read:
            continue
        for finding in read_findings(sql, engines, allow, path):
            out.append(ctx.at(path, finding.code, f"{finding.message} (SQL line {finding.line}"
                                                  f", column {finding.col})"))
    return out


def sql_fit_problems(ctx: RowContext, dialects: Sequence[str]) -> list[Problem]:
    """Every error of this module for one row: CG171 (any row), CG170 (declared dialects),
    CG139 and CG144 (read-only SQL that could act)."""
    return (transaction_control_problems(ctx, dialects) + dialect_problems(ctx, dialects)
            + read_site_problems(ctx, dialects))
