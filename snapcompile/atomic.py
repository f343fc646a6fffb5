"""Write output folders and files atomically: a failure leaves nothing half-written."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from snapcompile.errors import SnapcompileError


@contextlib.contextmanager
def atomic_directory(target: Path, force: bool = False):
    """Yield a staging folder beside `target`; on success it replaces `target` in one rename.

    Without `force` an existing `target` is an error (raised before any work starts).
    """
    target = Path(target)
    if target.exists() and not force:
        raise SnapcompileError(f"output {target} already exists (use --force to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(staging, 0o755)  # mkdtemp makes it private; the artifact is an ordinary folder
    try:
        yield staging
        if target.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, trash / "old")
            os.replace(staging, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_json_atomic(path: Path, payload) -> None:
    """Write JSON to `path` via a temporary file and a rename."""
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to `path` via a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
