"""Ctrl-C and SIGTERM end a run as a KeyboardInterrupt, but never half-way through a write to
the run's record.

Raised at any bytecode, the interrupt once landed inside MLflow's sqlite store, between a
transaction's write and its commit: the dangling transaction kept the database locked, and
the handler that marks the run KILLED then failed with "database is locked" (seen in a CI run,
`test_interrupted_run_is_marked_killed_and_keeps_its_checkpoint[SIGTERM]`). Writes to the
store run `shielded()`: a signal that arrives meanwhile is held and raised as the block ends.

Ray's `ray.get` and `ray.wait` replace an interrupt raised while they wait with a bare
`KeyboardInterrupt()`, which drops the signal's number: `received()` names the signal all
the same (a SIGTERM was once reported as SIGINT, exit 130, in a CI run of that test).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator, Optional

_depth = 0  # shielded blocks open on the main thread
_pending: Optional[int] = None  # a signal that arrived inside one
_last: Optional[int] = None  # the last signal handled here


def _interrupt(signum: int, frame) -> None:
    global _pending, _last
    _last = signum
    if _depth:
        _pending = signum
        return
    raise KeyboardInterrupt(signum)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Hold an interrupt until the block ends (on the main thread; elsewhere signals are not
    delivered anyway)."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _pending is not None:
            signum, _pending = _pending, None
            raise KeyboardInterrupt(signum)


def received(interrupt: KeyboardInterrupt) -> int:
    """The signal that raised `interrupt`: its own argument, else the last one handled here,
    else SIGINT (Python's own Ctrl-C)."""
    if interrupt.args and isinstance(interrupt.args[0], int):
        return interrupt.args[0]
    return _last if _last is not None else signal.SIGINT


def install() -> dict[int, Callable]:
    """Make SIGINT and SIGTERM interrupts that wait for shielded blocks; returns the handlers
    they replace (for `restore`). A no-op off the main thread."""
    global _last
    if threading.current_thread() is not threading.main_thread():
        return {}
    _last = None
    return {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}


def restore(previous: dict[int, Callable]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)
