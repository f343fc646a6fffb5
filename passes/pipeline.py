"""Runs the passes that turn a dense artifact's graphs into a compressed one (`convert` on freshly
exported graphs, `compress` on a dense artifact folder). No torch here."""
from __future__ import annotations

import os
from pathlib import Path

from snapcompile.artifact.files import check_files, copy_support_files
from snapcompile.artifact.manifest import ORT_WEIGHTS, WEIGHTS, Manifest, read_manifest
from snapcompile.artifact.naming import (
    SELECT_LAYER,
    graph_name,
    is_decode_graph,
    is_prefill_graph,
    ort_graphs,
    ort_size,
    prefill_layer,
    select_rows,
)
from snapcompile.artifact.onnx_io import GraphSet, load_graph, load_ort_graph, save_graphs
from snapcompile.atomic import atomic_directory
from snapcompile.config import LOWERINGS, ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.graphs.builder import SymbolicSize
from snapcompile.graphs.select import SelectionWriter, plugin_select_graph
from snapcompile.passes.attention_heads import attention_per_head
from snapcompile.passes.cache_bias import add_cache_bias
from snapcompile.passes.compress_decode import compress_decode
from snapcompile.passes.kv_dtype import store_kv_as
from snapcompile.passes.match import MatchFailure
from snapcompile.passes.snapkv_prefill import add_window_queries


def compress_artifact(dense_dir: Path, output: Path, policy: PolicyConfig, force: bool = False,
                      lowering: str = "standard") -> Manifest:
    """Rewrite dense_dir's graphs for `policy` into `output` (the weights files copied, not rewritten)."""
    dense_dir = Path(dense_dir)
    if os.path.abspath(dense_dir) == os.path.abspath(output):
        raise SnapcompileError("the output folder is the input artifact; choose another output")
    manifest = read_manifest(dense_dir)
    check_files(dense_dir, manifest)
    if manifest.export.kv_dtype != "float32":
        raise SnapcompileError(f"{dense_dir} stores its KV cache in {manifest.export.kv_dtype}; the passes read a "
                               "float32 cache: convert the model with --kv-dtype instead")
    graphs = GraphSet({name: load_graph(dense_dir, manifest, name) for name in manifest.graphs},
                      {name: load_ort_graph(dense_dir, manifest, name) for name in manifest.ort_graphs})
    with atomic_directory(Path(output), force=force) as staging:
        manifest.graphs, manifest.ort_graphs = {}, {}
        graphs = compress_graphs(graphs, manifest, policy, lowering)
        copy_support_files(dense_dir, manifest, staging)
        save_graphs(staging, graphs, manifest, weights_source=dense_dir / WEIGHTS,
                    ort_weights_source=dense_dir / ORT_WEIGHTS)
    return manifest


def compress_graphs(graphs: GraphSet, manifest: Manifest, policy: PolicyConfig,
                    lowering: str = "standard") -> GraphSet:
    """Rewrite dense prefill/decode graphs (the static ones and ONNX Runtime's) for `policy`; updates
    manifest.policy, .lowering and .passes. lowering "plugin" writes the compressed decode attention
    and the selection as custom op nodes (plugins.contracts); ONNX Runtime then runs those graphs from
    their static files (naming.ort_graphs). ONNX Runtime's prefill graphs end with their attention
    computed a KV head at a time (passes/attention_heads.py; the static graphs keep the batched form)."""
    if lowering not in LOWERINGS:
        raise SnapcompileError(f"unknown lowering {lowering!r}; choose standard or plugin")
    if lowering == "plugin" and not policy.compressed:
        raise SnapcompileError("--lower plugin needs a compressed policy (snapstream or streamingllm)")
    if manifest.policy.compressed:
        raise SnapcompileError("the input artifact is already compressed; start from a dense export")
    policy.check_against(manifest.export)
    _check_window_rings(manifest, policy, lowering)
    if not policy.compressed:
        manifest.policy = policy
        return graphs
    out = GraphSet(dict(graphs.static), dict(graphs.ort))
    try:
        _compress_decode(out, manifest, policy, lowering)
        if policy.summaries:
            _add_cache_bias(out, manifest)
        if policy.policy == "snapstream":
            _add_selection(out, manifest, policy, lowering)
    except MatchFailure as failure:
        raise SnapcompileError(f"cannot compress: {failure}") from None
    manifest.policy, manifest.lowering = policy, lowering
    wanted = ort_graphs(manifest.export, policy, lowering, manifest.spec.num_layers)
    out = GraphSet(out.static, {name: model for name, model in out.ort.items() if name in wanted})
    for name, layers in _ort_prefill_graphs(out, manifest):     # last: the passes above match the batched form
        out.ort[name], _ = attention_per_head(out.ort[name], manifest.spec, f"ONNX Runtime's {name}", layers)
    return out


def _check_window_rings(manifest: Manifest, policy: PolicyConfig, lowering: str) -> None:
    """A model with local (sliding-window) layers (Gemma 3) compresses its global layers only, with the
    standard lowering, and without the summaries a resumed conversation reads (none resumes yet)."""
    if not manifest.spec.local_layers:
        return
    if lowering == "plugin":
        raise SnapcompileError("--lower plugin: the plugin's attention and selection ops do not know a model's "
                               "sliding-window layers (Gemma 3's local layers); use --lower standard")
    if policy.summaries:
        raise SnapcompileError("--summaries serve resumed conversations, which a model with sliding-window layers "
                               "(Gemma 3's local layers) does not resume yet")


