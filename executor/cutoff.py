"""Client-side deadlines: a connection that has not answered in time is cut.

A network partition closes nothing.  A read blocked on a socket whose peer went
silent waits for the kernel's TCP timers -- 15 minutes to 2 hours with the
defaults -- and the server-side timeouts capgate arms cannot help the client:
their answer travels over the cut network too.  So every wait capgate does on a
database connection has a deadline of its own, kept by one thread per process
(:data:`CUTTER`): when the deadline passes while the wait is still on, the
driver connection's socket is shut down (``Dialect.cut`` for a target, the
ledger backend's ``cut`` for the ledger), which makes the blocked read fail at
once as a lost connection.  The waiting code then says what it knows, and no
more: before COMMIT was sent nothing can commit (``rolled_back``); after it, the
outcome is ``unknown`` until resume has asked the server.

A :class:`Cut` is armed for a deadline and disarmed when the wait is over; a
disarmed cut never fires, and a cut that fired says so (:attr:`Cut.fired`), so
the waiting code can tell its own deadline from a server that hung up.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["CUTTER", "Cut", "cutting"]


class Cut:
    """One armed deadline on one connection: ``action`` runs at ``at`` unless disarmed."""

    __slots__ = ("_action", "_live", "_lock", "at", "fired")

    def __init__(self, at: float, action: Callable[[], object]) -> None:
        self.at = at
        """``time.monotonic()`` when the connection is cut."""
        self.fired = False
        """Whether the deadline passed with the wait still on (the connection was cut)."""
        self._action = action
        self._live = True
        self._lock = threading.Lock()

    def disarm(self) -> bool:
        """The wait is over: never cut.  Returns :attr:`fired` (False: disarmed in time)."""
        with self._lock:
            self._live = False
            return self.fired

    def fire(self) -> None:
        """Cut now, unless disarmed (the cutter's thread calls this at :attr:`at`)."""
        with self._lock:
            if not self._live:
                return
            self._live = False
            self.fired = True
        with contextlib.suppress(Exception):  # a socket already closed: nothing to cut
            self._action()

    @property
    def armed(self) -> bool:
        return self._live


class _Cutter:
    """One thread per process that fires cuts at their (monotonic) times.

    Arming is a heap push (the thread is woken only when the new cut is the
    earliest); a disarmed cut stays in the heap until its time and is then
    dropped unread, so disarming costs nothing but a flag.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Cut]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def arm(self, at: float, action: Callable[[], object]) -> Cut:
        """A cut at ``at`` (``time.monotonic()``) running ``action``."""
        cut = Cut(at, action)
        with self._cv:
            if self._pid != os.getpid():  # forked: the parent's thread does not exist here
                self._heap, self._thread, self._pid = [], None, os.getpid()
            earliest = not self._heap or at < self._heap[0][0]
            heapq.heappush(self._heap, (at, next(self._seq), cut))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="capgate-cutter",
                                                daemon=True)
                self._thread.start()
            elif earliest:
                self._cv.notify()
        return cut

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                at, _, cut = self._heap[0]
                delay = at - time.monotonic()
                if delay > 0:
                    self._cv.wait(delay)
                    continue
                heapq.heappop(self._heap)
            if cut.armed:
                cut.fire()


CUTTER = _Cutter()


@contextlib.contextmanager
def cutting(seconds: float, action: Callable[[], object]) -> Iterator[Cut]:
    """Run the block with ``action`` armed ``seconds`` from now; disarmed when it ends."""
    cut = CUTTER.arm(time.monotonic() + max(0.0, seconds), action)
    try:
        yield cut
    finally:
        cut.disarm()
