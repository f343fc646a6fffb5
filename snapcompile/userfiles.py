"""Files a user names (prompts files, --reference results), read whole only when that is safe, and
JSON Lines split as the format says."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from snapcompile.errors import SnapcompileError

MAX_USER_FILE_BYTES = 256 * 2**20     # a prompts file of 256 MiB is ~60k long prompts


def read_user_file(path: Path, what: str, max_bytes: int = MAX_USER_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most max_bytes. A device (/dev/zero, /dev/urandom), a FIFO, a
    folder or a larger file is one error line naming `what`, never an endless read or a MemoryError."""
    try:
        info = os.stat(path)                 # before opening: opening a FIFO would wait for a writer
        if not stat.S_ISREG(info.st_mode):
            raise SnapcompileError(f"{what} {path} is not a regular file")
        if info.st_size > max_bytes:
            raise SnapcompileError(f"{what} {path} has {info.st_size} bytes; at most {max_bytes} are read")
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as err:
        raise SnapcompileError(f"cannot read {what} {path}: {err.strerror}") from None
    if len(data) > max_bytes:                # it grew while being read
        raise SnapcompileError(f"{what} {path} has more than {max_bytes} bytes")
    return data


def json_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text: split on "\\n" alone (a trailing "\\r" dropped). str.splitlines
    would also split inside a JSON string holding U+2028, U+2029 or U+0085 raw, which JSON allows."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]
