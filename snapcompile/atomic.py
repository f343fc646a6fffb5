"""Write outputs atomically, and replace only what snapcompile wrote.

A folder is built in a staging folder beside its target and moved into place by one rename;
`--force` swaps the new folder with the old one in one exchange (Linux `renameat2`), so the
target is never observable as missing, and replaces only a folder that holds snapcompile's own
marker file (an artifact's manifest.json, an engine folder's engines.json). Staging folders carry
their writer's pid: one whose writer died (SIGKILL) is removed by the next write of the same
target; SIGTERM and Ctrl-C remove their own on the way out.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from snapcompile.errors import SnapcompileError, parse_json

# the keys a marker file of each kind holds: a folder is snapcompile's only when its marker parses
# as one (an arbitrary folder with a file of that name is not replaced)
MARKER_KEYS = {"manifest.json": ("format_version", "snapcompile_version", "graphs", "files"),
               "engines.json": ("fingerprint", "engines"),
               "snapcompile.json": ("model", "artifact", "instances"),
               "config.json": ("model_type",)}
MARKER_MAX_BYTES = 64 * 2**20
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100
_STAGING_KINDS = ("tmp", "old")


def _renameat2(source: Path, target: Path, flags: int) -> bool:
    """renameat2(2) with `flags`; False where the C library or the file system lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.renameat2
    except (OSError, AttributeError):
        return False
    if call(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(target))


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename staging to target, failing with EEXIST if target appeared meanwhile."""
    if _renameat2(staging, target, _RENAME_NOREPLACE):
        return
    if target.exists():                      # no renameat2: the check-then-rename fallback
        raise OSError(errno.EEXIST, "exists", str(target))
    os.rename(staging, target)


def _swap(staging: Path, target: Path) -> None:
    """After this, target holds staging's content and staging the old target (never missing)."""
    if _renameat2(staging, target, _RENAME_EXCHANGE):
        return
    aside = staging.with_name(staging.name.replace(".tmp-", ".old-", 1))
    os.rename(target, aside)                 # the fallback leaves a short gap between the renames
    os.rename(staging, target)
    os.rename(aside, staging)


def resolve_output(target: Path) -> Path:
    """The absolute output path; refuses the current folder, its parents and the file-system root."""
    resolved = Path(os.path.abspath(target))
    cwd = Path.cwd()
    if resolved == cwd or resolved in cwd.parents:
        raise SnapcompileError(f"output {target} is the current folder or one of its parents: "
                               "write the output to a new folder")
    return resolved


def check_replaceable(target: Path, force: bool, marker: str) -> None:
    """Raise unless writing `target` is allowed: it does not exist, or `force` is given and it is
    a folder snapcompile wrote (it holds `marker`) or an empty folder."""
    if not target.exists() and not target.is_symlink():
        return
    if not force:
        raise SnapcompileError(f"output {target} already exists (use --force to replace it)")
    if target.is_symlink() or not target.is_dir():
        raise SnapcompileError(f"output {target} is not a folder: --force only replaces folders snapcompile wrote")
    if not any(target.iterdir()):
        return
    if not _is_marker(target / marker, marker):
        raise SnapcompileError(f"output {target} has no {marker} written by snapcompile: --force only replaces "
                               "folders snapcompile wrote; remove it yourself or choose another output")


def _is_marker(path: Path, marker: str) -> bool:
    """Whether `path` is a regular file parsing as a JSON object with the keys of its kind."""
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MARKER_MAX_BYTES:
            return False
        raw = parse_json(path.read_bytes(), str(path))
    except (OSError, SnapcompileError):
        return False
    return isinstance(raw, dict) and all(key in raw for key in MARKER_KEYS.get(marker, ()))


def remove_stale_staging(target: Path) -> None:
    """Remove staging folders of `target` whose writing process no longer runs (killed writers)."""
    if not target.parent.is_dir():
        return
    for kind in _STAGING_KINDS:
        for folder in target.parent.glob(f".{target.name}.{kind}-*"):
            pid = folder.name[len(f".{target.name}.{kind}-"):].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_directory(target: Path, force: bool = False, marker: str = "manifest.json"):
    """Yield a staging folder beside `target`; on success it becomes `target` in one rename.

    Without `force` an existing `target` is an error, raised before any work starts and again if
    one appears while staging (it is then left as it is). With `force` only a folder holding
    `marker` (or an empty one) is replaced, by an atomic exchange.
    """
    target = resolve_output(Path(target))
    check_replaceable(target, force, marker)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    os.chmod(staging, 0o755)  # mkdtemp makes it private; the output is an ordinary folder
    try:
        yield staging
        _commit(staging, target, force, marker)
    finally:
        shutil.rmtree(staging, ignore_errors=True)     # on success it holds the old output, if any


