"""Chat templates and tokenization in worker processes, each job bounded in time and memory.

The chat template and the tokenizer are files of the artifact: a template can loop or allocate
without bound, a tokenizer's pre-tokenizer regex can be quadratic. On a thread neither can be
stopped (Rust code cannot be interrupted, a trace deadline does not bound allocation); a process
can. Each worker loads the artifact's tokenizer (without torch), runs under an address-space limit
of what it holds once loaded plus `headroom_bytes`, and answers one job at a time; a job past its
deadline has its worker killed, and a fresh worker takes its place at the next job. Workers come in
two lanes with workers of their own, chat (template and tokenization) and text (tokenization), so
a request that needs no template never waits behind templates. A job's deadline counts the wait
for a worker too: a busy lane refuses, it does not queue without bound.
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
from pathlib import Path

from snapcompile.errors import SnapcompileError

HEADROOM_BYTES = 2 * 2**30      # what a worker may allocate beyond its loaded tokenizer
START_TIMEOUT_S = 120.0         # to import and load the tokenizer
LANES = ("chat", "text")


class TokenizerPool:
    """`workers` processes per lane for the artifact in `folder`. `chat(messages, max_chars)` and
    `text(text)` return token ids or raise SnapcompileError; both block (call them from a worker
    thread) for at most `timeout_s`. Thread-safe."""

    def __init__(self, folder: Path, workers: int = 1, timeout_s: float = 10.0, headroom_bytes: int = HEADROOM_BYTES):
        self.timeout_s = timeout_s
        self._lanes = {lane: _Lane(lane, [_Worker(Path(folder), headroom_bytes) for _ in range(workers)])
                       for lane in LANES}
        try:
            for worker in self._all_workers():
                worker.launch()               # all at once: each imports transformers for ~1 s
            for worker in self._all_workers():
                worker.wait_ready()
        except BaseException:
            self.close()
            raise

    def chat(self, messages: list[dict], max_chars: int | None = None) -> list[int]:
        """The token ids of `messages` through the chat template, rendered to at most `max_chars`."""
        return self._lanes["chat"].run(("chat", messages, max_chars), self.timeout_s,
                                       f"the chat template did not render within {self.timeout_s:g} s; refused")

    def text(self, text: str) -> list[int]:
        return self._lanes["text"].run(("text", text, None), self.timeout_s,
                                       f"the tokenizer did not finish within {self.timeout_s:g} s; refused")

    def pids(self) -> list[int]:
        """The worker processes running now."""
        return [worker.pid for worker in self._all_workers() if worker.pid is not None]

    def _all_workers(self) -> list[_Worker]:
        return [worker for lane in self._lanes.values() for worker in lane.workers]

    def close(self) -> None:
        for worker in self._all_workers():
            worker.stop()


class _Lane:
    def __init__(self, name: str, workers: list[_Worker]):
        self.name, self.workers = name, workers
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for worker in workers:
            self._idle.put(worker)

    def run(self, job: tuple, timeout_s: float, late: str) -> list[int]:
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


class _Worker:
    """One worker process, started again after it was killed or died."""

    def __init__(self, folder: Path, headroom_bytes: int):
        self.folder, self.headroom_bytes = folder, headroom_bytes
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def launch(self) -> None:
        """Start the process (it loads the tokenizer meanwhile); `wait_ready` waits for it."""
        self._ready = False
        ours, theirs = socket.socketpair()
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
               "MALLOC_ARENA_MAX": "2"}
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "snapcompile.serve.tokenizer_worker", str(self.folder),
                 str(theirs.fileno()), str(self.headroom_bytes)],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, start_new_session=True)
        self._conn = Connection(ours.detach())

    def wait_ready(self) -> None:
        if not self._conn.poll(START_TIMEOUT_S):
            self.stop()
            raise SnapcompileError(f"a tokenizer worker did not start within {START_TIMEOUT_S:g} s")
        try:
            status, detail = self._conn.recv()
        except EOFError:
            detail = self._stderr_tail()
            self.stop()
            raise SnapcompileError(f"a tokenizer worker could not start: {detail}") from None
        if status != "ready":
            self.stop()
            raise SnapcompileError(f"a tokenizer worker could not start: {detail}")
        self._process.stderr.close()
        self._ready = True

    def ensure_ready(self) -> None:
        if self._process is None:
            self.launch()
        if not self._ready:
            self.wait_ready()

    def call(self, job: tuple, timeout_s: float, late: str) -> list[int]:
        """`job`'s answer; past `timeout_s`, or when the process dies, the process is replaced
        (started again at once, so the next job finds it loaded) and the job refused."""
        try:
            self._conn.send(job)
            if not self._conn.poll(max(0.0, timeout_s)):
                self._replace()
                raise SnapcompileError(late)
            status, value = self._conn.recv()
        except (EOFError, OSError):
            code = self._process.wait()
            self._replace()
            raise SnapcompileError(f"the tokenizer worker died on this prompt (exit {code}); refused") from None
        if status == "error":
            raise SnapcompileError(value)
        return value

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
