"""Check the files of a large registry in several processes.

Loading 10,000 rows is CPU-bound Python (libyaml's events, the row checks,
sqlglot's parser), so threads would not help; processes do.  Workers are
forked so that they start in milliseconds with every module already imported,
and they read the texts from the memory they inherit rather than through a
pipe.  Only the findings and the clean rows travel back, as plain data.

The calling process works too: it must build the rows of every file anyway,
and one more process than there are CPUs would only make them take turns.
It claims files from the front of the list, the workers from the back, under
one lock in shared memory, so nobody waits for anybody to hand out work and
they meet wherever their speeds put them.

Forking is only safe in a process that has no other thread (a thread holding
a lock at the fork leaves that lock held forever in the child), so a process
with threads -- the MCP server, an application embedding the library --
checks its files in the calling thread.  So does a small registry, where
starting workers costs more than it saves.  A worker that dies (killed, out of
memory) fails the load with ``LoadWorkerFailed`` instead of hanging it, and a
worker whose parent died stops.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

from capgate.registry.errors import ConfigError, LoadWorkerFailed
from capgate.registry.fastload.filecheck import CheckedFile, check_file

#: Below this much YAML (about 900 rows) starting workers costs more than it saves.
PARALLEL_MIN_CHARS = 1_000_000
MAX_WORKERS = 8
WORKERS_ENV = "CAPGATE_LOAD_WORKERS"
#: How long to wait for the claim lock before checking that the other side is alive.
_LOCK_PATIENCE = 1.0

# The texts being checked, inherited by forked workers (set only around a parallel load).
_TEXTS: Sequence[tuple[str, str]] = ()


class _Gone(Exception):
    """The process on the other side of the claims died."""


class _Claims:
    """The files nobody has claimed yet: indexes ``front`` to ``back - 1``, in shared memory."""

    def __init__(self, ctx: Any, count: int) -> None:
        self.lock = ctx.Lock()
        self.bounds = ctx.RawArray("i", [0, count])

    def take(self, *, from_back: bool, others_alive: Callable[[], bool]) -> int | None:
        while not self.lock.acquire(timeout=_LOCK_PATIENCE):
            if not others_alive():  # it may have died holding the lock
                raise _Gone
        try:
            front, back = self.bounds[0], self.bounds[1]
            if front >= back:
                return None
            if from_back:
                self.bounds[1] = back - 1
                return int(back - 1)
            self.bounds[0] = front + 1
            return int(front)
        finally:
            self.lock.release()


def _work_from_back(conn: Connection, claims: _Claims, parent: int,
                    inherited: list[Connection]) -> None:
    """A worker's life: check files from the back until none is left, then say so.

    A file whose check raises is sent back as ``(index, None)``: the caller
    checks it again itself, so the exception is raised where it would have
    been without workers.  The read ends of the pipes, inherited at the fork,
    are closed first: a worker must not keep its own pipe open, or its sends
    would not fail once the parent is gone.  It also stops at the next file
    when its parent has died, and leaves Ctrl-C to its parent.
    """
    for other in inherited:
        other.close()
    # Ctrl-C reaches the whole process group: the caller stops the load and kills
    # its workers, so a worker need not print a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def parent_alive() -> bool:
        return os.getppid() == parent

    try:
        while parent_alive() and (index := claims.take(
                from_back=True, others_alive=parent_alive)) is not None:
            source, text = _TEXTS[index]
            try:
                checked: CheckedFile | None = check_file(source, text)
            except Exception:
                checked = None
            conn.send((index, checked))
        conn.send(None)
    except (_Gone, BrokenPipeError):
        pass  # the parent is gone; nobody is waiting for the rest
    finally:
        conn.close()


def worker_count(items: Sequence[tuple[str, str]], requested: int | None = None) -> int:
    """How many processes check ``items``, the caller's included; 1: the caller alone.

    ``requested`` (or ``CAPGATE_LOAD_WORKERS``) sets the number; otherwise it
    is one per CPU this process may run on, when there is enough text.  Either
    way it is 1 where forking is unsafe or unavailable.
    """
    if requested is None:
        raw = os.environ.get(WORKERS_ENV, "").strip()
        if raw:
            try:
                requested = int(raw)
            except ValueError:
                raise ConfigError(f"{WORKERS_ENV}={raw!r}: expected a whole number of processes",
                                  variable=WORKERS_ENV) from None
            if requested < 0:
                raise ConfigError(f"{WORKERS_ENV}={raw!r}: expected 0 or more processes",
                                  variable=WORKERS_ENV)
    if requested is None:
        if sum(len(text) for _, text in items) < PARALLEL_MIN_CHARS:
            return 1
        requested = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    if not _fork_is_safe():
        return 1
    return max(1, min(requested, len(items), MAX_WORKERS))


def _fork_is_safe() -> bool:
    return (sys.platform.startswith("linux") and threading.active_count() == 1
            and "fork" in multiprocessing.get_all_start_methods())


_DONE, _DIED = object(), object()
#: A file's findings and rows pickle to about 0.4 MB per 500 rows; a pipe holds 64 KB,
#: so a worker would wait for the parent's reader thread at every result.
_PIPE_BYTES = 4 << 20


def _widen(conn: Connection) -> None:
    """Make the pipe behind ``conn`` hold a few results (as much as Linux allows)."""
    import fcntl  # here: only the fork path (Linux) comes here, and Windows has no fcntl

    setpipe = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setpipe is None:
        return
    for size in (_PIPE_BYTES, 1 << 20):  # 1 MB: the default limit for unprivileged users
        try:
            fcntl.fcntl(conn.fileno(), setpipe, size)
            return
        except OSError:
            continue


def _receive(conn: Connection, inbox: queue.SimpleQueue[Any]) -> None:
    """Move one worker's results into ``inbox``, so it never waits on a full pipe."""
    try:
        while (message := conn.recv()) is not None:
            inbox.put(message)
        inbox.put(_DONE)
    except (EOFError, OSError):
        inbox.put(_DIED)


