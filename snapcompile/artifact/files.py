"""The artifact's file table: every file's size and sha256, recorded at write time and checked
before anything is read. A large file's verified sha256 is remembered (under $SNAPCOMPILE_CACHE)
for as long as the file is unchanged, so opening an artifact again does not hash gigabytes again."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from snapcompile.artifact.manifest import MANIFEST, Manifest
from snapcompile.errors import SnapcompileError
from snapcompile.paths import cache_root


def check_files(folder: Path, manifest: Manifest, names: list[str] | None = None, checksums: bool = True,
                remembered: bool = True) -> None:
    """Check that each listed file (all of the manifest's by default) is a regular file of the
    folder with its recorded size and, when `checksums`, its recorded sha256: computed (the large
    files on every core at once) or, when `remembered`, read from the record an earlier check left of
    the same file unchanged since (`remembered_sha256`)."""
    folder = Path(folder)
    to_hash = []
    for name in manifest.files if names is None else names:
        record, path = manifest.files[name], folder / name
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            raise SnapcompileError(f"{path} is missing from the artifact") from None
        if not stat.S_ISREG(info.st_mode):
            raise SnapcompileError(f"{path} is not a regular file (links are not followed); refused")
        if info.st_size != record.get("bytes"):
            raise SnapcompileError(f"{path} has {info.st_size} bytes where the manifest records {record.get('bytes')}: "
                                   "the artifact is truncated or was modified; convert it again")
        if checksums and not (remembered and remembered_sha256(path, info) == record.get("sha256")):
            to_hash.append((path, info, record.get("sha256")))
    with ThreadPoolExecutor(max(1, min(len(to_hash), os.cpu_count() or 1))) as pool:    # hashlib frees the GIL
        digests = list(pool.map(lambda item: file_sha256(item[0]), to_hash))
    for (path, info, expected), digest in zip(to_hash, digests):
        if digest != expected:
            raise SnapcompileError(f"{path} does not match its sha256 in the manifest: the artifact is "
                                   "corrupt or was modified; convert it again")
        remember_sha256(path, info, digest)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


REMEMBERED_BYTES = 1 << 24     # files this large have their verified sha256 remembered (smaller ones are hashed)


def _record_path(path: Path) -> Path:
    key = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:32]
    return cache_root() / "verified" / f"{key}.json"


def _identity(path: Path, info: os.stat_result) -> dict:
    """What changes whenever a file's contents may have: its inode, size, and modification and
    status-change times (a write sets both; no process can set the latter back)."""
    return {"path": str(Path(path).resolve()), "device": info.st_dev, "inode": info.st_ino, "bytes": info.st_size,
            "mtime_ns": info.st_mtime_ns, "ctime_ns": info.st_ctime_ns}


def remembered_sha256(path: Path, info: os.stat_result) -> str | None:
    """The sha256 an earlier check verified for this file, if it is unchanged since (same inode, size,
    mtime and ctime): the record under $SNAPCOMPILE_CACHE/verified/, None without one."""
    if info.st_size < REMEMBERED_BYTES:
        return None
    try:
        record = json.loads(_record_path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or {k: record.get(k) for k in _identity(path, info)} != _identity(path, info):
        return None
    return record.get("sha256")


def remember_sha256(path: Path, info: os.stat_result, digest: str) -> None:
    """Record that `path` (as `info` describes it) matched `digest`; a cache that cannot be written
    only means the next check hashes the file again."""
    if info.st_size < REMEMBERED_BYTES:
        return
    from snapcompile.atomic import write_json_atomic
    try:
        target = _record_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(target, _identity(path, info) | {"sha256": digest})
    except OSError:
        pass


def record_files(folder: Path, manifest: Manifest) -> None:
    """Set manifest.files to the size and sha256 of every file in `folder` but the manifest."""
    manifest.files = {item.name: {"bytes": item.stat().st_size, "sha256": file_sha256(item)}
                      for item in sorted(Path(folder).iterdir()) if item.is_file() and item.name != MANIFEST}


FILE_TOKENIZER = ("tokenizer.json", "tokenizer_config.json")   # what FileTokenizer reads (with a template)


def artifact_tokenizer(folder: Path, manifest: Manifest):
    """The tokenizer of an artifact (or engine folder) with this `manifest`, read from the files
    the manifest lists and nothing else; their sizes are checked first. A fast tokenizer's files
    are read without transformers (`FileTokenizer`: the same ids and renderings); others through
    transformers."""
    names = manifest.support_files()
    check_files(folder, manifest, names, checksums=False)
    if all(name in names for name in FILE_TOKENIZER):
        from snapcompile.models.file_tokenizer import FileTokenizer
        return FileTokenizer.from_folder(folder, names)
    from snapcompile.models.tokenizer import load_tokenizer
    return load_tokenizer(folder, files=names)


def copy_support_files(source: Path, manifest: Manifest, target: Path) -> None:
    """Copy an artifact's files other than graphs and weights (its tokenizer); the caller has
    verified them (`check_files`)."""
    for name in manifest.support_files():
        shutil.copyfile(Path(source) / name, Path(target) / name)
