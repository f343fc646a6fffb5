"""Resident memory of `snapcompile serve` (its worker processes included) once ready and after a
`bench-serve` load, beside llama.cpp's `llama-server` on the same model, alternating the systems.

    .venv/bin/python studies/serve_memory.py ARTIFACT [--llama-server BIN --gguf FILE --parallel 8
        --context 16384] [--rounds 2] [--requests 16] [--prompt-tokens 1000] [--session-cache-bytes auto]

Prints per system and round: RSS of the process tree (GiB) when /health first answers and after
the load, the load's failed requests, and each process's RSS (MiB). Without --llama-server only `serve` is measured.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from snapcompile.serve.process import free_port


def tree_rss_gib(pid: int) -> tuple[float, int, str]:
    """RSS (GiB) of `pid` and its children, how many processes that is, and each one's RSS (MiB)
    named by its program or Python module."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    total, parts = 0, []
    for member in [pid, *map(int, children)]:
        try:
            status = Path(f"/proc/{member}/status").read_text()
            argv = Path(f"/proc/{member}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        rss = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) * 1024
        total += rss
        parts.append(f"{_role(argv)} {rss / 2**20:.0f}")
    return total / 2**30, len(parts), ", ".join(parts)


def _role(argv: list[bytes]) -> str:
    """`-m MODULE`'s last name, or the program's name."""
    words = [word.decode(errors="replace") for word in argv]
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1].rsplit(".", 1)[-1]
    return Path(words[0]).name


def measure(name: str, command: list[str], port: int, args) -> None:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        time.sleep(2)
        ready, count, ready_parts = tree_rss_gib(process.pid)
        with tempfile.TemporaryDirectory() as scratch:
            load = subprocess.run([sys.executable, "-m", "snapcompile.cli", "bench-serve", f"http://127.0.0.1:{port}",
                                   "--model", "model", "--requests", str(args.requests), "--concurrency", "8",
                                   "--prompt-tokens", str(args.prompt_tokens), "--output-tokens", "32",
                                   "--tokenizer", str(args.artifact), "--json", "-o", f"{scratch}/bench.json"],
                                  capture_output=True, text=True, timeout=1800)
        after, _, after_parts = tree_rss_gib(process.pid)
        failed = json.loads(load.stdout)["summary"]["failed"] if load.stdout.strip() else "the load did not run"
        print(f"{name}: ready {ready:.2f} GiB ({count} processes), after the load {after:.2f} GiB; failed requests: "
              f"{failed}\n  MiB ready: {ready_parts}\n  MiB after: {after_parts}", flush=True)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--llama-server", type=Path)
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--session-cache-bytes", default="auto",
                        help="serve's store of kept conversations (0: off; it holds each finished request's rows)")
    args = parser.parse_args()
    port_a, port_b = free_port(), free_port()
    systems = [("snapcompile serve", [sys.executable, "-m", "snapcompile.cli", "serve", str(args.artifact),
                                      "--port", str(port_a), "--served-model-name", "model",
                                      "--session-cache-bytes", args.session_cache_bytes], port_a)]
    if args.llama_server is not None:
        systems.append((f"llama-server --parallel {args.parallel} -c {args.context}",
                        [str(args.llama_server), "-m", str(args.gguf), "--parallel", str(args.parallel), "-c",
                         str(args.context), "-t", "2", "--host", "127.0.0.1", "--port", str(port_b), "-a", "model"],
                        port_b))
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        for name, command, port in systems if round_ % 2 == 0 else systems[::-1]:
            measure(name, command, port, args)


if __name__ == "__main__":
    main()
