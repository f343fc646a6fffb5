"""`snapcompile triton-repo`: a Triton model repository that serves an artifact.

    REPO/snapcompile.json            what wrote it (the marker `--force` looks for)
    REPO/NAME/config.pbtxt           python backend, decoupled, K instances on the CPU
    REPO/NAME/1/model.py             snapcompile/tritonserver/model.py, copied
    REPO/NAME/1/artifact/            the artifact: its manifest's files, copied and verified
                                     (or a symbolic link to it with --link)
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from snapcompile.artifact.files import check_files
from snapcompile.artifact.footprint import memory_needed
from snapcompile.artifact.manifest import MANIFEST, read_manifest
from snapcompile.atomic import atomic_directory
from snapcompile.config import DEFAULT_SESSION_KEEP
from snapcompile.errors import SnapcompileError
from snapcompile.memory import check_fits, gib
from snapcompile.serve.partitions import SESSION_SHARING

MARKER = "snapcompile.json"
MODEL_FILE = Path(__file__).with_name("model.py")
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")     # fullmatch: no trailing newline slips through
MAX_NAME_CHARS = 128
MAX_INSTANCES = 64

INPUTS = (("text_input", "TYPE_STRING", "[ 1 ]", False), ("max_tokens", "TYPE_INT64", "[ 1 ]", True),
          ("temperature", "TYPE_FP32", "[ 1 ]", True), ("top_p", "TYPE_FP32", "[ 1 ]", True),
          ("seed", "TYPE_INT64", "[ 1 ]", True), ("stop", "TYPE_STRING", "[ -1 ]", True),
          ("stream", "TYPE_BOOL", "[ 1 ]", True), ("ignore_eos", "TYPE_BOOL", "[ 1 ]", True),
          ("cache_salt", "TYPE_STRING", "[ 1 ]", True), ("top_k", "TYPE_INT64", "[ 1 ]", True),
          ("min_p", "TYPE_FP32", "[ 1 ]", True), ("repetition_penalty", "TYPE_FP32", "[ 1 ]", True),
          ("presence_penalty", "TYPE_FP32", "[ 1 ]", True), ("frequency_penalty", "TYPE_FP32", "[ 1 ]", True),
          ("logit_bias", "TYPE_STRING", "[ 1 ]", True))
OUTPUTS = (("text_output", "TYPE_STRING", "[ -1 ]"), ("prompt_tokens", "TYPE_INT32", "[ 1 ]"),
           ("completion_tokens", "TYPE_INT32", "[ 1 ]"), ("finish_reason", "TYPE_STRING", "[ 1 ]"),
           ("cached_tokens", "TYPE_INT32", "[ 1 ]"))


def config_pbtxt(name: str, instances: int, parameters: dict[str, str]) -> str:
    """The model configuration (protobuf text format)."""
    inputs = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d}{" optional: true" if o else ""} }}'
                        for n, t, d, o in INPUTS)
    outputs = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d} }}' for n, t, d in OUTPUTS)
    params = "\n".join(f'parameters {{ key: "{k}" value: {{ string_value: {json.dumps(v)} }} }}'
                       for k, v in parameters.items())
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            f"model_transaction_policy {{ decoupled: true }}\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
            f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n{params}\n")


def write_repository(artifact: Path, output: Path, name: str, instances: int = 1, backend: str = "ort",
                     slots: int | None = None, link: bool = False, force: bool = False,
                     threads: int | None = None, session_cache_bytes: int | None = None,
                     session_keep: str = DEFAULT_SESSION_KEEP, session_sharing: str = "private") -> dict:
    """Write the repository atomically; returns what was written (for the CLI and tests).
    session_cache_bytes: each instance's store of kept conversations (None: sized at load; 0: off);
    session_keep: what it keeps of a compressed sequence (Engine); session_sharing: who shares kept
    caches without a cache_salt ("private": nobody; "shared": every client, as `serve` says)."""
    if session_sharing not in SESSION_SHARING:
        raise SnapcompileError(f"--session-sharing must be one of {', '.join(SESSION_SHARING)}")
    if not NAME_RULE.fullmatch(name) or len(name) > MAX_NAME_CHARS:
        raise SnapcompileError(f"model name {name[:40]!r}{'...' if len(name) > 40 else ''} must be 1 to "
                               f"{MAX_NAME_CHARS} letters, digits, '_', '-' or '.', starting with a letter or digit")
    if not 1 <= instances <= MAX_INSTANCES:
        raise SnapcompileError(f"--instances must be in 1..{MAX_INSTANCES}, got {instances}")
    artifact = Path(artifact).resolve()
    manifest = read_manifest(artifact)
    check_files(artifact, manifest)
    if slots is not None and not 1 <= slots <= manifest.export.slots:
        raise SnapcompileError(f"--slots must be in 1..{manifest.export.slots} (the artifact's static slots)")
    if threads is not None and threads < 1:
        raise SnapcompileError("--threads must be >= 1")
    one = sum(memory_needed(manifest).values())       # every instance loads the artifact
    check_fits(instances * one, f"{instances} instances of this artifact ({gib(one)} each)", "use fewer --instances")
    params = {"artifact": "artifact", "fingerprint": manifest.fingerprint(), "backend": backend,
              "slots": "" if slots is None else str(slots), "threads": "" if threads is None else str(threads),
              "session_cache_bytes": "auto" if session_cache_bytes is None else str(session_cache_bytes),
              "session_keep": session_keep, "session_sharing": session_sharing}
    with atomic_directory(Path(output), force=force, marker=MARKER) as staging:
        version = staging / name / "1"
        version.mkdir(parents=True)
        (staging / name / "config.pbtxt").write_text(config_pbtxt(name, instances, params))
        shutil.copyfile(MODEL_FILE, version / "model.py")
        _place_artifact(artifact, manifest, version / "artifact", link)
        info = {"model": name, "artifact": str(artifact), "artifact_placed": "linked" if link else "copied",
                "instances": instances, "backend": backend, "slots": slots, "threads": threads,
                "session_cache_bytes": session_cache_bytes, "session_keep": session_keep,
                "session_sharing": session_sharing}
        (staging / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _place_artifact(artifact: Path, manifest, target: Path, link: bool) -> None:
    if link:
        os.symlink(artifact, target, target_is_directory=True)
        return
    target.mkdir()
    for name in [*manifest.files, MANIFEST]:
        shutil.copyfile(artifact / name, target / name)
    check_files(target, manifest)
