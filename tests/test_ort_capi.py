"""ONNX Runtime sessions sharing pre-packed weights (runtime/ort_capi.py): a second session given the
same weights as a first keeps no copy of them, not even the one it packed and freed on finding the
container's (glibc would keep that freed copy in the heap: release_freed_heap)."""
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from snapcompile.runtime.ort_capi import OrtEnvironment

K = N = 4096
BLOCK = 32
MATRICES = 4


def _rss_anon_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon"))


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {}
    for i in range(MATRICES):
        arrays[f"w{i}"] = rng.integers(0, 256, (N, K // BLOCK, BLOCK // 2), dtype=np.uint8)
        arrays[f"s{i}"] = rng.random(N * K // BLOCK, dtype=np.float32)
    return arrays


def _model(weights: dict[str, np.ndarray], folder, outputs: str) -> bytes:
    """MATRICES int4 products of one input, each weight an external initializer (given by the session)."""
    nodes = [helper.make_node("MatMulNBits", ["x", f"w{i}", f"s{i}"], [f"{outputs}{i}"], domain="com.microsoft",
                              K=K, N=N, bits=4, block_size=BLOCK, accuracy_level=4) for i in range(MATRICES)]
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                              [helper.make_tensor_value_info(f"{outputs}{i}", TensorProto.FLOAT, [1, N])
                               for i in range(MATRICES)],
                              [numpy_helper.from_array(a, name) for name, a in weights.items()])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    onnx.save(model, folder / f"{outputs}.onnx", save_as_external_data=True, location=f"{outputs}.bin",
              size_threshold=0)
    return onnx.load(folder / f"{outputs}.onnx", load_external_data=False).SerializeToString()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_a_session_sharing_packed_weights_keeps_no_copy_of_them(tmp_path):
    weights = _weights()
    packed = sum(a.nbytes for a in weights.values())
    environment = OrtEnvironment(threads=1)
    config = {"session.model_external_initializers_file_folder_path": str(tmp_path)}
    first = environment.open_graph(_model(weights, tmp_path, "a"), weights, config, "first")
    before = _rss_anon_bytes()
    second = environment.open_graph(_model(weights, tmp_path, "b"), weights, config, "second")
    grown = _rss_anon_bytes() - before
    assert grown < packed / 4, f"the second session kept {grown / 2**20:.1f} MiB of {packed / 2**20:.1f} MiB weights"
    del first, second
