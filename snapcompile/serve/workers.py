"""Worker processes that can be killed: client-sized or file-defined work that a thread could
neither stop nor bound (a chat template, a tokenizer's regex, a JSON body of a million small lists).

A `Lane` holds a few `WorkerProcess`es and runs one job at a time on each, within a deadline that
counts the wait for an idle worker and the job's sending: a busy lane refuses, it does not queue
without bound, and a worker that stops reading (stopped, stuck) cannot hold a sender past it. A job
past its deadline has its worker killed and started again at once (its start is not the next job's
time). The child side is serve.worker_side.run_worker.
"""
from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from snapcompile.errors import SnapcompileError

START_TIMEOUT_S = 120.0         # to import and load what a worker needs
INLINE_SEND_BYTES = 64 * 1024   # a job this small fits the socket's empty buffer: its write cannot block


def start_all(workers: list[WorkerProcess]) -> None:
    """Launch every worker at once (each imports for ~1 s), then wait for each; on a failure every
    one is stopped."""
    try:
        for worker in workers:
            worker.launch()
        for worker in workers:
            worker.wait_ready()
    except BaseException:
        for worker in workers:
            worker.stop()
        raise


class Lane:
    """Jobs of one kind on `workers`, one job per worker at a time (thread-safe)."""

    def __init__(self, name: str, workers: list[WorkerProcess]):
        self.name, self.workers = name, workers
        self._idle: queue.Queue[WorkerProcess] = queue.Queue()
        for worker in workers:
            self._idle.put(worker)

    def run(self, job, timeout_s: float, late: str):
        """`job`'s answer within `timeout_s`, the wait for an idle worker included (the start of a
        worker replacing a killed one is not counted: that was the killed job's cost)."""
        started = time.monotonic()
        try:
            worker = self._idle.get(timeout=timeout_s)
        except queue.Empty:
            raise SnapcompileError(f"{late} (the {self.name} workers stayed busy)") from None
        try:
            worker.ensure_ready()
            return worker.call(job, timeout_s - (time.monotonic() - started), late)
        finally:
            self._idle.put(worker)


class WorkerProcess:
    """One worker process (`python -m MODULE *args FD`, answering on the connection at FD as
    serve.worker_side.run_worker does), started again after it was killed or died."""

    def __init__(self, role: str, module: str, args: list[str], env: dict[str, str] | None = None):
        """`role` names the worker in errors ("tokenizer worker")."""
        self.role, self.module, self.args, self.env = role, module, list(args), dict(env or {})
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def launch(self) -> None:
        """Start the process (it loads what it needs meanwhile); `wait_ready` waits for it."""
        self._ready = False
        ours, theirs = socket.socketpair()
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env={**os.environ, "MALLOC_ARENA_MAX": "2", **self.env},
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, start_new_session=True)
        self._conn = Connection(ours.detach())

    def wait_ready(self) -> None:
        if not self._conn.poll(START_TIMEOUT_S):
            self.stop()
            raise SnapcompileError(f"a {self.role} did not start within {START_TIMEOUT_S:g} s")
        try:
            status, detail = self._conn.recv()
        except EOFError:
            detail = self._stderr_tail()
            self.stop()
            raise SnapcompileError(f"a {self.role} could not start: {detail}") from None
        if status != "ready":
            self.stop()
            raise SnapcompileError(f"a {self.role} could not start: {detail}")
        self._process.stderr.close()
        self._ready = True

    def ensure_ready(self) -> None:
        if self._process is None:
            self.launch()
        if not self._ready:
            self.wait_ready()

    def call(self, job, timeout_s: float, late: str):
        """`job`'s answer; past `timeout_s` (counted from before the job is sent), or when the process
        dies, the process is replaced (started again at once, so the next job finds it loaded) and the
        job refused."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            if not self._send_by(bytes(ForkingPickler.dumps(job)), deadline) or \
                    not self._conn.poll(max(0.0, deadline - time.monotonic())):
                self._replace()
                raise SnapcompileError(late)
            status, value = self._conn.recv()
        except (EOFError, OSError):
            code = self._process.wait()
            self._replace()
            raise SnapcompileError(f"the {self.role} died on this request (exit {code}); refused") from None
        if status == "error":
            raise SnapcompileError(value)
        return value

    def _send_by(self, payload: bytes, deadline: float) -> bool:
        """Send a pickled job (what the child's Connection.recv reads); False when the worker has not
        taken it all by `deadline`. A large one is written on a thread of its own: a worker that
        stopped reading would block the write, and killing the worker (the caller's next step)
        fails that write and ends the thread."""
        if len(payload) <= INLINE_SEND_BYTES:
            self._conn.send_bytes(payload)
            return True
        failures: list[OSError] = []

        def send():
            try:
                self._conn.send_bytes(payload)
            except Exception as err:    # the worker died (EPIPE), or was killed and the connection closed
                failures.append(err if isinstance(err, OSError) else OSError(str(err)))
        sender = threading.Thread(target=send, name=f"{self.role} send", daemon=True)
        sender.start()
        sender.join(max(0.0, deadline - time.monotonic()))
        if sender.is_alive():
            return False
        if failures:
            raise failures[0]
        return True

    def _stderr_tail(self) -> str:
        try:
            lines = self._process.stderr.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            return "no output"
        return lines[-1] if lines else f"exit {self._process.wait()}"

    def _replace(self) -> None:
        self.stop()
        self.launch()

    def stop(self) -> None:
        with self._lock:
            process, conn = self._process, self._conn
            self._process = self._conn = None
        if process is not None and process.poll() is None:
            process.kill()
        if process is not None:
            process.wait()
            if process.stderr is not None and not process.stderr.closed:
                process.stderr.close()
        if conn is not None:
            conn.close()
