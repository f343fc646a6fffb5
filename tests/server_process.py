"""Start `snapcompile serve` as a real process on a free local port, and wait for it."""
from __future__ import annotations

from pathlib import Path

import httpx

from snapcompile.serve.process import ServerProcess as _ServerProcess
from snapcompile.serve.process import free_port

REPO = Path(__file__).resolve().parents[1]
__all__ = ["REPO", "ServerProcess", "free_port"]


class ServerProcess(_ServerProcess):
    def __init__(self, artifact: Path, *args: str, **kwargs):
        super().__init__(artifact, *args, cwd=REPO, **kwargs)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric("snapcompile_slots_in_use")."""
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0
