"""Runs the passes that turn a dense artifact's graphs into a compressed one."""
from __future__ import annotations

import onnx

from snapcompile.passes.compress_decode import compress_decode
from snapcompile.passes.match import MatchFailure
from snapcompile.passes.snapkv_prefill import add_window_queries
from snapcompile.passes.snapkv_select import SelectionWriter
from snapcompile.artifact import Manifest
from snapcompile.config import PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.export import verify_graph


def compress_graphs(graphs: dict[str, onnx.ModelProto], manifest: Manifest,
                    policy: PolicyConfig) -> dict[str, onnx.ModelProto]:
    """Rewrite dense prefill/decode graphs for `policy`; updates manifest.policy and .passes."""
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
            out["prefill"], report = add_window_queries(graphs["prefill"], spec, policy.window)
            manifest.passes.append(report)
            out["select"] = SelectionWriter(spec, policy, manifest.export.max_context).build()
            verify_graph(out["select"], "select")
            manifest.passes.append({"pass": "snapkv_select", "graph": "select",
                                    "blocks_rewritten": spec.num_layers, "scope": policy.scope})
    except MatchFailure as failure:
        raise SnapcompileError(f"cannot compress: {failure}") from None
    manifest.policy = policy
    return out
