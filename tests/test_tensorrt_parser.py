"""The static TensorRT 10 ONNX-parser check: every graph the TensorRT path consumes passes it;
each kind of violation is caught and names its node."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from snapcompile.artifact.manifest import read_manifest
from snapcompile.artifact.onnx_io import load_graph
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.export import export_model
from snapcompile.passes.pipeline import compress_graphs
from snapcompile.runtime.tensorrt_parser import artifact_parser_problems, parser_problems


@pytest.mark.parametrize("weights", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("policy, lowering", [
    ("dense", "standard"), ("snapstream", "standard"), ("snapstream", "plugin"), ("streamingllm", "plugin"),
    ("snapstream-avg-layer", "standard")])
def test_every_artifact_graph_fits_tensorrt(tiny_llama, tmp_path, weights, policy, lowering):
    if policy == "snapstream-avg-layer":
        config = PolicyConfig(budget=64, window=8, kernel=5, pooling="avg", scope="layer")
    else:
        config = PolicyConfig(policy=policy, budget=64, window=8, kernel=5)
    export = ExportConfig(slots=2, max_context=256, chunk=32, weight_format=weights)
    transform = None if policy == "dense" else (lambda graphs, m: compress_graphs(graphs, m, config, lowering))
    export_model(tiny_llama, export, tmp_path / "a", policy=config, transform=transform)
    manifest = read_manifest(tmp_path / "a")
    graphs = {name: load_graph(tmp_path / "a", manifest, name) for name in manifest.graphs}
    assert artifact_parser_problems(graphs) == []


@pytest.mark.parametrize("policy", ["dense", "snapstream"])
def test_a_float16_cache_artifact_fits_tensorrt(tiny_llama, tmp_path, policy):
    """--kv-dtype float16: the casts at every cache input and output are in TensorRT's support too."""
    from snapcompile.compiler.route import compile_artifact
    export = ExportConfig(slots=2, max_context=256, chunk=32, weight_format="int4", kv_dtype="float16")
    compile_artifact(tiny_llama, export, PolicyConfig(policy=policy, budget=64, window=8, kernel=5), tmp_path / "a")
    manifest = read_manifest(tmp_path / "a")
    graphs = {name: load_graph(tmp_path / "a", manifest, name) for name in manifest.graphs}
    assert any(i.type.tensor_type.elem_type == TensorProto.FLOAT16 for g in graphs.values() for i in g.graph.input)
    assert artifact_parser_problems(graphs) == []


def test_a_gemma3_artifact_with_window_rings_fits_tensorrt(tmp_path):
    """Gemma 3's graphs (GELU, the window rings' masks from positions: Mod, comparisons) are in TensorRT's
    support: a SnapStream artifact of tiny-gemma3, int4 weights, the float16 cache."""
    from snapcompile.compiler.route import compile_artifact
    from snapcompile.models import load_model
    export = ExportConfig(slots=2, max_context=256, chunk=32, weight_format="int4", kv_dtype="float16")
    policy = PolicyConfig(policy="snapstream", budget=64, window=8, kernel=5)
    compile_artifact(load_model("tiny-gemma3"), export, policy, tmp_path / "a")
    manifest = read_manifest(tmp_path / "a")
    graphs = {name: load_graph(tmp_path / "a", manifest, name) for name in manifest.graphs}
    assert any(node.op_type == "Gelu" for node in graphs["decode"].graph.node)
    assert artifact_parser_problems(graphs) == []


def _model(nodes, inputs, initializers, opset=21, domains=()):
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializers)
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=opsets)


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])
W4 = helper.make_tensor("w", TensorProto.INT4, [64, 8], np.zeros(512, np.int8).tolist())
SCALE = numpy_helper.from_array(np.ones((2, 8), np.float32), "s")


def test_standard_quantized_matmul_passes():
    nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], "dq", axis=0, block_size=32),
             helper.make_node("MatMul", ["x", "wf"], ["y"], "mm")]
    assert parser_problems(_model(nodes, [X], [W4, SCALE]), "g") == []


