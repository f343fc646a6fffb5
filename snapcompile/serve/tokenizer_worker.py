"""A tokenizer worker process (started by serve.tokenizer_pool): `python -m
snapcompile.serve.tokenizer_worker FOLDER FD HEADROOM_BYTES`.

Loads the artifact's tokenizer without torch, limits its own address space to what it then holds
plus HEADROOM_BYTES, answers ("ready", None) on the connection at FD, then one job at a time:
("chat", messages, max_chars) or ("text", text, None) -> ("ok", ids) | ("error", message). It
exits when the connection closes or its parent is gone.
"""
from __future__ import annotations

import os
import resource
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

PARENT_POLL_S = 1.0


def main(folder: Path, fd: int, headroom_bytes: int) -> None:
    conn = Connection(fd)
    try:
        tokenizer = _load(folder)
    except Exception as err:          # a user error or a bug: the pool reports the message either way
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
        conn.send(_answer(tokenizer, job))


def _load(folder: Path):
    sys.modules["torch"] = None       # transformers then loads as tokenizer-only (~130 MB instead of ~310 MB)
    from snapcompile.artifact.files import artifact_tokenizer
    from snapcompile.artifact.manifest import read_manifest
    return artifact_tokenizer(folder, read_manifest(folder))


def _answer(tokenizer, job) -> tuple[str, object]:
    from snapcompile.errors import SnapcompileError
    from snapcompile.prompts import encode_messages, encode_text
    kind, payload, max_chars = job
    try:
        if kind == "chat":
            return "ok", encode_messages(tokenizer, payload, timeout_s=None, max_chars=max_chars)
        return "ok", encode_text(tokenizer, payload)
    except SnapcompileError as err:
        return "error", str(err)
    except MemoryError:
        return "error", "the tokenizer ran out of memory on this prompt; refused"


def _limit_memory(headroom_bytes: int) -> None:
    """RLIMIT_AS = the address space held now + headroom: a template or tokenizer that allocates
    more gets MemoryError (Python) or dies (Rust), never the machine's memory."""
    held = _address_space_bytes()
    if held is not None:
        resource.setrlimit(resource.RLIMIT_AS, (held + headroom_bytes, held + headroom_bytes))


def _address_space_bytes() -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _watch_parent(parent: int) -> None:
    """Exit once the serving process is gone, even in the middle of a job that never ends."""
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


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
