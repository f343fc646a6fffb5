"""The split-form attention subgraph (standard ops, graphs/attention.py; what prefill ran until the
joined form of 2026-12-02, which docs/results/performance.md measures apart) against ONNX Runtime's
com.microsoft.GroupQueryAttention at SmolLM2-135M's shapes or the 1B's (docs/results/performance.md):
one chunk of 64 queries, 9 query / 3 KV heads (1B: 32 / 8), D = 64, against L cache rows of which
`start` are filled (GQA writes into a past buffer shared with its output through IOBinding); prints
the median milliseconds of each and their largest difference.

    .venv/bin/python studies/gqa_attention_bench.py [--shape 1b]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from snapcompile.graphs.attention import MASK_MIN

HEADS, KV_HEADS, DIM, CHUNK = 9, 3, 64, 64
GROUP = HEADS // KV_HEADS
POINTS = ((1024, 960), (2048, 1984), (4096, 2048), (4096, 4032))     # (cache rows, filled)


def _value(name: str, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def standard_graph(rows: int):
    """The split form with a causal chunk mask: scores against cache and chunk, one softmax, two products."""
    node = helper.make_node
    nodes = [node("Transpose", ["kc"], ["kct"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "kct"], ["sc0"]),
             node("Mul", ["sc0", "scale"], ["sc1"]), node("Add", ["sc1", "cm"], ["sc"]),
             node("Transpose", ["kn"], ["knt"], perm=[0, 1, 3, 2]), node("MatMul", ["q", "knt"], ["sn0"]),
             node("Mul", ["sn0", "scale"], ["sn1"]), node("Add", ["sn1", "nm"], ["sn"]),
             node("Concat", ["sc", "sn"], ["s"], axis=-1), node("Softmax", ["s"], ["p"], axis=-1),
             node("Split", ["p", "splits"], ["pc", "pn"], axis=-1), node("MatMul", ["pc", "vc"], ["oc"]),
             node("MatMul", ["pn", "vn"], ["on"]), node("Add", ["oc", "on"], ["out"])]
    constants = [helper.make_tensor("scale", TensorProto.FLOAT, [], [DIM ** -0.5]),
                 helper.make_tensor("splits", TensorProto.INT64, [2], [rows, CHUNK])]
    inputs = [_value("q", [1, KV_HEADS, GROUP * CHUNK, DIM]), _value("kn", [1, KV_HEADS, CHUNK, DIM]),
              _value("vn", [1, KV_HEADS, CHUNK, DIM]), _value("kc", [1, KV_HEADS, rows, DIM]),
              _value("vc", [1, KV_HEADS, rows, DIM]), _value("cm", [1, 1, 1, rows]),
              _value("nm", [GROUP * CHUNK, CHUNK])]
    graph = helper.make_graph(nodes, "standard", inputs, [_value("out", None)], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def gqa_graph(rows: int):
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens", "total"],
                            ["out", "pko", "pvo"], domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS,
                            scale=DIM ** -0.5)
    cache = [1, KV_HEADS, rows, DIM]
    inputs = [_value("q", [1, CHUNK, HEADS * DIM]), _value("k", [1, CHUNK, KV_HEADS * DIM]),
              _value("v", [1, CHUNK, KV_HEADS * DIM]), _value("pk", cache), _value("pv", cache),
              _value("seqlens", [1], TensorProto.INT32), _value("total", [], TensorProto.INT32)]
    outputs = [_value("out", None), _value("pko", cache), _value("pvo", cache)]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def session(model):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_ms(run, repeats: int = 20) -> float:
    run()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return float(np.median(times) * 1e3)


def measure(rows: int, start: int, rng) -> str:
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)   # noqa: E731
    k_cache, v_cache = normal(1, KV_HEADS, rows, DIM), normal(1, KV_HEADS, rows, DIM)
    q, k_new, v_new = normal(1, HEADS, CHUNK, DIM), normal(1, KV_HEADS, CHUNK, DIM), normal(1, KV_HEADS, CHUNK, DIM)
    cache_mask = np.where(np.arange(rows) < start, 0, MASK_MIN).astype(np.float32).reshape(1, 1, 1, rows)
    causal = np.arange(CHUNK)[None] <= (np.arange(GROUP * CHUNK) % CHUNK)[:, None]
    standard = session(standard_graph(rows))
    feeds = dict(q=q.reshape(1, KV_HEADS, GROUP * CHUNK, DIM), kn=k_new, vn=v_new, kc=k_cache, vc=v_cache,
                 cm=cache_mask, nm=np.where(causal, 0, MASK_MIN).astype(np.float32))
    reference = standard.run(None, feeds)[0].reshape(1, HEADS, CHUNK, DIM)
    gqa = session(gqa_graph(rows))
    past_k, past_v = k_cache.copy(), v_cache.copy()
    gqa_feeds = dict(q=q.transpose(0, 2, 1, 3).reshape(1, CHUNK, HEADS * DIM),
                     k=k_new.transpose(0, 2, 1, 3).reshape(1, CHUNK, KV_HEADS * DIM),
                     v=v_new.transpose(0, 2, 1, 3).reshape(1, CHUNK, KV_HEADS * DIM), pk=past_k, pv=past_v,
                     seqlens=np.array([start + CHUNK - 1], np.int32), total=np.array(start + CHUNK, np.int32))
    binding, out = gqa.io_binding(), np.empty((1, CHUNK, HEADS * DIM), np.float32)
    for name, array in gqa_feeds.items():
        binding.bind_cpu_input(name, array)
    for name, array in (("out", out), ("pko", past_k), ("pvo", past_v)):     # past shared with present
        binding.bind_output(name, "cpu", 0, np.float32, list(array.shape), array.ctypes.data)
    gqa.run_with_iobinding(binding)
    error = np.abs(out.reshape(1, CHUNK, HEADS, DIM).transpose(0, 2, 1, 3) - reference).max()
    standard_ms = median_ms(lambda: standard.run(None, feeds))
    gqa_ms = median_ms(lambda: gqa.run_with_iobinding(binding))
    return f"rows {rows}, filled {start}: standard {standard_ms:.2f} ms, GroupQueryAttention {gqa_ms:.2f} ms, " \
           f"max |diff| {error:.1e}"


# --shape: (heads, KV heads, points); the 1B shape's points reach a 32000-token prompt's last chunks
SHAPES = {"smollm2": (9, 3, POINTS), "1b": (32, 8, ((4096, 4032), (16384, 16320), (32768, 31936)))}


def main() -> None:
    global HEADS, KV_HEADS, GROUP
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2",
                        help="head counts: SmolLM2-135M's 9 / 3 or Llama-3.2-1B's 32 / 8 (D = 64 both)")
    HEADS, KV_HEADS, points = SHAPES[parser.parse_args().shape]
    GROUP = HEADS // KV_HEADS
    rng = np.random.default_rng(0)
    for rows, start in points:
        print(measure(rows, start, rng), flush=True)


if __name__ == "__main__":
    main()
