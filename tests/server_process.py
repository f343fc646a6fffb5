"""Start `snapcompile serve` as a real process on a free local port, and wait for it."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    def __init__(self, artifact: Path, *args: str, model: str = "tiny", log: Path | None = None,
                 launcher: tuple[str, ...] = ("-m", "snapcompile.cli", "serve")):
        """launcher: what runs `serve` (tests.fault_server plants a bug in the engine thread)."""
        self.port, self.model = free_port(), model
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, *launcher, str(artifact), "--port", str(self.port),
                   "--served-model-name", model, "--log-level", "warning", *args]
        self.log = open(log, "w+") if log else subprocess.DEVNULL
        self.process = subprocess.Popen(command, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the server exited with {self.process.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        raise TimeoutError("the server did not become healthy")

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric("snapcompile_slots_in_use")."""
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> int:
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