def store_kv(graphs: GraphSet, manifest: Manifest) -> GraphSet:
    """Every graph's cache inputs and outputs in the export's kv_dtype (passes/kv_dtype.py), the last
    pass: the others match the float32 form (the manifest's export record says it ran). The plugin's
    custom ops read float32 caches."""
    check_kv_lowering(manifest.export, manifest.lowering)
    if manifest.export.kv_dtype == "float32":
        return graphs
    dtype = manifest.export.kv_dtype
    static = {name: store_kv_as(model, name, dtype) for name, model in graphs.static.items()}
    ort = {name: store_kv_as(model, f"ONNX Runtime's {name}", dtype) for name, model in graphs.ort.items()}
    return GraphSet(static, ort)


def check_kv_lowering(export: ExportConfig, lowering: str) -> None:
    """Refuse a KV dtype the lowering cannot run (before anything is exported)."""
    if export.kv_dtype != "float32" and lowering == "plugin":
        raise SnapcompileError(f"--kv-dtype {export.kv_dtype} needs --lower standard: the plugin's custom ops "
                               "read float32 caches")


def _compress_decode(graphs: GraphSet, manifest: Manifest, policy: PolicyConfig, lowering: str) -> None:
    """Every decode graph (one per slot bucket) gets the ring cache, and the plugin nodes; ONNX Runtime's
    decode graph the ring cache (the plugin lowering's decode graphs run from their static files)."""
    layers, local = manifest.spec.num_layers, manifest.spec.local_layers
    for name in filter(is_decode_graph, list(graphs.static)):
        graphs.static[name], report = compress_decode(graphs.static[name], layers, policy.slot_rows, name, local)
        manifest.passes.append(report)
        if lowering == "plugin":
            from snapcompile.passes.lower_plugin import lower_decode
            graphs.static[name], report = lower_decode(graphs.static[name], layers, name)
            manifest.passes.append(report)
    if lowering == "plugin":
        graphs.ort.pop("decode", None)
    elif "decode" in graphs.ort:
        graphs.ort["decode"], _ = compress_decode(graphs.ort["decode"], layers, policy.slot_rows, ORT_NAME, local)


ORT_NAME = "ONNX Runtime's decode"     # what a pass's errors call ONNX Runtime's graph of a family


def _add_cache_bias(graphs: GraphSet, manifest: Manifest) -> None:
    """Every prefill graph takes the summary rows' logit bias (standard ops in both lowerings)."""
    for name in filter(is_prefill_graph, list(graphs.static)):
        graphs.static[name], report = add_cache_bias(graphs.static[name], manifest.spec, name)
        manifest.passes.append(report)
    for name, layers in _ort_prefill_graphs(graphs, manifest):
        graphs.ort[name], _ = add_cache_bias(graphs.ort[name], manifest.spec, f"ONNX Runtime's {name}", layers)


def _ort_prefill_graphs(graphs: GraphSet, manifest: Manifest) -> list[tuple[str, int]]:
    """(name, decoder layers) of ONNX Runtime's prefill graphs: the whole model's, and one layer's
    for the layer-by-layer prefill."""
    layers = manifest.spec.num_layers
    return [(name, layers if is_prefill_graph(name) else 1) for name in graphs.ort
            if is_prefill_graph(name) or name in map(prefill_layer, range(layers))]


def _add_selection(graphs: GraphSet, manifest: Manifest, policy: PolicyConfig, lowering: str) -> None:
    """Window-query outputs on every prefill graph, and the select graphs (one per bucket above P, and
    ONNX Runtime's one for them all with the standard lowering)."""
    spec = manifest.spec
    for name in filter(is_prefill_graph, list(graphs.static)):
        graphs.static[name], report = add_window_queries(graphs.static[name], spec, policy.window, name)
        manifest.passes.append(report)
    local = {prefill_layer(i) for i in spec.local_layers}        # no selection: their window ring is their cache
    for name, layers in _ort_prefill_graphs(graphs, manifest):
        if name not in local:
            graphs.ort[name], _ = add_window_queries(graphs.ort[name], spec, policy.window,
                                                     f"ONNX Runtime's {name}", layers)
    for rows in select_rows(manifest.export, policy):
        name = graph_name("select", rows, manifest.export.max_context)
        if lowering == "plugin":
            graphs.static[name] = plugin_select_graph(spec, policy, rows, name)
        else:
            graphs.static[name] = SelectionWriter(spec, policy, rows, name).build()
        layers = sum(output.name.startswith("selected_index.") for output in graphs.static[name].graph.output)
        manifest.passes.append({"pass": "snapkv_select" if lowering == "standard" else "lower_plugin",
                                "graph": name, "blocks_rewritten": layers, "scope": policy.scope})
    if lowering == "standard":
        for name, layers in (("select", None), (SELECT_LAYER, [0])):
            size = ort_size(name, spec.local_layers)
            rows = SymbolicSize(size.name, size.source, size.axis, manifest.export.max_context)
            graphs.ort[name] = SelectionWriter(spec, policy, rows, name, layers=layers).build()
