"""Worker processes that never outlive their parent.

A pool worker blocked on its task queue does not notice that the parent was killed (kill -9
leaves no chance to shut the pool down), so it and multiprocessing's resource tracker hang on.
:func:`exit_with_parent` is a pool ``initializer``: on Linux the kernel sends the worker SIGTERM
when the parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere, and as a second guard, a daemon
thread polls the parent's pid and exits the worker once it changes.

Exercised by ``lmforge data run`` with ``workers > 1`` and ``tests/test_utils_procs.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, interval: float) -> None:
    while True:
        time.sleep(interval)
        if os.getppid() != parent:  # re-parented: the parent is gone
            os._exit(1)


def exit_with_parent(parent_pid: int | None = None, poll_seconds: float = 1.0) -> None:
    """Make the calling (worker) process exit when its parent process dies.

    Pass the parent's pid when it is known (``initargs=(os.getpid(),)``): a parent that died
    before this ran is then caught at once rather than never.
    """
    parent = os.getppid() if parent_pid is None else parent_pid
    _set_pdeathsig(signal.SIGTERM)
    if os.getppid() != parent:  # died before the signal was armed
        os._exit(1)
    with contextlib.suppress(RuntimeError):
        threading.Thread(
            target=_watch_parent, args=(parent, poll_seconds), daemon=True, name="parent-watch"
        ).start()
