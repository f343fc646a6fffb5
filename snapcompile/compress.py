"""`snapcompile compress`: run the passes on an existing dense artifact folder."""
from __future__ import annotations

import shutil
from pathlib import Path

from snapcompile.artifact import MANIFEST, WEIGHTS, Manifest, load_graph, read_manifest, save_graphs
from snapcompile.atomic import atomic_directory
from snapcompile.config import PolicyConfig


def compress_artifact(dense_dir: Path, output: Path, policy: PolicyConfig, force: bool = False,
                      lowering: str = "standard") -> Manifest:
    """Rewrite dense_dir's graphs for `policy` into `output` (weights hard-linked, not rewritten)."""
    from snapcompile.passes.pipeline import compress_graphs
    dense_dir = Path(dense_dir)
    manifest = read_manifest(dense_dir)
    graphs = {name: load_graph(dense_dir, manifest, name) for name in manifest.graphs}
    with atomic_directory(Path(output), force=force) as staging:
        manifest.graphs = {}
        graphs = compress_graphs(graphs, manifest, policy, lowering)
        for item in dense_dir.iterdir():      # tokenizer files
            if item.is_file() and item.suffix != ".onnx" and item.name not in (MANIFEST, WEIGHTS):
                shutil.copy2(item, staging / item.name)
        save_graphs(staging, graphs, manifest, weights_source=dense_dir / WEIGHTS)
    return manifest
