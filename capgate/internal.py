"""Internal errors: a bug said as a bug, never as a refusal or a silent success.

The CLI and the MCP server both turn an unexpected exception into
``InternalError`` (``CG999``, exit 5) with :func:`internal_error`, which says
how to report it and whether the case was left with an open intent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from capgate.registry.errors import InternalError

if TYPE_CHECKING:
    from capgate.executor.ledger import Ledger


def internal_error(exc: BaseException, case: object = None, config: str | None = None,
                   ledger: Ledger | None = None) -> InternalError:
    """A bug, said as such: what failed, how to report it, and whether ``case`` is left open.

    The case's open intents are read from ``ledger``, else from the ledger that
    ``config`` names; if that read fails too, the answer says it is unknown.
    """
    lines = str(exc).strip().splitlines()
    what = f"{type(exc).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")
    open_intents: list[str] | None = None
    if isinstance(case, str) and case:
        try:
            if ledger is None:
                from capgate.config import load_settings
                from capgate.executor.ledger import open_ledger

                with open_ledger(load_settings(config).ledger_url) as opened:
                    summaries = opened.cases(open_only=True)
            else:
                summaries = ledger.cases(open_only=True)
            found = [c for c in summaries if c.case_id == case]
            open_intents = found[0].open_intents if found else []
        except Exception:  # the ledger itself may be what failed: say we do not know
            open_intents = None
    if open_intents is None:
        left = (f"whether case {case!r} was left with an open intent is unknown; run "
                f"`capgate cases --open`" if isinstance(case, str) and case else
                "no case was involved")
    elif open_intents:
        left = (f"case {case!r} has {len(open_intents)} open intent(s); run "
                f"`capgate resume {case}` before more work in it")
    else:
        left = f"case {case!r} has no open intent"
    return InternalError(
        f"internal error: {what}; this is a bug in capgate, not a mistake of yours: report "
        f"it with the output of the same command run with --traceback; {left}",
        exception=type(exc).__name__, case=case if isinstance(case, str) else None,
        open_intents=open_intents)
