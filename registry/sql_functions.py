"""What read SQL may call: the side-effect-free functions of each engine, and the rules.

A read row runs in a read-only transaction, and a write row's verify, replay,
probe and check queries run inside the write's transaction before COMMIT.
Neither stops a function from acting: ``pg_terminate_backend`` ends another
session, ``pg_read_file`` and MariaDB's ``LOAD_FILE`` read server files,
``dblink`` opens a connection of its own that commits, advisory locks and
``nextval`` outlive any rollback, ``pg_notify`` and ``UTL_HTTP`` talk to the
world.  So every query a row only reads with is checked at validation:

* a function call must be a function sqlglot models as a built-in and that is
  not in :data:`UNSAFE_CLASSES`, or a name on the list of every engine the row
  may run on (:data:`COMMON_SAFE` plus the engine's own, kept with the other
  engine facts in ``registry.dialect_checks.GRAMMARS``), or a name the row lists
  in its reviewed ``allow_functions``;
* a function in :data:`REFUSED` can never be allowed, whatever the row says
  (file and program access, session and backend control, locks, sequences,
  notifications, sleeps, dynamic SQL, Oracle ``DBMS_*`` / ``UTL_*``);
* the query may not write a file, a variable or a table (``INTO OUTFILE``,
  ``INTO DUMPFILE``, ``INTO @var``) -- :class:`~registry.errors.ReadSqlActs`.

The checks are a tuple of rules (:data:`READ_RULES`), each a function from one
parsed query and its :class:`ReadSite` to findings; a further rule (say, that a
verify query must not read through a link that cannot see the uncommitted
write) is one more function in the tuple.  Findings carry the code, the
message, and the line and column of the call within the SQL text; the caller
locates the SQL field in its file (``path:line:col``).
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from capgate.registry.rules import READ_SQL_ACTS, UNSAFE_FUNCTION

__all__ = ["COMMON_SAFE", "READ_RULES", "REFUSED", "UNSAFE_CLASSES", "Engine", "ReadFinding",
           "ReadSite", "names", "read_findings"]


# --- the lists ------------------------------------------------------------------------


def names(text: str) -> frozenset[str]:
    """A list of function names written as words (lowercase, whitespace-separated)."""
    return frozenset(text.split())


COMMON_SAFE = names("""
abs acos asin atan atan2 avg bit_and bit_or bit_xor bool_and bool_or ceil ceiling
char_length character_length coalesce concat concat_ws cos cot count cume_dist
current_date current_time current_timestamp dense_rank exp extract first_value floor
greatest lag last_value lead least left length ln localtime localtimestamp log log10
log2 lower lpad ltrim max md5 min mod nth_value ntile nullif percent_rank
percentile_cont percentile_disc pi position power radians rank repeat replace reverse
right round row_number rpad rtrim sign sin sqrt stddev stddev_pop stddev_samp substr
substring sum tan translate trim trunc upper var_pop var_samp variance degrees cast
""")
"""Side-effect-free on every engine that has them (standard SQL and near-universal).
Each engine's own list (``registry.dialect_checks.GRAMMARS``: ``safe_functions``) adds
to it."""

REFUSED: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), why) for pattern, why in (
        (r"^(dbms_|utl_|owa_|htp$|htf$|sys\.dbms_|sys\.utl_)", "an Oracle package that acts "
         "(DBMS_* / UTL_*: locks, pipes, jobs, HTTP, files, dynamic SQL)"),
        (r"^dblink", "dblink opens its own connection, which commits on its own"),
        (r"^(pg_read_file|pg_read_binary_file|pg_ls_|pg_stat_file|pg_file_|lo_|"
         r"load_file$|loread|lowrite)", "it reads or writes files or large objects on the "
         "server"),
        (r"^(pg_terminate_backend|pg_cancel_backend|pg_reload_conf|pg_rotate_logfile|"
         r"pg_switch_wal|pg_promote|pg_create_restore_point|pg_log_backend_memory_contexts|"
         r"pg_backup_|pg_start_backup|pg_stop_backup|pg_wal_replay_|pg_replication_|"
         r"pg_create_.*_replication_slot|pg_drop_replication_slot|pg_logical_|"
         r"pg_import_system_collations|pg_stat_reset|pg_stat_clear)",
         "it controls other sessions or the server"),
        (r"^(pg_advisory|pg_try_advisory|get_lock$|release_lock$|release_all_locks$|"
         r"is_free_lock$|is_used_lock$)", "it takes or releases a lock that outlives the query"),
        (r"^(set_config|pg_set_)", "it changes session settings"),
        (r"^(nextval|setval|lastval_set|next_value)$", "it advances a sequence, which no "
         "rollback undoes"),
        (r"^(pg_notify|pg_sleep|sleep|benchmark|pg_sleep_for|pg_sleep_until|master_pos_wait|"
         r"master_gtid_wait|source_pos_wait|wait_for_executed_gtid_set)$",
         "it notifies, sleeps or waits"),
        (r"^(query_to_xml|query_to_xmlschema|query_to_xml_and_xmlschema|cursor_to_xml|"
         r"table_to_xml|schema_to_xml|database_to_xml|xmlgen|exec|execute|sys_exec|sys_eval|"
         r"pg_execute_server_program)", "it runs SQL or a program of its own"),
        (r"^(txid_current|pg_current_xact_id|pg_export_snapshot)$",
         "it assigns or exports a transaction identity (a write in a read-only transaction)"),
    ))
"""Functions no ``allow_functions`` can admit: each acts beyond the query, and why."""

UNSAFE_CLASSES = frozenset({
    "NextValueFor", "ReadCSV", "ReadParquet", "ToFile", "AIAgg", "AIClassify", "AIEmbed",
    "AIForecast", "AIGenerate", "AISimilarity", "AISummarizeAgg", "GenerateEmbedding",
    "GenerateText", "GenerateTable", "GenerateBool", "GenerateDouble", "GenerateInt",
    "MLForecast", "MLTranslate", "Predict", "Secret", "VectorSearch", "FeaturesAtTime",
})
"""sqlglot's modelled functions that are not plain computations (external calls, files,
sequences): treated as unknown -- the row must allow them, where they are allowable."""


# --- the rules ------------------------------------------------------------------------


@dataclass(frozen=True)
class Engine:
    """What the rules know of one engine a row may run on."""

    name: str
    """capgate's name for it (for messages)."""
    sqlglot: str
    """sqlglot's dialect name (its parser)."""
    safe: frozenset[str]
    """Function names (lowercase) a read may call there, beyond sqlglot's modelled
    built-ins: each only computes a value from its arguments, the clock or the catalog."""


