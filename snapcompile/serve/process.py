"""`snapcompile serve` as a child process on a free local port: for the tools that drive a real
server (the RULER evaluation through lm-evaluation-harness, the tests)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from snapcompile.errors import SnapcompileError

SERVE = ("-m", "snapcompile.cli", "serve")


def _stop_with_parent(parent: int):
    """A preexec function: on Linux the child gets SIGTERM (and drains) when the process that started
    it dies, even by SIGKILL, so a killed tool leaves no server behind. (The signal follows the
    thread that started the child: start servers from a thread that lives as long as they do.)"""
    if not sys.platform.startswith("linux"):
        return None

    def stop_with_parent() -> None:
        import ctypes
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:            # it died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return stop_with_parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """A `serve` process of `artifact` on 127.0.0.1; `args` are more serve options. Its output goes
    to `log` (a file path), or nowhere. Use as a context manager, or call wait_ready() and stop()."""

    def __init__(self, artifact: Path, *args: str, model: str = "tiny", log: Path | None = None,
                 launcher: tuple[str, ...] = SERVE, cwd: Path | None = None):
        """launcher: what runs `serve` (the tests' fault server plants a bug in the engine thread)."""
        self.port, self.model, self.log_path = free_port(), model, log
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, *launcher, str(artifact), "--port", str(self.port),
                   "--served-model-name", model, "--log-level", "warning", *args]
        self.log = open(log, "w+") if log else subprocess.DEVNULL
        self.process = subprocess.Popen(command, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                        preexec_fn=_stop_with_parent(os.getpid()))

    def wait_ready(self, timeout_s: float = 120.0) -> ServerProcess:
        """Wait until /health answers 200; a server that exits or stays unhealthy is an error
        naming the end of its log."""
        import httpx
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SnapcompileError(f"the server exited with {self.process.returncode} before it was ready"
                                       f"{self._log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise SnapcompileError(f"the server did not become healthy within {timeout_s:.0f} s{self._log_tail()}")

    def _log_tail(self, chars: int = 2000) -> str:
        if self.log_path is None or not Path(self.log_path).is_file():
            return ""
        return ":\n" + Path(self.log_path).read_text(errors="replace")[-chars:]

    def stop(self) -> int:
        """SIGTERM (the server drains and exits), SIGKILL after a minute; returns the exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if hasattr(self.log, "close"):
            self.log.close()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
