"""What each ONNX Runtime session of an opened artifact adds to the process once the weights are
shared (memory.md: "~12 MiB a weight-bearing session"), beside the graph's node count before and
after ONNX Runtime's optimizations, and the same for synthetic graphs of N kept nodes (a chain of
Adds) and N removed ones (Identities), which separate what a node costs from what a weight does.

    .venv/bin/python studies/graph_cost.py ARTIFACT [--synthetic 1000,3000]

Prints one JSON line for opening (which makes the decode graph and the weights' packed copy), then
one per other ONNX Runtime graph of the artifact (naming.ort_graphs: one a family): anonymous RSS
added by making it, in MiB, and its nodes as the export writes them and after ONNX Runtime's
optimizations;
and, printed first, one line per synthetic graph (the median of 4 sessions' additions).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys

import numpy as np


def anonymous_mib() -> float:
    from snapcompile.memory import process_status_kib
    return process_status_kib("RssAnon") / 1024


def optimized_nodes(model_bytes: bytes, arrays: dict, folder: str) -> int:
    """Nodes of the graph ONNX Runtime runs (ORT_ENABLE_ALL), through its Python API."""
    import tempfile
    from pathlib import Path

    import onnx
    import onnxruntime as ort
    with tempfile.TemporaryDirectory() as scratch:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(Path(scratch) / "optimized.onnx")
        options.log_severity_level = 3
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
        names = list(arrays)
        options.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(arrays[n]) for n in names])
        ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])
        return len(onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node)


def artifact_sessions(folder: str) -> None:
    from onnx import TensorProto

    from snapcompile.artifact.onnx_io import load_ort_graph
    from snapcompile.runtime import open_backend
    before = anonymous_mib()
    backend = open_backend(folder)
    note = "opening makes the decode graph: the weights and their packed copy"
    print(json.dumps({"graph": "open", "added_mib": round(anonymous_mib() - before, 1), "note": note}), flush=True)
    device, manifest, rows = backend.device, backend.manifest, []
    for graph in backend._graphs():
        if graph.graph is not None or manifest.ort_graph_of(graph.name) in device.opened:
            graph.make()        # another binding of a session made already
            continue
        gc.collect()
        before = anonymous_mib()
        graph.make()
        gc.collect()
        rows.append({"graph": manifest.ort_graph_of(graph.name), "added_mib": round(anonymous_mib() - before, 1)})
    for row in rows:        # counted after every measurement: counting makes and drops a session of its own
        model = load_ort_graph(backend.folder, manifest, row["graph"])
        arrays = {t.name: device.weights.array(t) for t in model.graph.initializer
                  if t.data_location == TensorProto.EXTERNAL}
        row |= {"nodes": len(model.graph.node), "nodes_optimized": optimized_nodes(model.SerializeToString(), arrays,
                                                                                   folder)}
        print(json.dumps(row), flush=True)


def synthetic_sessions(count: int, op: str) -> float:
    """Median MiB a session of a chain of `count` `op` nodes adds (4 sessions, one shared container)."""
    from onnx import TensorProto, helper, numpy_helper

    from snapcompile.runtime.ort_capi import OrtEnvironment
    nodes, previous = [], "x"
    for i in range(count):
        inputs = [previous] if op == "Identity" else [previous, "c"]
        nodes.append(helper.make_node(op, inputs, [f"t{i}"]))
        previous = f"t{i}"
    value = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "chain", [value("x", TensorProto.FLOAT, [1, 64])],
                              [value(previous, TensorProto.FLOAT, [1, 64])],
                              [numpy_helper.from_array(np.ones((1, 64), np.float32), "c")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()
    shared, kept, added = OrtEnvironment(), [], []
    for i in range(4):
        before = anonymous_mib()
        kept.append(shared.open_graph(model, {}, {}, f"chain {i}"))
        added.append(anonymous_mib() - before)
    return statistics.median(added)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--synthetic", default="1000,3000", help="node counts of the synthetic chains")
    args = parser.parse_args()
    for count in (int(c) for c in args.synthetic.split(",")):      # first: memory freed later would be reused
        for op in ("Add", "Identity"):
            print(json.dumps({"synthetic": op, "nodes": count, "added_mib": round(synthetic_sessions(count, op), 1)}),
                  flush=True)
    artifact_sessions(args.artifact)
    return 0


if __name__ == "__main__":
    sys.exit(main())