@dataclass(frozen=True)
class ReadSite:
    """One SQL text of a row that may only read, and what the rules need to judge it."""

    sql: str
    engines: tuple[Engine, ...]
    """The engines the row may run on (its connector's declared dialects, or every
    engine when none is declared)."""
    allow: frozenset[str] = frozenset()
    """The row's ``allow_functions``, lowercased."""
    path: tuple[Any, ...] = ()
    """Where the SQL sits in the row (``("verify", 0, "sql")``): a rule may judge a read
    row's statements and a write's verify queries differently."""


@dataclass(frozen=True)
class ReadFinding:
    code: str
    message: str
    line: int = 1
    """Line within the SQL text (1-based)."""
    col: int = 1
    """Column within the SQL text (1-based)."""


Rule = Callable[[Any, ReadSite], Iterable[ReadFinding]]


def _where(node: Any, sql: str) -> tuple[int, int]:
    """Line and column (1-based) in ``sql`` where ``node`` starts: its first token's offset
    as sqlglot recorded it (1:1 when it recorded none)."""
    starts = [int(n.meta["start"]) for n in node.walk()
              if isinstance(getattr(n, "meta", None), dict) and "start" in n.meta]
    if not starts:
        return 1, 1
    offset = min(starts)
    line = sql.count("\n", 0, offset) + 1
    col = offset - (sql.rfind("\n", 0, offset) + 1) + 1
    return line, col


def _call_name(node: Any) -> tuple[str, str]:
    """(name, qualified name) of a function call node, lowercased."""
    from sqlglot import exp

    name = (node.name if isinstance(node, exp.Anonymous) else node.sql_name()).lower()
    parent = node.parent
    if isinstance(parent, exp.Dot) and parent.expression is node:
        qualifier = parent.this.sql().strip('"`').lower()
        return name, f"{qualifier}.{name}"
    return name, name


def _refused(name: str, qualified: str) -> str | None:
    for pattern, why in REFUSED:
        if pattern.search(qualified) or pattern.search(name):
            return why
    return None


