"""Decode-step time on ONNX Runtime of the two forms a quantized linear layer can take:
the standard blocked DequantizeLinear + MatMul that snapcompile writes (ORT fuses it into its
MatMulNBits kernel at session creation) and ORT's contrib MatMulNBits written directly.

    .venv/bin/python studies/weight_forms.py ARTIFACT [--steps 50]

ARTIFACT: an int4 or int8 artifact (`convert --weights int4`). Prints one JSON line per form
(median ms per decode step over --steps, same inputs, same session options).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from snapcompile.artifact.manifest import read_manifest
from snapcompile.artifact.onnx_io import load_graph


def to_matmulnbits(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace each DequantizeLinear -> MatMul pair by one com.microsoft MatMulNBits node."""
    init = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    nodes, dropped = [], set()
    for node in model.graph.node:
        dq = producers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if dq is None or dq.op_type != "DequantizeLinear":
            nodes.append(node)
            continue
        values = numpy_helper.to_array(init[dq.input[0]]).astype(np.int16).T        # [N, K]
        scales = numpy_helper.to_array(init[dq.input[1]]).T                          # [N, K/bs]
        bits = 4 if init[dq.input[0]].data_type == onnx.TensorProto.INT4 else 8
        n, k = values.shape
        block = k // scales.shape[1]
        unsigned = (values + (1 << (bits - 1))).astype(np.uint8)
        if bits == 4:
            unsigned = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
        name = dq.input[0]
        model.graph.initializer.extend([
            numpy_helper.from_array(unsigned.reshape(n, k // block, -1), f"{name}.nbits"),
            numpy_helper.from_array(np.ascontiguousarray(scales.reshape(-1)), f"{name}.nbits_scale")])
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], f"{name}.nbits", f"{name}.nbits_scale"],
                                      list(node.output), domain="com.microsoft", K=k, N=n, bits=bits,
                                      block_size=block, accuracy_level=4))
        dropped |= {dq.output[0], dq.name}
    kept = [n for n in nodes if n.name not in dropped]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def step_ms(path: Path, steps: int) -> float:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                                   disabled_optimizers=["MatMulAddFusion"])     # as OrtGraph does
    rng = np.random.default_rng(0)
    feeds = {}
    for value in session.get_inputs():
        shape = value.shape
        feeds[value.name] = (rng.integers(0, 100, shape) if "int64" in value.type
                             else rng.standard_normal(shape).astype(np.float32))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    manifest = read_manifest(args.artifact)
    decode = load_graph(args.artifact, manifest, "decode", with_weights=True)
    with tempfile.TemporaryDirectory() as tmp:
        standard, contrib = Path(tmp) / "standard.onnx", Path(tmp) / "matmulnbits.onnx"
        for tensor in decode.graph.initializer:     # the data is loaded: keep it inside the files
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
        onnx.save_model(decode, str(standard))
        onnx.save_model(to_matmulnbits(decode), str(contrib))
        for form, path in (("DequantizeLinear+MatMul", standard), ("MatMulNBits", contrib)):
            print(json.dumps({"form": form, "weight_format": manifest.export.weight_format,
                              "slots": manifest.export.slots,
                              "decode_step_ms": round(step_ms(path, args.steps), 2)}))


if __name__ == "__main__":
    main()
