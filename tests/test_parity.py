"""ONNX Runtime artifacts vs the PyTorch oracle on tiny random-weight models."""
import pytest

from snapcompile.config import PolicyConfig
from snapcompile.models import load_model
from snapcompile.validate.parity import Validator, summarize
from tests.conftest import build_artifact, random_prompts


def _validate(folder, model, prompts, steps):
    summary = summarize(Validator(folder, model).run(prompts, steps), steps)
    assert not summary["selection_mismatches"], summary["selection_mismatches"][:3]
    return summary


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"])
def test_dense_parity_each_architecture(name, tmp_path):
    loaded = load_model(name)
    folder = build_artifact(loaded, tmp_path / name)
    summary = _validate(folder, loaded.model, random_prompts([7, 90, 200, 300], seed=1), steps=32)  # buckets + full
    assert summary["max_abs_logit_diff"] <= 1e-4
    assert summary["greedy_agreement"] == 1.0
    assert summary["steps"] == 32 and summary["prompts"] == 4


@pytest.mark.parametrize("policy", [
    PolicyConfig(policy="snapstream", budget=64, sinks=4, window=8, kernel=5),
    PolicyConfig(policy="snapstream", budget=96, sinks=4, window=16, kernel=7, pooling="avg"),
    PolicyConfig(policy="snapstream", budget=48, sinks=2, window=8, kernel=3, scope="layer", prompt_share=40),
    PolicyConfig(policy="streamingllm", budget=64, sinks=4, window=8),
], ids=["snap-b64", "snap-b96-avg", "snap-b48-layer", "streaming-b64"])
def test_compressed_parity_with_ring_wrap(tiny_llama, tmp_path, policy):
    folder = build_artifact(tiny_llama, tmp_path / "art", policy=policy)
    budget = policy.budget
    prompts = random_prompts([3 * budget, min(8 * budget, 500), 20], seed=4)   # 3x..8x the budget, and a short one
    steps = 64
    summary = _validate(folder, tiny_llama.model, prompts, steps)
    assert summary["max_abs_logit_diff"] <= 1e-4
    assert summary["greedy_agreement"] == 1.0
    assert summary["compressed_prompts"] == 2
    ring = budget - policy.resolved_prompt_share
    assert steps > ring, "the test must run past the ring's first wrap"
    assert not summary["near_ties"]


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_qwen3_snapstream_parity_with_its_head_norms(tmp_path, weights):
    """Qwen3's queries and keys are RMS-normed per head before RoPE: the compressed artifact (its
    layer-by-layer prefill, the selection's window queries, the ring) equals the oracle, whose
    norms are transformers' own, and every decoder layer holds its two norms."""
    import dataclasses

    import onnx

    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.validate.parity import oracle_model
    from tests.conftest import TINY_EXPORT
    loaded = load_model("tiny-qwen3")
    assert loaded.spec.qk_norm and "qk_norm" in loaded.spec.to_dict()
    assert "model.layers.1.self_attn.k_norm.weight" in loaded.tensors.shapes
    policy = PolicyConfig(policy="snapstream", budget=64, sinks=4, window=8, kernel=5)
    export = dataclasses.replace(TINY_EXPORT, weight_format=weights)
    folder = build_artifact(loaded, tmp_path / "qwen3", export=export, policy=policy)
    oracle = oracle_model(folder, read_manifest(folder))         # the int4 weights dequantized, norms as exported
    summary = _validate(folder, oracle, random_prompts([300, 20], seed=5), steps=64)
    assert summary["greedy_agreement"] == 1.0 and summary["compressed_prompts"] == 1
    assert summary["max_abs_logit_diff"] <= (1e-4 if weights == "fp32" else 5e-3)
    decode = onnx.load(str(folder / "decode.onnx"), load_external_data=False)
    norms = {i.name for i in decode.graph.initializer if i.name.endswith(("q_norm", "k_norm"))}
    assert norms == {f"l{i}.{n}" for i in range(2) for n in ("q_norm", "k_norm")}


def test_short_prompt_matches_dense_attention(tiny_llama, tiny_snap_dir):
    """While prompt + generated fit in B, the compressed artifact equals dense attention."""
    summary = _validate(tiny_snap_dir, tiny_llama.model, random_prompts([10, 25], seed=9), steps=20)
    assert summary["dense_max_abs_logit_diff"] is not None
    assert summary["dense_max_abs_logit_diff"] <= 1e-4


