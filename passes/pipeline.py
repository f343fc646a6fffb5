"""Runs the passes that turn a dense artifact's graphs into a compressed one (`convert` on freshly
exported graphs, `compress` on a dense artifact folder). No torch here."""
from __future__ import annotations

import os
from pathlib import Path

import onnx

from snapcompile.artifact.files import check_files, copy_support_files
from snapcompile.artifact.manifest import WEIGHTS, Manifest, read_manifest
from snapcompile.artifact.naming import graph_name, is_decode_graph, is_prefill_graph, select_rows
from snapcompile.artifact.onnx_io import load_graph, save_graphs
from snapcompile.atomic import atomic_directory
from snapcompile.config import LOWERINGS, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.graphs.select import SelectionWriter, plugin_select_graph
from snapcompile.passes.cache_bias import add_cache_bias
from snapcompile.passes.compress_decode import compress_decode
from snapcompile.passes.match import MatchFailure
from snapcompile.passes.snapkv_prefill import add_window_queries


def compress_artifact(dense_dir: Path, output: Path, policy: PolicyConfig, force: bool = False,
                      lowering: str = "standard") -> Manifest:
    """Rewrite dense_dir's graphs for `policy` into `output` (the weights file copied, not rewritten)."""
    dense_dir = Path(dense_dir)
    if os.path.abspath(dense_dir) == os.path.abspath(output):
        raise SnapcompileError("the output folder is the input artifact; choose another output")
    manifest = read_manifest(dense_dir)
    check_files(dense_dir, manifest)
    graphs = {name: load_graph(dense_dir, manifest, name) for name in manifest.graphs}
    with atomic_directory(Path(output), force=force) as staging:
        manifest.graphs = {}
        graphs = compress_graphs(graphs, manifest, policy, lowering)
        copy_support_files(dense_dir, manifest, staging)
        save_graphs(staging, graphs, manifest, weights_source=dense_dir / WEIGHTS)
    return manifest


def compress_graphs(graphs: dict[str, onnx.ModelProto], manifest: Manifest,
                    policy: PolicyConfig, lowering: str = "standard") -> dict[str, onnx.ModelProto]:
    """Rewrite dense prefill/decode graphs for `policy`; updates manifest.policy, .lowering and
    .passes. lowering "plugin" writes the compressed decode attention and the selection as custom
    op nodes (plugins.contracts)."""
    if lowering not in LOWERINGS:
        raise SnapcompileError(f"unknown lowering {lowering!r}; choose standard or plugin")
    if lowering == "plugin" and not policy.compressed:
        raise SnapcompileError("--lower plugin needs a compressed policy (snapstream or streamingllm)")
    if manifest.policy.compressed:
        raise SnapcompileError("the input artifact is already compressed; start from a dense export")
    policy.check_against(manifest.export)
    if not policy.compressed:
        manifest.policy = policy
        return graphs
    out = dict(graphs)
    try:
        _compress_decode(out, manifest, policy, lowering)
        if policy.summaries:
            _add_cache_bias(out, manifest)
        if policy.policy == "snapstream":
            _add_selection(out, manifest, policy, lowering)
    except MatchFailure as failure:
        raise SnapcompileError(f"cannot compress: {failure}") from None
    manifest.policy, manifest.lowering = policy, lowering
    return out


def _compress_decode(graphs: dict[str, onnx.ModelProto], manifest: Manifest, policy: PolicyConfig,
                     lowering: str) -> None:
    """Every decode graph (one per slot bucket) gets the ring cache, and the plugin nodes."""
    layers = manifest.spec.num_layers
    for name in filter(is_decode_graph, list(graphs)):
        graphs[name], report = compress_decode(graphs[name], layers, policy.slot_rows, name)
        manifest.passes.append(report)
        if lowering == "plugin":
            from snapcompile.passes.lower_plugin import lower_decode
            graphs[name], report = lower_decode(graphs[name], layers, name)
            manifest.passes.append(report)


def _add_cache_bias(graphs: dict[str, onnx.ModelProto], manifest: Manifest) -> None:
    """Every prefill graph takes the summary rows' logit bias (standard ops in both lowerings)."""
    for name in filter(is_prefill_graph, list(graphs)):
        graphs[name], report = add_cache_bias(graphs[name], manifest.spec, name)
        manifest.passes.append(report)


def _add_selection(graphs: dict[str, onnx.ModelProto], manifest: Manifest, policy: PolicyConfig,
                   lowering: str) -> None:
    """Window-query outputs on every prefill graph, and the select graphs (one per bucket above P)."""
    spec = manifest.spec
    for name in filter(is_prefill_graph, list(graphs)):
        graphs[name], report = add_window_queries(graphs[name], spec, policy.window, name)
        manifest.passes.append(report)
    for rows in select_rows(manifest.export, policy):
        name = graph_name("select", rows, manifest.export.max_context)
        if lowering == "plugin":
            graphs[name] = plugin_select_graph(spec, policy, rows, name)
        else:
            graphs[name] = SelectionWriter(spec, policy, rows, name).build()
        layers = sum(output.name.startswith("selected_index.") for output in graphs[name].graph.output)
        manifest.passes.append({"pass": "snapkv_select" if lowering == "standard" else "lower_plugin",
                                "graph": name, "blocks_rewritten": layers, "scope": policy.scope})
