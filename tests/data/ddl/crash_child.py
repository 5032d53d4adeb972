"""A DDL loop process that the crash tests kill with SIGKILL at a chosen event.

Usage: crash_child.py TARGET_URL LEDGER_URL PLAN_JSON STOP_KIND STOP_INDEX

Every event kind is printed to stdout (flushed) as it is recorded; at the
STOP_INDEX-th occurrence of STOP_KIND the process prints ``STOPPED`` and
waits to be killed -- so the parent knows exactly which boundary it is past.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main() -> None:
    target, ledger, plan_path, stop_kind, stop_index = sys.argv[1:6]
    sys.path.insert(0, ".")
    from capgate.ddl.loop import DdlLoop
    from capgate.ddl.snapshots import SqlSnapshotStore

    seen: dict[str, int] = {}

    class StoppingSink:
        def record(self, kind: str, payload: dict[str, Any]) -> None:
            seen[kind] = seen.get(kind, 0) + 1
            print(kind, flush=True)
            if kind == stop_kind and seen[kind] == int(stop_index):
                print("STOPPED", flush=True)
                time.sleep(120)

    def hook(snapshot_ids: list[str]) -> None:
        print("HOOK " + ",".join(snapshot_ids), flush=True)

    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    loop = DdlLoop(target, SqlSnapshotStore(ledger), sink=StoppingSink())
    outcome = loop.execute(plan, on_apply_started=hook)
    print("OUTCOME " + outcome.outcome, flush=True)


if __name__ == "__main__":
    main()