def test_backend_selection_equals_reference(tiny_llama, tiny_snap_dir):
    from snapcompile.reference.oracle import ReferenceSequence
    from snapcompile.runtime.ort_backend import OrtBackend
    backend = OrtBackend(tiny_snap_dir)
    prompt = random_prompts([300], seed=11)[0]
    result = backend.prefill(0, prompt)
    reference = ReferenceSequence(tiny_llama.model, backend.manifest.policy, backend.rows_per_slot)
    reference.feed(prompt)
    for ours, theirs in zip(result.kept_rows, reference.selections()):
        assert (ours == theirs.indices.numpy()).all()
    assert result.layout.kept == backend.manifest.policy.resolved_prompt_share


@pytest.mark.parametrize("order", ["layers", "chunks"])
def test_select_buckets_equal_the_full_select_graph(tiny_snap_dir, order):
    """A prompt prefilled on a bucket is selected from the bucket's cache; the result must be
    what the max_context select graph gives."""
    import numpy as np

    from snapcompile.runtime.ort_backend import OrtBackend
    bucketed, full = OrtBackend(tiny_snap_dir, prefill_order=order), OrtBackend(tiny_snap_dir, prefill_order=order)
    if order == "chunks":
        full.prefills.select_buckets = {}
        buckets = bucketed.prefills.select_buckets
    else:
        full.prefills.select_graphs = {512: full.prefills.select_graphs[512]}
        buckets = {rows: g for rows, g in bucketed.prefills.select_graphs.items() if rows < 512}
    assert sorted(buckets) == [128, 256, 384]
    for length in (100, 200, 300, 450):          # selected from each bucket and from the full cache
        prompt = random_prompts([length], seed=length)[0]
        assert bucketed.prefill_rows(length) in [*buckets, 512]
        ours, theirs = bucketed.prefill(0, prompt), full.prefill(0, prompt)
        for mine, other in zip(ours.kept_rows, theirs.kept_rows):
            assert (mine == other).all()
        np.testing.assert_allclose(ours.logits, theirs.logits, atol=1e-6)
        for i in range(bucketed.num_layers):
            np.testing.assert_allclose(bucketed.keys[i][0], full.keys[i][0], atol=1e-6)
            np.testing.assert_allclose(bucketed.values[i][0], full.values[i][0], atol=1e-6)


def test_near_ties_are_reported_and_real_differences_fail():
    import numpy as np
    import torch

    from snapcompile.reference.policy import Selection
    from snapcompile.validate.parity import compare_selection
    scores = torch.tensor([[float("-inf"), 0.5, 0.5 + 1e-8, 0.1, 0.9, float("-inf")]])
    reference = [Selection(torch.tensor([[0, 2, 4, 5]]), scores)]
    tie, _ = compare_selection([np.array([[0, 1, 4, 5]])], reference, tie_gap=1e-6)
    assert len(tie) == 1 and tie[0]["kept_by_backend"] == [1] and tie[0]["score_gap"] < 1e-6
    _, mismatch = compare_selection([np.array([[0, 3, 4, 5]])], reference, tie_gap=1e-6)
    assert len(mismatch) == 1 and mismatch[0]["score_gap"] == pytest.approx(0.4, abs=1e-6)
    assert compare_selection([np.array([[0, 2, 4, 5]])], reference, 1e-6) == ([], [])


@pytest.mark.parametrize("policy", [
    None,
    PolicyConfig(policy="snapstream", budget=64, sinks=4, window=8, kernel=5),
    PolicyConfig(policy="snapstream", budget=48, sinks=2, window=8, kernel=3, scope="layer", prompt_share=40),
    PolicyConfig(policy="streamingllm", budget=64, sinks=4, window=8),
], ids=["dense", "snap-b64", "snap-b48-layer", "streaming-b64"])
def test_resumed_turns_parity(tiny_llama, tmp_path, policy):
    """Three turns, each resumed from the kept cache (re-selected), against the oracle's multi-turn
    policy; a long and a short first turn."""
    folder = build_artifact(tiny_llama, tmp_path / "art", policy=policy)
    reports = Validator(folder, tiny_llama.model).run_turns(random_prompts([150, 20], seed=3), 40, 3,
                                                            random_prompts([30], seed=9)[0])
    summary = summarize(reports, 40)
    assert summary["resumed_tokens"] == [0, 190, 261, 0, 60, 131]
    assert not summary["selection_mismatches"]
    assert summary["max_abs_logit_diff"] <= 1e-4 and summary["greedy_agreement"] == 1.0


