"""The artifact's file table: every file's size and sha256, recorded at write time and checked
before anything is read."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

from snapcompile.artifact.manifest import MANIFEST, Manifest
from snapcompile.errors import SnapcompileError


def check_files(folder: Path, manifest: Manifest, names: list[str] | None = None, checksums: bool = True) -> None:
    """Check that each listed file (all of the manifest's by default) is a regular file of the
    folder with its recorded size and, when `checksums`, its recorded sha256."""
    folder = Path(folder)
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
        if checksums and file_sha256(path) != record.get("sha256"):
            raise SnapcompileError(f"{path} does not match its sha256 in the manifest: the artifact is "
                                   "corrupt or was modified; convert it again")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


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
