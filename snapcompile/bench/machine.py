"""Machine measurements: resident memory and memory bandwidth (psutil, Linux /proc, numpy)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from snapcompile.memory import process_status_kib


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return psutil.Process().memory_info().rss


def file_rss_kib(path: Path) -> int:
    """KiB of this process's RSS in its mappings of the file `path`."""
    target = str(Path(path).resolve())
    return sum(m.rss for m in psutil.Process().memory_maps(grouped=True) if m.path == target) // 1024


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset_peak_rss()."""
    return process_status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0); ignored where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass



def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Sustained copy bandwidth in bytes/s (bytes read + bytes written), best of `repeats`.

    A multithreaded copy (torch, all intra-op threads) of an array much larger than the caches:
    the kind of streaming a decode step does.
    """
    import torch
    source = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / _best_seconds(lambda: target.copy_(source), repeats)


def memory_read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Sustained read bandwidth in bytes/s, best of `repeats`: a multithreaded sum (torch, all
    intra-op threads) of an array much larger than the caches. A decode step reads its weights
    and KV rows and writes almost nothing, so this, not the copy figure, bounds it."""
    import torch
    source = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    return source.numel() * 4 / _best_seconds(source.sum, repeats)


def matmul_flops(size: int = 1536, repeats: int = 5) -> float:
    """Sustained float32 matrix-multiply throughput in FLOP/s (all intra-op threads), best of `repeats`."""
    import torch
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    return 2 * size ** 3 / _best_seconds(lambda: torch.mm(a, b), repeats)


def _best_seconds(work, repeats: int) -> float:
    """The fastest of `repeats` timed calls of work() (perf_counter seconds)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


ISA_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")


def cpu_description() -> dict:
    """The CPU a figure was measured on: model name, the ISA features the kernels can use, cores,
    and the 1/5/15-minute load averages at the time (Linux /proc; empty fields elsewhere)."""
    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    try:
        load = [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        load = []
    return {"model": name, "isa": [f for f in ISA_FEATURES if f in flags], "cores": os.cpu_count(), "load": load}


def describe_cpu(cpu: dict) -> str:
    """One line naming the CPU, e.g. "AMD EPYC, 2 cores, ISA avx2 fma, load 0.3 / 0.2 / 0.1"."""
    load = " / ".join(f"{v:.1f}" for v in cpu.get("load", []))
    return (f"{cpu.get('model') or 'unknown CPU'}, {cpu.get('cores')} cores, ISA {' '.join(cpu.get('isa', [])) or '-'}"
            + (f", load {load}" if load else ""))
