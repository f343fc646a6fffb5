"""The child side of serve.workers: load, bound the process, answer jobs until the parent goes.

`run_worker(fd, headroom_bytes, load, answer)`: `load()` makes the worker's state (an exception is
sent back as ("error", message) and the process ends), the address space is limited to what the
process holds then plus `headroom_bytes`, ("ready", None) is sent, and each job received is
answered with `answer(state, job)`, an ("ok", value) or ("error", message) pair. The process exits
when the connection closes or its parent is gone (even in the middle of a job that never ends).
"""
from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import psutil

PARENT_POLL_S = 1.0


def run_worker(fd: int, headroom_bytes: int, load: Callable[[], object],
               answer: Callable[[object, object], tuple[str, object]]) -> None:
    conn = Connection(fd)
    try:
        state = load()
    except Exception as err:          # a user error or a bug: the parent reports the message either way
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    _watch_parent(os.getppid())
    _limit_memory(headroom_bytes)
    _quiet_stderr()
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = answer(state, job)
        except MemoryError:
            reply = ("error", "the request ran out of memory in its worker (the worker's bound); refused")
        conn.send(reply)


def _limit_memory(headroom_bytes: int) -> None:
    """RLIMIT_AS = the address space held now + headroom: work that allocates more gets
    MemoryError (Python) or dies (native code), never the machine's memory."""
    try:
        held = psutil.Process().memory_info().vms
    except psutil.Error:        # no process table: no bound (the time bound still holds)
        return
    resource.setrlimit(resource.RLIMIT_AS, (held + headroom_bytes, held + headroom_bytes))


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _quiet_stderr() -> None:
    """Nothing reads this process's errors once it is ready (a job's error goes back as a message)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
