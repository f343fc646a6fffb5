"""Artifacts that the measuring tools (eval, eval-ruler, eval-turns, bench, bench-turns) build once
and reuse, kept under a cache folder.

A folder's name is `artifact_key(source, export shapes, policy)`, so any change of model, shapes,
policy or of the graphs this version writes builds a new one. From a model, every artifact is
built by `compile_artifact`, the route `convert` takes (the model loads at most once); from a dense
artifact folder, compressed ones are made by the passes (`compress`).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from snapcompile.artifact.manifest import MANIFEST, artifact_key, read_manifest
from snapcompile.compiler.route import compile_artifact
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError


class ArtifactCache:
    """source: a model (built-in name, HF folder, GGUF file) or an existing dense artifact folder."""

    def __init__(self, source: str, cache_dir: Path, log: Callable[[str], None] = print):
        self.source, self.dir, self.log = source, Path(cache_dir), log
        self._loaded = None

    @property
    def loaded(self):
        """The model itself (loaded on first use): for exporting, and for the PyTorch baselines."""
        if self._loaded is None:
            from snapcompile.models import load_model
            self._loaded = load_model(self.source)
        return self._loaded

    def _source_export(self, export: ExportConfig) -> ExportConfig | None:
        """Where the source is a dense artifact: its own shapes, once checked to serve `export`
        (the same slots, chunk and weights, at least the context); None for a model source."""
        source = Path(self.source)
        if not (source / MANIFEST).is_file():
            return None
        manifest = read_manifest(source)
        own = manifest.export
        if manifest.policy.compressed or own.max_context < export.max_context:
            raise SnapcompileError(f"{source} must be a dense artifact with --max-context >= "
                                   f"{export.max_context} for these lengths")
        if (own.slots, own.chunk) != (export.slots, export.chunk):
            raise SnapcompileError(f"{source} has {own.slots} slots and chunk {own.chunk}, not the {export.slots} "
                                   f"and {export.chunk} asked for: give --slots {own.slots} (and chunk "
                                   f"{own.chunk}), or the model itself")
        if own.weight_format != export.weight_format:
            raise SnapcompileError(f"{source} holds {own.weight_format} weights, not {export.weight_format}: "
                                   "give the model itself to evaluate other --weights")
        if own.quantized and own.block_size != export.block_size:
            raise SnapcompileError(f"{source} holds blocks of {own.block_size}, not {export.block_size}: "
                                   "give the model itself to evaluate another --block-size")
        return own

    def dense(self, export: ExportConfig) -> Path:
        """A dense artifact of these shapes (the source itself where it is a dense artifact that
        holds them)."""
        folder = self.folder_of(export, PolicyConfig(policy="dense"))
        if folder == Path(self.source):
            return folder
        if not (folder / MANIFEST).is_file():
            self.log(f"exporting {self.source} to {folder} ({export.slots} slots, max context {export.max_context}, "
                     f"{export.weight_format} weights)")
            compile_artifact(self.loaded, export, PolicyConfig(policy="dense"), folder, force=True)
        return folder

    def folder_of(self, export: ExportConfig, policy: PolicyConfig) -> Path:
        """Where `get` keeps the artifact of these shapes and this policy (built or not)."""
        own = self._source_export(export)
        if not policy.compressed and own is not None:
            return Path(self.source)
        return self.dir / artifact_key(self.source, own or export, policy)

    def get(self, export: ExportConfig, policy: PolicyConfig) -> Path:
        """An artifact of these shapes and this policy."""
        if not policy.compressed:
            return self.dense(export)
        folder = self.folder_of(export, policy)
        if (folder / MANIFEST).is_file():
            return folder
        self.log(f"building {policy.policy} budget {policy.budget} into {folder}")
        if self._source_export(export) is None:
            compile_artifact(self.loaded, export, policy, folder, force=True)
        else:
            from snapcompile.passes.pipeline import compress_artifact
            compress_artifact(Path(self.source), folder, policy, force=True)
        return folder
