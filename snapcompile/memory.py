"""Host memory facts and the one check that a size fits in them, made before anything is allocated.
psutil reads the machine's and the process's figures; /proc/self/status is read here alone, for
the ones psutil does not give (the peak VmHWM, which /proc/self/clear_refs resets, RssAnon, RssFile)."""
from __future__ import annotations

import psutil

from snapcompile.errors import SnapcompileError


def available_host_memory() -> int:
    """Bytes of host memory available to new allocations (Linux MemAvailable)."""
    return psutil.virtual_memory().available


def process_status_kib(field: str) -> int:
    """A KiB figure of this process's /proc/self/status that psutil does not give (VmHWM, RssAnon,
    RssFile)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} is not in /proc/self/status")


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_fits(needed: int, what: str, advice: str, available: int | None = None) -> None:
    """Refuse, before allocating anything, `needed` bytes that exceed the memory available here."""
    available = available_host_memory() if available is None else available
    if needed > available:
        raise SnapcompileError(f"{what} needs about {gib(needed)} but only {gib(available)} is available here; "
                               f"{advice}")