def _commit(staging: Path, target: Path, force: bool, marker: str) -> None:
    if force and (target.exists() or target.is_symlink()):
        check_replaceable(target, force, marker)   # it may have changed while staging
        _swap(staging, target)
        return
    try:
        _move_into_place(staging, target)
    except OSError as err:
        if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise SnapcompileError(f"output {target} appeared while it was being written; "
                                   "left as it is (use --force to replace it)") from None
        raise


def check_output_file(path: Path, force: bool, inputs: tuple[Path, ...] = (),
                      read_folders: tuple[Path, ...] = ()) -> Path:
    """Check, before any work, that a results file can be written at `path`: absent or a regular
    file (never a folder, device, FIFO or link), not one of `inputs`, not inside a folder this
    command reads (`read_folders`: the artifact or model), in a folder that exists (or can be
    made) and takes new files, and not an existing file unless `force`. Returns the absolute path."""
    path = Path(os.path.abspath(path))
    if path.is_dir():
        raise SnapcompileError(f"output {path} is a folder; give a file name")
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise SnapcompileError(f"output {path} is not a regular file (a device, FIFO or link): "
                               "write the results to a new or regular file")
    real = Path(os.path.realpath(path))      # links in the folders resolved: one file has one real path
    if any(real == Path(os.path.realpath(p)) for p in inputs if p is not None):
        raise SnapcompileError(f"output {path} is also an input of this command; choose another file")
    for folder in (f for f in read_folders if f is not None and Path(f).is_dir()):
        if real.is_relative_to(Path(os.path.realpath(folder))):
            raise SnapcompileError(f"output {path} is inside {folder}, which this command reads; "
                                   "write the results elsewhere")
    if path.exists() and not force:
        raise SnapcompileError(f"output {path} already exists (use --force to replace it)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise SnapcompileError(f"cannot write {path}: {err.strerror or err}") from None
    return path


class PartialLines:
    """A results file written as the results come: each line appended (and flushed) to
    `<target>.partial`, created before any work (an existing one is replaced only with `force`);
    `finish(text)` writes the whole target atomically and removes the partial file. Should the
    partial file stop taking lines (a full disk), `intact` turns False and the run goes on: the
    caller holds every line too. Whatever ends the run early leaves the partial file in place."""

    def __init__(self, target: Path, force: bool, append: bool = False):
        """append: add to the partial file that exists (a resumed run's: cli/run_partial.py)."""
        self.target = Path(target)
        self.path = self.path_of(self.target)
        self.lines, self.intact = 0, True
        flags = os.O_WRONLY | os.O_NOFOLLOW | (os.O_APPEND if append else
                                               os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL))
        if force and os.path.lexists(self.path) and not stat.S_ISREG(os.lstat(self.path).st_mode):
            raise SnapcompileError(f"{self.path} is not a regular file; remove it or choose another output")
        try:
            self._handle = os.fdopen(os.open(self.path, flags, 0o644), "w", encoding="utf-8")
        except FileExistsError:
            raise SnapcompileError(f"{self.path} exists (an earlier run's partial results?); use --force to "
                                   "replace it, or move it away") from None
        except OSError as err:
            raise SnapcompileError(f"cannot write {self.path}: {err.strerror or err}") from None

    @staticmethod
    def path_of(target: Path) -> Path:
        """Where the lines of `target` go while they come."""
        return Path(target).with_name(Path(target).name + ".partial")

    def append(self, line: str) -> None:
        if not self.intact:
            return
        try:
            self._handle.write(line + "\n")
            self._handle.flush()
            self.lines += 1
        except OSError:
            self.intact = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._handle.close()

    def finish(self, text: str) -> None:
        """Write `text` to the target atomically and drop the partial file. On an OSError the
        SnapcompileError says where the results are: in the partial file when it holds them all
        (`intact`), else nowhere on disk (the caller prints them)."""
        self.close()
        try:
            write_text_atomic(self.target, text)
        except OSError as err:
            kept = (f"all {self.lines} results are in {self.path}" if self.intact
                    else "the results are printed on standard output instead")
            raise SnapcompileError(f"cannot write {self.target}: {err.strerror or err}; {kept}") from None
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def write_json_atomic(path: Path, payload) -> None:
    """Write JSON to `path` via a temporary file and a rename."""
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def save_figure_atomic(fig, path: Path, dpi: int = 110) -> None:
    """A matplotlib figure as a PNG at `path`, via a temporary file and a rename (never written
    through a link or into whatever `path` names)."""
    write_bytes_atomic(path, _png_bytes(fig, dpi))


def _png_bytes(fig, dpi: int) -> bytes:
    import io
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write bytes to `path` via a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write text (UTF-8) to `path` via a temporary file and a rename."""
    write_bytes_atomic(path, text.encode("utf-8"))