def test_validation_reports_each_prefill_and_decode_step_as_it_goes(tiny_llama, tiny_snap_dir):
    """progress(units, what) after every prompt's prefill and every decode step, adding up to
    `work`, in one-prompt batches (5 prompts over the artifact's slots) and in turns."""
    validator = Validator(tiny_snap_dir, tiny_llama.model)
    seen = []
    prompts = random_prompts([20] * (validator.backend.slots + 1), seed=5)
    validator.run(prompts, 3, progress=lambda units, what: seen.append((units, what)))
    assert sum(units for units, _ in seen) == validator.work(len(prompts), 3) == len(prompts) + 2 * 3
    assert seen[0][1] == "prefilled a 20-token prompt" and seen[-1][1] == "decode step 3 of 3"
    seen.clear()
    reports = validator.run_turns(prompts[:1], 8, 2, random_prompts([10], seed=6)[0],
                                  progress=lambda units, what: seen.append((units, what)))
    assert summarize(reports, 8)["max_abs_logit_diff"] <= 1e-4      # a short second turn: nothing selected
    assert sum(units for units, _ in seen) == validator.work(1, 8, turns=2) == 2 * 9
    assert seen[0][1] == "turn 1: prefilled 20 tokens" and seen[9][1].startswith("turn 2: prefilled")


@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_gemma3_snapstream_compresses_its_global_layers_and_keeps_local_window_rings(tmp_path, weights):
    """Gemma 3's local layers hold a ring of their window (40 rows of sliding window + a 64-token chunk
    here) whatever the policy; SnapStream selects and rings only the global layer. Prompts 7x the
    window, past the rings' wrap, decode past the budget: equal to the oracle (transformers' Gemma 3,
    its local layers on their window, the global one under the policy)."""
    import dataclasses

    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.validate.parity import oracle_model
    from tests.conftest import TINY_EXPORT
    loaded = load_model("tiny-gemma3")
    policy = PolicyConfig(policy="snapstream", budget=64, sinks=4, window=8, kernel=5)
    export = dataclasses.replace(TINY_EXPORT, weight_format=weights)
    folder = build_artifact(loaded, tmp_path / "gemma3", export=export, policy=policy)
    manifest = read_manifest(folder)
    assert manifest.window_ring.rows == 40 + 64 and manifest.layer_rows(0) == 104 and manifest.layer_rows(1) == 64
    assert manifest.kv_bytes_by_layer_kind() == {"global": 64 * 2 * 2 * 16 * 4, "local": 104 * 2 * 2 * 16 * 4}
    oracle = oracle_model(folder, manifest)
    summary = _validate(folder, oracle, random_prompts([300, 20], seed=5), steps=64)
    assert summary["greedy_agreement"] == 1.0 and summary["compressed_prompts"] == 1
    assert summary["max_abs_logit_diff"] <= (1e-4 if weights == "fp32" else 5e-3)


def test_gemma3_prefill_orders_agree(tmp_path):
    """The chunk-by-chunk prefill (every layer a chunk at a time: the static graphs' order, TensorRT's)
    writes the local layers' rings as the layer-by-layer one does: the same logits and slot rows."""
    import numpy as np

    from snapcompile.runtime import open_backend
    loaded = load_model("tiny-gemma3")
    policy = PolicyConfig(policy="snapstream", budget=64, sinks=4, window=8, kernel=5)
    folder = build_artifact(loaded, tmp_path / "gemma3", policy=policy)
    prompt = random_prompts([300], seed=6)[0]
    results = []
    for order in (None, "chunks"):
        backend = open_backend(folder, "ort", prefill_order=order)
        result = backend.prefill(1, prompt)
        results.append((result.logits, backend.slot_rows(1)))
    (first, rows_a), (second, rows_b) = results
    assert np.abs(first - second).max() <= 1e-4
    for (ka, va), (kb, vb) in zip(rows_a, rows_b):
        assert np.abs(ka - kb).max() <= 1e-4 and np.abs(va - vb).max() <= 1e-4