def check_files(items: Sequence[tuple[str, str]],
                workers: int | None = None) -> Iterator[tuple[int, CheckedFile]]:
    """``(index, check_file(*items[index]))`` for every item, in the order they finish.

    ``worker_count`` processes share the work, the caller's included (see the
    module's docstring).  The caller builds rows from each result as it
    arrives; the cross-file rules come after, in file order.
    """
    count = worker_count(items, workers)
    if count <= 1:
        for index, (source, text) in enumerate(items):
            yield index, check_file(source, text)
        return
    global _TEXTS
    _TEXTS = items
    ctx = multiprocessing.get_context("fork")
    claims = _Claims(ctx, len(items))
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    procs: list[Any] = []
    receivers: list[Connection] = []
    readers: list[threading.Thread] = []
    try:
        for _ in range(count - 1):
            receiving, sending = ctx.Pipe(duplex=False)
            _widen(receiving)
            proc = ctx.Process(target=_work_from_back, daemon=True,
                               args=(sending, claims, os.getpid(), [*receivers, receiving]))
            proc.start()
            sending.close()
            procs.append(proc)
            receivers.append(receiving)
        for conn in receivers:  # threads only once every worker is forked
            reader = threading.Thread(target=_receive, args=(conn, inbox), daemon=True)
            reader.start()
            readers.append(reader)
        yield from _share(items, claims, inbox, procs)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()  # only when the load stopped early
            proc.join()
        for reader in readers:
            reader.join()
        for conn in receivers:
            conn.close()
        _TEXTS = ()


def _share(items: Sequence[tuple[str, str]], claims: _Claims, inbox: queue.SimpleQueue[Any],
           procs: list[Any]) -> Iterator[tuple[int, CheckedFile]]:
    """The caller's part: check files from the front, pass on what the workers send."""
    def workers_alive() -> bool:
        return all(proc.exitcode in (None, 0) for proc in procs)

    running, claiming = len(procs), True
    try:
        while claiming or running:
            if claiming:
                index = claims.take(from_back=False, others_alive=workers_alive)
                if index is None:
                    claiming = False
                else:
                    source, text = items[index]
                    yield index, check_file(source, text)
            while running:  # what arrived meanwhile; once nothing is left to claim, wait
                try:
                    message = inbox.get(block=not claiming)
                except queue.Empty:
                    break
                if message is _DONE:
                    running -= 1
                elif message is _DIED:
                    raise _Gone
                elif message[1] is None:  # it raised in the worker: raise it here
                    source, text = items[message[0]]
                    yield message[0], check_file(source, text)
                else:
                    yield message
    except _Gone:
        raise LoadWorkerFailed(
            "a process checking capability files died before it finished; "
            f"set {WORKERS_ENV}=1 to check them in this process",
            workers=len(procs), exit_codes=[proc.exitcode for proc in procs],
        ) from None