@pytest.mark.parametrize("case, expected", [
    ("contrib", "node 'mnb' (MatMulNBits): operator domain 'com.microsoft'"),
    ("zero_point", "node 'dq' (DequantizeLinear): x_zero_point must be zero"),
    ("int8_gather", "node 'gather' (Gather): input 'table' is INT8"),
    ("pool_1d", "node 'pool' (MaxPool): 2D or 3D pooling only"),
    ("topk", "node 'topk' (TopK): K must be at most 3840"),
    ("bitshift", "node 'shift' (BitShift): BitShift is not supported"),
    ("opset", "opset 25 is outside TensorRT 10.15's 9-24"),
    ("plugin", "node 'custom' (Mystery): custom op Mystery is not one of the snapcompile plugin's"),
])
def test_violations_name_the_node(case, expected):
    if case == "contrib":
        node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], "mnb", domain="com.microsoft",
                                K=64, N=8, bits=4, block_size=32)
        model = _model([node], [X], [W4, SCALE], domains=["com.microsoft"])
    elif case == "zero_point":
        zero = helper.make_tensor("z", TensorProto.INT4, [2, 8], [1] * 16)
        model = _model([helper.make_node("DequantizeLinear", ["w", "s", "z"], ["wf"], "dq", axis=0, block_size=32),
                        helper.make_node("MatMul", ["x", "wf"], ["y"], "mm")], [X], [W4, SCALE, zero])
    elif case == "int8_gather":
        table = numpy_helper.from_array(np.zeros((4, 8), np.int8), "table")
        ids = numpy_helper.from_array(np.array([1]), "ids")
        model = _model([helper.make_node("Gather", ["table", "ids"], ["t"], "gather"),
                        helper.make_node("Cast", ["t"], ["y"], "cast", to=1)], [], [table, ids])
    elif case == "pool_1d":
        x3 = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 64])
        model = _model([helper.make_node("MaxPool", ["x"], ["y"], "pool", kernel_shape=[3])], [x3], [])
    elif case == "topk":
        k = numpy_helper.from_array(np.array([4000]), "k")
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5000])
        model = _model([helper.make_node("TopK", ["x", "k"], ["y", "i"], "topk")], [x], [k])
    elif case == "bitshift":
        x = helper.make_tensor_value_info("x", TensorProto.UINT8, [4])
        model = _model([helper.make_node("BitShift", ["x", "x"], ["y"], "shift", direction="LEFT")], [x], [])
    elif case == "opset":
        model = _model([helper.make_node("Relu", ["x"], ["y"], "relu")], [X], [], opset=25)
    else:
        model = _model([helper.make_node("Mystery", ["x"], ["y"], "custom", domain="ai.onnx.contrib")], [X], [],
                       domains=["ai.onnx.contrib"])
    problems = parser_problems(model, "g")
    assert any(expected in line for line in problems), problems


def test_build_runs_the_check_before_needing_tensorrt(tiny_snap_dir, tmp_path, monkeypatch):
    from snapcompile.runtime import trt_backend
    monkeypatch.setattr("snapcompile.runtime.tensorrt_parser.artifact_parser_problems",
                        lambda graphs: ["decode: node 'n' (X): planted"])
    with pytest.raises(SnapcompileError, match="TensorRT's ONNX parser would reject decode: node 'n' \\(X\\): planted"):
        trt_backend.build_engines(tiny_snap_dir, tmp_path / "engines")
    assert not (tmp_path / "engines").exists()


def test_check_reads_graphs_without_their_weights(tiny_dense_dir):
    manifest = read_manifest(tiny_dense_dir)
    model = load_graph(tiny_dense_dir, manifest, "decode")
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    assert parser_problems(model, "decode") == []


@pytest.mark.parametrize("share, fits", [(3840, True), (3841, False)])
def test_topk_limit_is_one_boundary_for_the_parser_check_and_the_build(share, fits):
    """k = 3840 passes both the static parser check and build's share check; 3841 fails both."""
    from dataclasses import replace

    from snapcompile.artifact.manifest import Manifest
    from snapcompile.models.spec import ModelSpec
    from snapcompile.runtime.trt_backend import check_trt_limits
    k = numpy_helper.from_array(np.array([share]), "k")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5000])
    problems = parser_problems(_model([helper.make_node("TopK", ["x", "k"], ["y", "i"], "topk")], [x], [k]), "g")
    assert (problems == []) == fits, problems
    spec = ModelSpec(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, max_positions=8192, rms_norm_eps=1e-5,
                     qkv_bias=False, tie_word_embeddings=True)
    policy = PolicyConfig(budget=share + 1000, prompt_share=share)
    manifest = Manifest("m", spec, ExportConfig(max_context=8192, chunk=256), policy, graphs={"select": {}})
    if fits:
        check_trt_limits(manifest)
    else:
        with pytest.raises(SnapcompileError, match="exceeds TensorRT's TopK limit of 3840"):
            check_trt_limits(manifest)
    check_trt_limits(replace(manifest, lowering="plugin"))     # the plugin lowering has no TopK
