"""Where a prefill chunk's time goes on ONNX Runtime's CPU provider, and what each kernel that could
multiply the linear layers reaches at the artifact's shapes: the bound that decides how close a
prompt's prefill can come to OpenVINO GenAI's (docs/results/performance.md).

    .venv/bin/python studies/prefill_kernels.py ARTIFACT [--graph prefill_4096 --start 3000]
        [--rows 64,256] [--blocks 32,128] [--prompt-tokens 4096] [--repeats 7]

Prints JSON lines:
- one per kernel, weight shape K x N and rows M: the median milliseconds of one product and its
  GOPS (2·M·K·N per second). Kernels: `nbits4_bB` (com.microsoft.MatMulNBits, 4-bit blocks of B,
  int8 activations: accuracy level 4, what an int4 artifact runs), `qgemm_int8` (MLAS's u8 x s8
  GEMM through com.microsoft.DynamicQuantizeMatMul: one scale a column and one for the whole
  activation matrix, so a second, coarser quantization of both sides) and `sgemm_fp32` (MatMul);
  each kernel's repeats run in a row (its weight may stay in the last-level cache: compare the
  total with `chunk_ops`' MatMulNBits, which reads every layer's weights in turn);
- `linear_s`: per kernel and M, the seconds a prompt of --prompt-tokens spends in its linear layers
  at M rows a product (the layer's seven products summed, times layers and chunks);
- `chunk_ops` (with --graph): one chunk of that graph at --start filled rows, by op type, from ONNX
  Runtime's profiler (4 runs after a first; the graph's DequantizeLinear + MatMul pairs fused into
  MatMulNBits at accuracy level 4 by the session, the kernel the export writes for ONNX Runtime).
Random values throughout: the timings do not depend on them.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def linear_shapes(model: dict) -> list[tuple[int, int, int]]:
    """(K, N, products a layer) of a Llama layer's linear layers: q and o, k and v, gate and up, down."""
    hidden, inter = model["hidden_size"], model["intermediate_size"]
    kv = model["num_kv_heads"] * model["head_dim"]
    query = model["num_heads"] * model["head_dim"]
    return [(hidden, query, 2), (hidden, kv, 2), (hidden, inter, 2), (inter, hidden, 1)]


def _session(nodes, initializers, k: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count()
    options.log_severity_level = 3
    # an idle session's threads spin after its run and would take the cores from the next kernel's
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def kernel_sessions(k: int, n: int, blocks: list[int], rng) -> dict:
    """name -> a one-node session multiplying [M, K] float32 by a random K x N weight."""
    from onnx import helper, numpy_helper
    sessions = {}
    for block in blocks:
        packed = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
        scales = (rng.random(n * (k // block)) * 0.01).astype(np.float32)
        node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                                block_size=block, accuracy_level=4)
        sessions[f"nbits4_b{block}"] = _session([node], [numpy_helper.from_array(packed, "w"),
                                                         numpy_helper.from_array(scales, "s")], k)
    weight = rng.integers(-127, 128, (k, n), dtype=np.int8)
    scale = (rng.random(n) * 0.01).astype(np.float32)
    node = helper.make_node("DynamicQuantizeMatMul", ["x", "w", "s"], ["y"], domain="com.microsoft")
    sessions["qgemm_int8"] = _session([node], [numpy_helper.from_array(weight, "w"),
                                               numpy_helper.from_array(scale, "s")], k)
    dense = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w")
    sessions["sgemm_fp32"] = _session([helper.make_node("MatMul", ["x", "w"], ["y"])], [dense], k)
    return sessions


def time_kernels(sessions: dict, x: np.ndarray, repeats: int) -> dict[str, float]:
    """name -> median seconds of one run: each kernel's runs in a row after a first, untimed one."""
    medians = {}
    for name, session in sessions.items():
        session.run(None, {"x": x})
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            session.run(None, {"x": x})
            times.append(time.perf_counter() - began)
        medians[name] = statistics.median(times)
    return medians


def chunk_ops(artifact: Path, graph: str, start: int) -> dict[str, float]:
    """op type -> milliseconds a run of one chunk of `graph` at `start` filled rows (ORT profiler)."""
    import onnxruntime as ort
    from graph_runtimes import feeds_of
    path = artifact / f"{graph}.onnx"
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count()
    options.log_severity_level = 3
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4")
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as folder:
        options.profile_file_prefix = str(Path(folder) / "chunk")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                                       disabled_optimizers=["MatMulAddFusion"])   # as runtime/ort_backend.py
        feeds = feeds_of(path, start)
        for _ in range(5):
            session.run(["logits"], feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    kernels = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
                     key=lambda e: e["ts"])
    by_op = collections.Counter()
    for event in kernels[len(kernels) // 5:]:                 # every run runs the same nodes; the first is left out
        by_op[event["args"]["op_name"]] += event["dur"] / 4 / 1e3
    return {op: round(ms, 1) for op, ms in by_op.most_common()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--graph", help="a graph of the artifact to profile by op type (e.g. prefill_4096, decode_4)")
    parser.add_argument("--start", type=int, default=0, help="cache rows filled before the profiled chunk")
    parser.add_argument("--rows", default="64,256", help="M: rows a product (the chunk), comma-separated")
    parser.add_argument("--blocks", default="32,128", help="block sizes of the 4-bit kernel")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model = json.loads((args.artifact / "manifest.json").read_text())["model"]
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    per_layer = collections.defaultdict(float)              # (kernel, M) -> seconds of one layer's products
    for k, n, count in linear_shapes(model):
        sessions = kernel_sessions(k, n, [int(b) for b in args.blocks.split(",")], rng)
        for m in rows:
            medians = time_kernels(sessions, rng.standard_normal((m, k)).astype(np.float32), args.repeats)
            for name, seconds in medians.items():
                per_layer[name, m] += count * seconds
                print(json.dumps({"kernel": name, "K": k, "N": n, "M": m, "ms": round(seconds * 1e3, 3),
                                  "gops": round(2 * m * k * n / seconds / 1e9)}), flush=True)
        del sessions
    layers = model["num_layers"]
    print(json.dumps({"linear_s": {f"{name} M={m}": round(s * layers * args.prompt_tokens / m, 2)
                                   for (name, m), s in per_layer.items()}, "prompt_tokens": args.prompt_tokens,
                      "model": model["name"]}), flush=True)
    if args.graph:
        print(json.dumps({"chunk_ops": chunk_ops(args.artifact, args.graph, args.start), "graph": args.graph,
                          "start": args.start}), flush=True)
    print(json.dumps({"load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))           # graph_runtimes.feeds_of
    sys.exit(main())
