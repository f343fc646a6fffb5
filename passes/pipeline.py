"""Runs the passes that turn a dense artifact's graphs into a compressed one."""
from __future__ import annotations

import onnx

from snapcompile.artifact import Manifest, graph_name, is_prefill_graph, select_rows
from snapcompile.config import LOWERINGS, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.passes.compress_decode import compress_decode
from snapcompile.passes.match import MatchFailure
from snapcompile.passes.snapkv_prefill import add_window_queries
from snapcompile.passes.snapkv_select import SelectionWriter
from snapcompile.verify import verify_graph


def compress_graphs(graphs: dict[str, onnx.ModelProto], manifest: Manifest,
                    policy: PolicyConfig, lowering: str = "standard") -> dict[str, onnx.ModelProto]:
    """Rewrite dense prefill/decode graphs for `policy`; updates manifest.policy, .lowering and
    .passes. lowering "plugin" then replaces the compressed attention and the selection by
    custom op nodes (plugins.contracts)."""
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
    spec = manifest.spec
    out = dict(graphs)
    try:
        out["decode"], report = compress_decode(graphs["decode"], spec.num_layers, policy.budget)
        manifest.passes.append(report)
        if policy.policy == "snapstream":
            for name in filter(is_prefill_graph, graphs):
                out[name], report = add_window_queries(graphs[name], spec, policy.window, name)
                manifest.passes.append(report)
            for rows in select_rows(manifest.export, policy):
                name = graph_name("select", rows, manifest.export.max_context)
                out[name] = SelectionWriter(spec, policy, rows, name).build()
                verify_graph(out[name], name)
                manifest.passes.append({"pass": "snapkv_select", "graph": name,
                                        "blocks_rewritten": spec.num_layers, "scope": policy.scope})
        if lowering == "plugin":
            _lower_to_plugins(out, manifest, policy)
    except MatchFailure as failure:
        raise SnapcompileError(f"cannot compress: {failure}") from None
    manifest.policy, manifest.lowering = policy, lowering
    return out


def _lower_to_plugins(graphs: dict[str, onnx.ModelProto], manifest: Manifest, policy: PolicyConfig) -> None:
    from snapcompile.passes.lower_plugin import lower_decode, plugin_select_graph
    spec = manifest.spec
    graphs["decode"], report = lower_decode(graphs["decode"], spec.num_layers)
    manifest.passes.append(report)
    for rows in select_rows(manifest.export, policy) if policy.policy == "snapstream" else ():
        name = graph_name("select", rows, manifest.export.max_context)
        graphs[name] = plugin_select_graph(spec, policy, rows, name)
        manifest.passes.append({"pass": "lower_plugin", "graph": name, "blocks_rewritten": spec.num_layers})
