import json

import numpy as np
import onnx
import pytest

from snapcompile.artifact.manifest import MANIFEST, read_manifest
from snapcompile.config import ExportConfig
from snapcompile.errors import SnapcompileError
from snapcompile.export import export_model


def _static_dims(model):
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    values = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    return [(v.name, d) for v in values for d in v.type.tensor_type.shape.dim]


def test_artifact_layout_and_manifest(tiny_dense_dir):
    names = {p.name for p in tiny_dense_dir.iterdir()}
    assert {"prefill.onnx", "decode.onnx", "weights.bin", MANIFEST, "tokenizer.json"} <= names
    manifest = json.loads((tiny_dense_dir / MANIFEST).read_text())
    assert manifest["export"] == {"slots": 3, "max_context": 512, "chunk": 64, "weight_format": "fp32",
                                  "block_size": 32}
    assert manifest["weights_report"]["format"] == "fp32" and manifest["weights_file"] == "weights.bin"
    assert manifest["policy"]["policy"] == "dense"
    assert {"onnx", "onnxruntime", "torch", "transformers"} <= set(manifest["versions"])
    decode_inputs = {i["name"]: i["shape"] for i in manifest["graphs"]["decode"]["inputs"]}
    assert decode_inputs["input_ids"] == [3, 1]
    assert decode_inputs["past_key.0"] == [3, 2, 512, 16]
    assert decode_inputs["position"] == [3] and decode_inputs["cache_len"] == [3]


def test_decode_graph_has_no_symbolic_dimension(tiny_dense_dir):
    model = onnx.load(str(tiny_dense_dir / "decode.onnx"))
    onnx.checker.check_model(str(tiny_dense_dir / "decode.onnx"))
    dims = _static_dims(model)
    assert dims, "shape inference produced shapes"
    assert all(d.HasField("dim_value") for _, d in dims), [n for n, d in dims if not d.HasField("dim_value")]


def test_weights_are_stored_once(tiny_dense_dir, tiny_llama):
    params = sum(p.numel() for p in tiny_llama.model.parameters()) * 4
    size = (tiny_dense_dir / "weights.bin").stat().st_size
    assert params <= size < params * 1.1
    for graph in ("prefill.onnx", "prefill_128.onnx", "prefill_256.onnx", "decode.onnx"):
        assert (tiny_dense_dir / graph).stat().st_size < 100_000


def test_prefill_buckets_double_from_two_chunks_below_max_context(tiny_dense_dir):
    assert ExportConfig(max_context=8224, chunk=256).prefill_buckets() == [512, 1024, 2048, 4096]
    assert ExportConfig(max_context=512, chunk=256).prefill_buckets() == []
    from snapcompile.artifact.naming import bucket_rows, is_prefill_graph
    assert [bucket_rows(n) for n in ("prefill_128", "prefill", "decode", "select")] == [128, None, None, None]
    assert [is_prefill_graph(n) for n in ("prefill", "prefill_128", "decode")] == [True, True, False]
    manifest = read_manifest(tiny_dense_dir)
    assert sorted(manifest.graphs) == ["decode", "prefill", "prefill_128", "prefill_256"]
    past = {i["name"]: i["shape"] for i in manifest.graphs["prefill_128"]["inputs"]}["past_key.0"]
    assert past == [1, 2, 128, 16]


def test_prefill_runs_on_the_smallest_bucket_that_holds_the_prompt(tiny_dense_dir):
    from snapcompile.runtime.ort_backend import OrtBackend
    from tests.conftest import random_prompts
    backend = OrtBackend(tiny_dense_dir)
    assert [backend.prefill_rows(n) for n in (1, 128, 129, 256, 257, 511)] == [128, 128, 256, 256, 512, 512]
    prompt = random_prompts([200], seed=3)[0]
    on_bucket = backend.prefill(0, prompt).logits
    full_only = OrtBackend(tiny_dense_dir)
    full_only.bucket_graphs = {}                        # as an artifact exported without buckets
    on_full = full_only.prefill(0, prompt).logits
    np.testing.assert_allclose(on_bucket, on_full, atol=1e-5)
    np.testing.assert_allclose(backend.keys[1][0, :, :200], full_only.keys[1][0, :, :200], atol=1e-6)


def test_existing_output_needs_force(tiny_llama, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(SnapcompileError, match="already exists"):
        export_model(tiny_llama, ExportConfig(max_context=128, chunk=32), tmp_path / "out")


def test_failed_export_leaves_nothing(tiny_llama, tmp_path):
    def explode(graphs, manifest):
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        export_model(tiny_llama, ExportConfig(max_context=128, chunk=32), tmp_path / "out", transform=explode)
    assert list(tmp_path.iterdir()) == []


def test_force_replaces_atomically(tiny_llama, tmp_path):
    out = tmp_path / "out"
    export_model(tiny_llama, ExportConfig(max_context=128, chunk=32), out)
    export_model(tiny_llama, ExportConfig(max_context=256, chunk=32), out, force=True)
    assert read_manifest(out).export.max_context == 256
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_context_beyond_model_positions_is_rejected(tiny_llama, tmp_path):
    with pytest.raises(SnapcompileError, match="exceeds the model's 4096 positions"):
        export_model(tiny_llama, ExportConfig(max_context=8192, chunk=32), tmp_path / "out")


def test_prefill_logits_are_for_the_last_valid_token(tiny_dense_dir, tiny_llama):
    import torch

    from snapcompile.runtime.ort_backend import OrtBackend
    backend = OrtBackend(tiny_dense_dir)
    prompt = list(range(40, 50))                          # 10 tokens in a 64-token chunk: padding follows
    logits = backend.prefill(0, prompt).logits
    assert logits.shape == (read_manifest(tiny_dense_dir).spec.vocab_size,)
    with torch.no_grad():
        expected = tiny_llama.model(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(logits, expected[-1], atol=1e-4)
    assert np.abs(logits - expected[-2]).max() > 0.1, "not another position's logits"


def test_graphs_with_same_named_constants_keep_their_own_data(tmp_path):
    """Generated constant names repeat across graphs; only identical tensors may share bytes."""
    from snapcompile.artifact.manifest import Manifest
    from snapcompile.artifact.onnx_io import save_graphs
    from snapcompile.config import PolicyConfig
    from snapcompile.graphs.builder import GraphBuilder
    from snapcompile.models.spec import ModelSpec

    def graph(fill):
        b = GraphBuilder("g")
        x = b.input("x", np.float32, [512])
        b.output(b.op("Add", x, b.const(np.full(512, fill, np.float32), np.float32)), "y", np.float32, [512])
        return b.model()
    spec = ModelSpec("LlamaForCausalLM", 10, 8, 8, 1, 1, 1, 8, 64, 1e-5, False, False)
    manifest = Manifest("m", spec, ExportConfig(max_context=64, chunk=8), PolicyConfig(policy="dense"))
    save_graphs(tmp_path, {"a": graph(1.0), "b": graph(2.0)}, manifest)
    import onnxruntime as ort
    for name, fill in (("a", 1.0), ("b", 2.0)):
        session = ort.InferenceSession(str(tmp_path / f"{name}.onnx"), providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(session.run(None, {"x": np.zeros(512, np.float32)})[0], fill)
