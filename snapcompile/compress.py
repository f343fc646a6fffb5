"""`snapcompile compress`: run the passes on an existing dense artifact folder."""
from __future__ import annotations

import os
from pathlib import Path

from snapcompile.artifact import (
    WEIGHTS,
    Manifest,
    copy_support_files,
    load_graph,
    read_manifest,
    save_graphs,
    verify_files,
)
from snapcompile.atomic import atomic_directory
from snapcompile.config import PolicyConfig
from snapcompile.errors import SnapcompileError


def compress_artifact(dense_dir: Path, output: Path, policy: PolicyConfig, force: bool = False,
                      lowering: str = "standard") -> Manifest:
    """Rewrite dense_dir's graphs for `policy` into `output` (the weights file copied, not rewritten)."""
    from snapcompile.passes.pipeline import compress_graphs
    dense_dir = Path(dense_dir)
    if os.path.abspath(dense_dir) == os.path.abspath(output):
        raise SnapcompileError("the output folder is the input artifact; choose another output")
    manifest = read_manifest(dense_dir)
    verify_files(dense_dir, manifest)
    graphs = {name: load_graph(dense_dir, manifest, name) for name in manifest.graphs}
    with atomic_directory(Path(output), force=force) as staging:
        manifest.graphs = {}
        graphs = compress_graphs(graphs, manifest, policy, lowering)
        copy_support_files(dense_dir, manifest, staging)
        save_graphs(staging, graphs, manifest, weights_source=dense_dir / WEIGHTS)
    return manifest