def function_rule(tree: Any, site: ReadSite) -> Iterator[ReadFinding]:
    """CG139: every function call is known side-effect-free here, or allowed by the row."""
    from sqlglot import exp

    for node in tree.walk():
        if isinstance(node, exp.Column) and node.name.lower() == "nextval" and node.table:
            line, col = _where(node, site.sql)
            yield ReadFinding(UNSAFE_FUNCTION.code, f"{node.sql()} advances a sequence, which no "
                              "rollback undoes; a read cannot call it", line, col)
            continue
        if not isinstance(node, exp.Func) or isinstance(node, exp.Dot):
            continue
        modelled = not isinstance(node, exp.Anonymous) and type(node).__name__ \
            not in UNSAFE_CLASSES
        name, qualified = _call_name(node)
        line, col = _where(node.parent if qualified != name else node, site.sql)
        why = _refused(name, qualified)
        if why is not None:
            yield ReadFinding(UNSAFE_FUNCTION.code, f"{qualified}() is refused in read and verify "
                              f"SQL: {why}; no allow_functions entry can admit it", line, col)
            continue
        if modelled:
            continue
        if name in site.allow or qualified in site.allow:
            continue
        bare = qualified.split(".")[-1] if qualified.startswith(("pg_catalog.", "sys.")) \
            else qualified
        missing = [e.name for e in site.engines if bare not in e.safe]
        if not missing:
            continue
        yield ReadFinding(
            UNSAFE_FUNCTION.code,
            f"{qualified}() is not on the list of side-effect-free functions for "
            f"{', '.join(missing)}: a read may call only functions that compute a value; if "
            f"this one does, name it in the row's allow_functions for review", line, col)


_INTO_FILE = re.compile(r"\bINTO\s+(OUTFILE|DUMPFILE)\b", re.IGNORECASE)


def into_rule(tree: Any, site: ReadSite) -> Iterator[ReadFinding]:
    """CG144: a query that writes its result somewhere (a variable, a table)."""
    from sqlglot import exp

    for node in tree.walk():
        if isinstance(node, exp.Into):
            line, col = _where(node, site.sql)
            target = node.this.sql() if node.this is not None else ""
            yield ReadFinding(READ_SQL_ACTS.code, f"SELECT ... INTO {target} writes its result (a "
                              "variable or a table); a read only returns rows", line, col)


READ_RULES: tuple[Rule, ...] = (function_rule, into_rule)
"""Each rule judges one parsed query of a read site; add a rule here to check more."""


def _into_file(sql: str, engines: Sequence[Engine]) -> ReadFinding | None:
    """``INTO OUTFILE`` / ``INTO DUMPFILE`` outside literals and comments (sqlglot cannot
    parse them, so they are found in the tokens)."""
    if not _INTO_FILE.search(sql):
        return None
    from capgate.registry.sqltext import LITERALS, tokens

    found = tokens(sql, [e.sqlglot for e in engines]) or []
    words = [t for t in found if t.token_type.name not in LITERALS]
    for first, second in itertools.pairwise(words):
        if first.text.upper() == "INTO" and second.text.upper() in ("OUTFILE", "DUMPFILE"):
            what = second.text.upper()
            return ReadFinding(READ_SQL_ACTS.code, f"SELECT ... INTO {what} writes a "
                               "file on the database server; a read only returns rows",
                               int(first.line), max(1, int(first.col) - len(first.text) + 1))
    return None


@functools.lru_cache(maxsize=16384)
def read_findings(sql: str, engines: tuple[Engine, ...], allow: frozenset[str] = frozenset(),
                  path: tuple[Any, ...] = ()) -> tuple[ReadFinding, ...]:
    """Every finding of :data:`READ_RULES` for one read-only SQL text.

    The SQL is parsed with each engine's grammar (the first that reads it when
    none is declared); a text no grammar reads is left to the parse checks
    (CG120, CG170), which report it.
    """
    import sqlglot

    from capgate.registry.sqltext import QuietSqlglot, is_plsql_block

    site = ReadSite(sql, engines, allow, path)
    into = _into_file(sql, engines)
    if into is not None:
        return (into,)
    if is_plsql_block(sql):
        return (ReadFinding(READ_SQL_ACTS.code, "a PL/SQL block is not a query: a read, verify or "
                            "check runs one SELECT"),)
    grammars: list[str | None] = [e.sqlglot for e in engines] or [None]
    found: dict[tuple[str, str], ReadFinding] = {}
    parsed = False
    for grammar in [*grammars, *([None] if None not in grammars else [])]:
        try:
            with QuietSqlglot():
                trees = [t for t in sqlglot.parse(sql, read=grammar) if t is not None]
        except (sqlglot.errors.SqlglotError, RecursionError):
            continue
        parsed = True
        for tree in trees:
            for rule in READ_RULES:
                for finding in rule(tree, site):
                    found.setdefault((finding.code, finding.message), finding)
    if not parsed:
        return ()
    return tuple(found.values())
