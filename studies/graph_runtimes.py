"""One prefill chunk of an artifact's graph on ONNX Runtime and on OpenVINO Runtime, alternating.

Issue 21 allows another backend for the same artifacts where ONNX Runtime cannot reach the
prefill target; this measures whether OpenVINO Runtime, reading our ONNX graph as it is, runs a
chunk faster on this CPU. Inputs are random (the timing does not depend on the values); the chunk
attends over `--start` filled rows of the graph's cache. OpenVINO lives in its own venv (the
peers' set-up, ../shared/peers/README.md): give its interpreter with --ov-python; each round runs
both runtimes, one process each, and prints one JSON line per runtime, then the medians.

    .venv/bin/python studies/graph_runtimes.py ARTIFACT --graph prefill_2048 --start 1536 \
        --ov-python ../peers/ovenv/bin/python --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def feeds_of(graph_path: Path, start: int) -> dict:
    """Random inputs of a prefill graph (a full chunk at `start` filled rows) or of a decode graph
    (every slot at `start` filled rows, writing row `start`: below the budget)."""
    import numpy as np
    import onnx
    model = onnx.load(str(graph_path), load_external_data=False)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    logits, = [o for o in model.graph.output if o.name == "logits"]
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value
    rng = np.random.default_rng(0)
    chunk = shapes["input_ids"][1]
    feeds = {}
    for name, shape in shapes.items():
        if name == "input_ids":
            feeds[name] = rng.integers(0, vocab, shape).astype(np.int64)
        elif name in ("start", "position", "cache_len", "write_index"):
            feeds[name] = np.full(shape, start, np.int64)
        elif name == "chunk_len":
            feeds[name] = np.array([chunk], np.int64)
        elif types[name] == onnx.TensorProto.INT8:       # an int8 cache's rows (snapcompile/kv_int8.py)
            from snapcompile import kv_int8
            feeds[name] = kv_int8.encode(rng.standard_normal([*shape[:-1], shape[-1] - kv_int8.SCALE_BYTES]) * 0.5)
        else:
            values = rng.standard_normal(shape) * 0.5
            feeds[name] = values.astype(np.float16 if types[name] == onnx.TensorProto.FLOAT16 else np.float32)
    return feeds


def runner(runtime: str, graph_path: Path, threads: int, precision: str):
    """A function running the graph once, and the seconds its compilation took."""
    began = time.perf_counter()
    if runtime == "ort":
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(graph_path), options, providers=["CPUExecutionProvider"])
        return (lambda feeds: session.run(["logits"], feeds)), time.perf_counter() - began
    import openvino as ov
    compiled = ov.Core().compile_model(str(graph_path), "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                              "INFERENCE_PRECISION_HINT": precision})
    request = compiled.create_infer_request()
    return request.infer, time.perf_counter() - began


def measure(args) -> dict:
    graph_path = Path(args.artifact) / f"{args.graph}.onnx"
    feeds = feeds_of(graph_path, args.start)
    run, compile_s = runner(args.runtime, graph_path, args.threads, args.precision)
    run(feeds)                                                   # first run: allocation, not timed
    times = []
    for _ in range(args.repeats):
        began = time.perf_counter()
        run(feeds)
        times.append(time.perf_counter() - began)
    return {"runtime": args.runtime, "graph": args.graph, "start": args.start, "compile_s": round(compile_s, 2),
            "chunk_ms": round(statistics.median(times) * 1e3, 1), "repeats": args.repeats,
            "precision": args.precision if args.runtime == "openvino" else "f32"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--graph", default="prefill")
    parser.add_argument("--start", type=int, default=0, help="cache rows filled before the chunk")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per round (median)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="f32", help="OpenVINO's INFERENCE_PRECISION_HINT (f32, bf16)")
    parser.add_argument("--ov-python", help="the interpreter of a venv with openvino")
    parser.add_argument("--runtime", choices=["ort", "openvino"], help=argparse.SUPPRESS)   # one measurement
    args = parser.parse_args()
    if args.runtime:
        print(json.dumps(measure(args)), flush=True)
        return 0
    if not args.ov_python:
        parser.error("--ov-python is required (the OpenVINO venv's python)")
    common = [args.artifact, "--graph", args.graph, "--start", str(args.start), "--threads", str(args.threads),
              "--repeats", str(args.repeats), "--precision", args.precision]
    rows = []
    for _ in range(args.rounds):
        for runtime, python in (("ort", sys.executable), ("openvino", args.ov_python)):
            out = subprocess.run([python, __file__, *common, "--runtime", runtime], check=True,
                                 capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    medians = {r: statistics.median(x["chunk_ms"] for x in rows if x["runtime"] == r) for r in ("ort", "openvino")}
    print(json.dumps({"median_chunk_ms": medians, "openvino_over_ort": round(medians["openvino"] / medians["ort"], 3),
                      "load_average": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
