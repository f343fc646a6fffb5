"""Weight formats (--weights fp16 / int8 / int4): block quantization, GGUF blocks kept exactly,
the graph form, parity against the oracle on the graph's own weights, on tiny models."""
import json

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from snapcompile.artifact.manifest import read_manifest
from snapcompile.artifact.onnx_io import load_graph
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.export.gguf_blocks import _split_blocks, kept_blocks
from snapcompile.export.quantize import BlockQuantized, pack_int4, quantize
from snapcompile.export.weights import graph_weights
from snapcompile.models.tensors import gguf_hf_name, unpermute_rows
from snapcompile.validate.parity import Validator, oracle_model, summarize
from tests.conftest import TINY_SNAPSTREAM, build_artifact, random_prompts

QUANT_EXPORT = dict(slots=3, max_context=512, chunk=64)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64])
def test_quantize_is_symmetric_round_to_nearest(bits, block):
    weight = np.random.default_rng(bits + block).standard_normal((24, 128)).astype(np.float32)
    matrix = quantize(weight, bits, block, "w")
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    assert matrix.values.min() >= low and matrix.values.max() <= high
    assert matrix.offsets is None and matrix.scales.shape == (24, 128 // block)
    error = np.abs(matrix.dequantize() - weight).reshape(24, -1, block)
    # within one step: the largest magnitude maps to -2^(bits-1), the other sign may clip at 2^(bits-1) - 1
    assert (error <= np.abs(matrix.scales)[:, :, None] + 1e-6).all()
    assert np.median(error / np.abs(matrix.scales)[:, :, None]) < 0.3
    assert matrix.requantized_blocks == 24 * 128 // block and matrix.exact_blocks == 0


def test_block_size_must_divide_the_inputs():
    with pytest.raises(SnapcompileError, match="--block-size 64 does not divide the 96 inputs of w"):
        quantize(np.zeros((4, 96), np.float32), 4, 64, "w")
    from snapcompile.validate.tolerances import tolerance
    assert tolerance(ExportConfig(weight_format="fp16")) > tolerance(ExportConfig(weight_format="int4")) == 1e-3
    with pytest.raises(SnapcompileError, match="power of two"):
        ExportConfig(weight_format="int4", block_size=48)
    with pytest.raises(SnapcompileError, match="unknown --weights"):
        ExportConfig(weight_format="int3")


def test_int4_packing_puts_the_first_value_in_the_low_nibble():
    assert pack_int4(np.array([1, -1, -8], np.int8)) == bytes([0xF1, 0x08])


@pytest.mark.parametrize("width", [1, 6, 7])
def test_nibbles_unpack_what_they_pack(width):
    from snapcompile.nibbles import pack_nibbles, unpack_nibbles
    codes = np.random.default_rng(width).integers(0, 16, (3, 2, width)).astype(np.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 2, (width + 1) // 2) and packed[0, 0, 0] == codes[0, 0, 0] | (
        (codes[0, 0, 1] << 4) if width > 1 else 0)
    np.testing.assert_array_equal(unpack_nibbles(packed)[..., :width], codes)


@pytest.mark.parametrize("kind, bits", [("Q4_1", 4), ("Q4_1", 8), ("Q4_0", 4), ("Q8_0", 8)])
def test_gguf_blocks_are_kept_exactly(kind, bits):
    qtype = gguf.GGMLQuantizationType[kind]
    weight = np.random.default_rng(1).standard_normal((6, 96)).astype(np.float32)
    raw = gguf_quantize(weight, qtype)
    file_values = dequantize(raw, qtype)               # what transformers' GGUF loader gives the model
    matrix = kept_blocks((*_split_blocks(raw, kind), 8 if kind.startswith("Q4") else 0), file_values, bits)
    assert matrix is not None and matrix.exact_blocks == 18 and matrix.requantized_blocks == 0
    assert (matrix.offsets is not None) == (kind == "Q4_1")
    np.testing.assert_allclose(matrix.dequantize(), file_values, rtol=0, atol=1e-6)


def test_gguf_blocks_are_not_kept_when_they_cannot_be_exact():
    weight = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    q8 = gguf_quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    blocks = (*_split_blocks(q8, "Q8_0"), 0)
    assert kept_blocks(blocks, dequantize(q8, gguf.GGMLQuantizationType.Q8_0), 4) is None   # 8-bit in 4 bits
    assert kept_blocks(blocks, weight, 8) is None            # not the values the model loaded: never kept


def test_gguf_names_and_row_order_follow_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    rows = np.arange(48)[:, None].astype(np.float32)
    theirs = LlamaTensorProcessor()._reverse_permute_weights(rows, 4)
    np.testing.assert_array_equal(rows[unpermute_rows(48, 4)], theirs)
    assert gguf_hf_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    assert gguf_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_hf_name("blk.7.attn_norm.weight") == "model.layers.7.input_layernorm.weight"
    assert gguf_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_hf_name("blk.7.attn_rot.weight") is None and gguf_hf_name("blk.x.attn_q.weight") is None
    # a gemma3 file's ffn_norm is the norm before the MLP, and it has two more norms a layer
    assert gguf_hf_name("blk.7.ffn_norm.weight") == "model.layers.7.post_attention_layernorm.weight"
    assert gguf_hf_name("blk.7.ffn_norm.weight", "gemma3") == "model.layers.7.pre_feedforward_layernorm.weight"
    assert gguf_hf_name("blk.7.post_attention_norm.weight", "gemma3") == \
        "model.layers.7.post_attention_layernorm.weight"
    assert gguf_hf_name("blk.7.post_ffw_norm.weight", "gemma3") == "model.layers.7.post_feedforward_layernorm.weight"
    assert gguf_hf_name("blk.7.post_ffw_norm.weight") is None


def test_gemma_norms_are_stored_as_the_graphs_multiply_by_them_and_read_back_as_the_model_holds_them():
    """Gemma multiplies by 1 + w: the graphs hold 1 + w (computed in float32 as transformers does), and
    graph_weights gives w back for the oracle; the four norms of each layer are all there."""
    import onnx

    from snapcompile.export.llama_graph import DecodeWriter
    from snapcompile.export.weights import Weights, graph_weights
    from snapcompile.models import load_model
    loaded = load_model("tiny-gemma3")
    weights = Weights(loaded.tensors, loaded.spec, loaded.config)
    model = DecodeWriter(loaded.spec, weights, ExportConfig(slots=1, max_context=64, chunk=16)).build().model()
    held = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    source = loaded.tensors.read("model.layers.1.pre_feedforward_layernorm.weight")
    np.testing.assert_array_equal(held["l1.post_norm"], np.float32(1) + source)
    back = graph_weights(model, loaded.spec)
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
        np.testing.assert_allclose(back[f"model.layers.0.{name}.weight"],
                                   loaded.tensors.read(f"model.layers.0.{name}.weight"), atol=1e-7)


@pytest.fixture(scope="module", params=["fp16", "int8", "int4"])
def weight_artifacts(request, tiny_llama, tmp_path_factory):
    """(weights, dense folder, snapstream folder) of tiny-llama at fp16 / int8 / int4."""
    export = ExportConfig(**QUANT_EXPORT, weight_format=request.param)
    root = tmp_path_factory.mktemp(request.param)
    return (request.param, build_artifact(tiny_llama, root / "dense", export),
            build_artifact(tiny_llama, root / "snap", export, TINY_SNAPSTREAM))


def test_artifacts_match_the_oracle_on_their_weights(weight_artifacts):
    weights, dense, snap = weight_artifacts
    bound = 1e-4 if weights != "fp16" else 0.05          # fp16 logits: within 1-2 float16 steps
    for folder, lengths in ((dense, [7, 90, 300]), (snap, [200, 300, 20])):
        manifest = read_manifest(folder)
        summary = summarize(Validator(folder, oracle_model(folder, manifest)).run(random_prompts(lengths, 3), 40), 40)
        assert summary["max_abs_logit_diff"] <= bound, (weights, folder.name, summary["max_abs_logit_diff"])
        assert summary["greedy_agreement"] == 1.0
        assert not summary["selection_mismatches"]


def test_fast_int8_kernels_run_but_are_not_exact(weight_artifacts):
    """ORT's default int8-activation kernels: what run/serve use; validate --matmul int8 shows the gap."""
    weights, dense, _ = weight_artifacts
    if weights == "fp16":
        pytest.skip("int8 kernels are for int8 / int4 weights")
    manifest = read_manifest(dense)
    fast = Validator(dense, oracle_model(dense, manifest), exact_matmul=False)
    summary = summarize(fast.run(random_prompts([50], 5), 8), 8)
    assert 1e-4 < summary["max_abs_logit_diff"] < 5.0


def test_fp16_graph_multiplies_in_float16(weight_artifacts, tiny_llama):
    weights, dense, _ = weight_artifacts
    if weights != "fp16":
        pytest.skip("fp16 only")
    manifest = read_manifest(dense)
    decode = load_graph(dense, manifest, "decode", with_weights=True)
    halves = [t.name for t in decode.graph.initializer if t.data_type == 10]
    assert set(halves) >= {"embed_tokens", "l0.q.wT", "l1.down.wT", "lm_head"} and "norm" not in halves
    held = graph_weights(decode, manifest.spec)
    state = tiny_llama.model.state_dict()
    for name, value in held.items():      # float16 rounding of the fp32 weights, nothing else
        np.testing.assert_array_equal(value, state[name].numpy().astype(np.float16).astype(np.float32), name)
    assert manifest.weights_report["step_weight_bytes"] < manifest.weights_report["weight_bytes"]


def test_graph_holds_what_the_manifest_reports(weight_artifacts, tiny_llama):
    weights, dense, _ = weight_artifacts
    if weights == "fp16":
        pytest.skip("block-quantized formats only")
    manifest = read_manifest(dense)
    report = manifest.weights_report
    assert report["format"] == weights and report["bits"] == {"int8": 8, "int4": 4}[weights]
    assert report["head_bits"] == 8 and report["exact_blocks"] == 0        # tiny models have no GGUF
    per_layer = (64 + 32 + 32 + 64 + 128 + 128) * 64 // 32 + 64 * 128 // 32   # q k v o gate up (K 64), down (K 128)
    assert report["requantized_blocks"] == 2 * per_layer + 320 * 64 // 32       # 2 layers + the untied head
    decode = load_graph(dense, manifest, "decode", with_weights=True)
    held = graph_weights(decode, manifest.spec)
    state = {k: v.numpy() for k, v in tiny_llama.model.state_dict().items()}
    step = {"int8": 0.25 / 127 * 4, "int4": 0.25 / 7 * 4}[weights]          # ~half a step at 4 sigma
    for name, value in held.items():
        assert value.shape == state[name].shape, name
        assert np.abs(value - state[name]).max() < step, name
    ops = {n.op_type for n in decode.graph.node}
    assert "DequantizeLinear" in ops and not any(n.domain for n in decode.graph.node)   # standard ONNX only


def test_block_quantized_dequantize_with_offsets():
    values = np.array([[-8, 7, 0, 1]], np.int8)
    matrix = BlockQuantized(values, np.array([[0.5, 2.0]], np.float32), np.array([[1.0, -1.0]], np.float32), 4, 2)
    np.testing.assert_array_equal(matrix.dequantize(), [[-3.0, 4.5, -1.0, 1.0]])


def test_streamingllm_plugin_lowering_on_quantized_weights(tiny_llama, tmp_path):
    from snapcompile.export import export_model
    from snapcompile.passes.pipeline import compress_graphs
    policy = PolicyConfig(policy="streamingllm", budget=64, sinks=4, window=8)
    export = ExportConfig(**QUANT_EXPORT, weight_format="int4")
    folder = tmp_path / "plugin"
    export_model(tiny_llama, export, folder, policy=policy,
                 transform=lambda graphs, m: compress_graphs(graphs, m, policy, "plugin"))
    manifest = read_manifest(folder)
    summary = summarize(Validator(folder, oracle_model(folder, manifest)).run(random_prompts([200, 9], 6), 70), 70)
    assert summary["max_abs_logit_diff"] <= 1e-4 and summary["greedy_agreement"] == 1.0


def test_cli_convert_inspect_run_validate_int4(tmp_path):
    from tests.cli_helpers import assert_one_line_error, invoke
    out = tmp_path / "int4"
    result = invoke("convert", "tiny-llama", "-o", out, "--weights", "int4", "--block-size", 64, "--budget", 64,
                    "--window", 8, "--kernel", 5, "--max-context", 256, "--chunk", 32, "--slots", 2)
    assert result.exit_code == 0, result.output
    info = json.loads(invoke("inspect", out, "--json").output)
    assert info["export"]["weight_format"] == "int4" and info["export"]["block_size"] == 64
    assert info["weights_report"]["requantized_blocks"] > 0
    # tensors under 1 KiB (here the norms and most block scales) stay inside the graphs
    weight_bytes = info["weights_report"]["weight_bytes"]
    assert 0.8 * weight_bytes <= info["weights_file_bytes"] <= weight_bytes
    text = invoke("inspect", out).output
    assert "weights        int4 (blocks of 64, LM head 8-bit; GGUF blocks kept 0" in text
    run = invoke("run", out, "--prompt", "hello " * 40, "--max-new-tokens", 4, "--json")
    assert run.exit_code == 0, run.output
    kernels = json.loads(run.output.strip().splitlines()[-1])["summary"]["kernels"]
    assert kernels == "ONNX Runtime MatMulNBits, int4 weights, int8 (accuracy level 4) activations"
    for matmul, passed in (("fp32", True), ("int8", None)):
        valid = invoke("validate", out, "--prompt", "abc " * 60, "--steps", 6, "--json", "--matmul", matmul)
        summary = json.loads(next(line for line in valid.output.splitlines() if line.startswith("{")))
        assert summary["weight_format"] == "int4" and summary["matmul"] == matmul
        if passed:
            assert valid.exit_code == 0 and summary["max_abs_logit_diff"] <= 1e-4
    too_big_block = invoke("export", "tiny-llama", "-o", tmp_path / "x", "--weights", "int4", "--block-size", 256)
    assert_one_line_error(too_big_block, "does not divide the 64 inputs")
    assert_one_line_error(invoke("export", "tiny-llama", "-o", tmp_path / "x", "--block-size", 24), "power of two")
    assert_one_line_error(invoke("export", "tiny-llama", "-o", tmp_path / "x", "--weights", "int2"), "--weights")


@pytest.mark.parametrize("block, kept", [(32, True), (64, False)])
def test_a_gguf_tensor_quantized_again_is_counted_and_convert_warns_of_it(block, kept, capsys):
    from types import SimpleNamespace

    from snapcompile.cli.convert import warn_requantized_gguf
    from snapcompile.export.weights import Quantizer
    weight = np.random.default_rng(3).standard_normal((6, 128)).astype(np.float32)
    raw = gguf_quantize(weight, gguf.GGMLQuantizationType.Q4_1)
    name = "model.layers.0.mlp.up_proj.weight"
    blocks = {name: (*_split_blocks(raw, "Q4_1"), 8)}
    quantizer = Quantizer(ExportConfig(weight_format="int4", block_size=block), blocks, {name: "Q4_1"})
    source = dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
    matrix = quantizer(name, source)
    report = quantizer.report()
    assert (matrix.exact_blocks > 0) == kept and report["gguf_tensors_requantized"] == (0 if kept else 1)
    warn_requantized_gguf(SimpleNamespace(weights_report=report, export=ExportConfig(weight_format="int4",
                                                                                    block_size=block)))
    warning = capsys.readouterr().err
    assert ("quantized blocks of 1 tensor (Q4_1 x1) were quantized again at int4 blocks of 64" in warning) != kept
    if not kept:
        error = np.linalg.norm(matrix.dequantize() - source) / np.linalg.norm(source)
        assert np.isclose(report["gguf_tensor_errors"][name][1], error) and 0 < error < 0.5
        assert f"relative error median {error:.3g}, worst {error:.3g} ({name})" in warning


def test_a_k_quant_tensor_is_quantized_again_with_its_error_stated():
    """A tensor the file holds as Q6_K (not a kept kind) is quantized here at any block size, and its
    relative error against the file's values is in the report, by type."""
    from snapcompile.export.weights import Quantizer
    weight = np.random.default_rng(4).standard_normal((4, 256)).astype(np.float32)
    quantizer = Quantizer(ExportConfig(weight_format="int8", block_size=32), {}, {"w.weight": "Q6_K"})
    matrix = quantizer("w.weight", weight)
    report = quantizer.report()
    assert matrix.exact_blocks == 0 and report["gguf_requantized_types"] == {"Q6_K": 1}
    assert report["gguf_requantized_error"]["worst"] == "w.weight"
    assert np.isclose(report["gguf_requantized_error"]["max"],
                      np.linalg.norm(matrix.dequantize() - weight) / np.linalg.norm(weight))
