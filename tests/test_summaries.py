"""Summaries of the dropped rows: the policy's accounting, the host sums, and the prefill pass
that lets a summary row weigh as the rows it stands for."""
import numpy as np
import onnxruntime as ort
import pytest

from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.export import build_dense_graphs
from snapcompile.graphs.attention import MASK_MIN
from snapcompile.passes.cache_bias import add_cache_bias
from snapcompile.sessions.summaries import RowSummaries

EXPORT = ExportConfig(slots=2, max_context=128, chunk=32)


def test_summaries_count_in_the_budget():
    plain, summed = PolicyConfig(budget=840), PolicyConfig(budget=840, summaries=27)
    assert (summed.slot_rows, summed.resolved_prompt_share) == (813, plain.resolved_prompt_share - 27)
    assert summed.slot_rows - summed.resolved_prompt_share == plain.slot_rows - plain.resolved_prompt_share  # ring
    assert "summaries" not in plain.to_dict() and summed.to_dict()["summaries"] == 27
    assert summed.summary_index(np.array([0, 127, 128, 10**6])).tolist() == [0, 0, 1, 26]
    with pytest.raises(SnapcompileError, match="dense drops no rows"):
        PolicyConfig(policy="dense", summaries=4)
    with pytest.raises(SnapcompileError, match="less 60 summary rows"):
        PolicyConfig(budget=96, summaries=60)
    with pytest.raises(SnapcompileError, match="--summary-segment >= 1"):
        PolicyConfig(summary_segment=0)


def test_summaries_sum_each_dropped_row_into_its_segment():
    rng = np.random.default_rng(0)
    keys, values = rng.normal(size=(2, 6, 3)).astype(np.float32), rng.normal(size=(2, 6, 3)).astype(np.float32)
    positions = np.array([[0, 1, 2, 5, 6, 9]] * 2)
    dropped = np.array([[0, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 1]], bool)
    policy = PolicyConfig(budget=64, summaries=2, summary_segment=4)      # positions 0-3, then 4 onwards
    empty = RowSummaries.empty(1, 2, 2, 3)
    summaries = RowSummaries.of_layers([empty.layer_with_dropped(policy.summary_index, 0, keys, values, positions,
                                                                 dropped)])
    assert summaries.counts[0].tolist() == [[2, 2], [0, 1]]
    np.testing.assert_allclose(summaries.key_sums[0][0, 0], keys[0, 1] + keys[0, 2], rtol=1e-6)
    np.testing.assert_allclose(summaries.value_sums[0][0, 1], values[0, 4] + values[0, 5], rtol=1e-6)
    mean_k, mean_v, bias = summaries.attended(0)
    np.testing.assert_allclose(mean_k[1, 1], keys[1, 5], rtol=1e-6)
    assert bias[0].tolist() == pytest.approx([np.log(2), np.log(2)]) and bias[1, 0] == np.float32(MASK_MIN)
    with pytest.raises(ValueError):
        summaries.counts[0][0, 0] = 5             # entries are shared by the requests that resume them


@pytest.fixture(scope="module")
def biased_prefill(tiny_llama):
    model, report = add_cache_bias(build_dense_graphs(tiny_llama, EXPORT)[0].static["prefill"], tiny_llama.spec)
    assert report["blocks_rewritten"] == tiny_llama.spec.num_layers
    return ort.InferenceSession(model.SerializeToString())


def _feeds(spec, rows: np.ndarray, bias: np.ndarray, tokens: int = 5) -> dict:
    """A chunk of `tokens` tokens at position 40 over cache rows `rows` [layers, 2 (K, V), Hkv, n, D]
    with per-row bias [Hkv, n] in every layer."""
    n, length = rows.shape[3], EXPORT.max_context
    feeds = {"input_ids": np.arange(3, 3 + EXPORT.chunk, dtype=np.int64)[None],
             "start": np.array([n]), "position": np.array([40]), "chunk_len": np.array([tokens])}
    for i in range(spec.num_layers):
        for j, name in enumerate(("past_key", "past_value")):
            cache = np.zeros((1, spec.num_kv_heads, length, spec.head_dim), np.float32)
            cache[0, :, :n] = rows[i, j]
            feeds[f"{name}.{i}"] = cache
        feeds[f"cache_bias.{i}"] = np.zeros((1, spec.num_kv_heads, length), np.float32)
        feeds[f"cache_bias.{i}"][0, :, :n] = bias
    return feeds


def test_a_row_of_logit_bias_log_n_weighs_as_n_copies_of_it(biased_prefill, tiny_llama):
    spec = tiny_llama.spec
    rows = np.random.default_rng(1).normal(size=(spec.num_layers, 2, spec.num_kv_heads, 6, spec.head_dim))
    rows = rows.astype(np.float32)
    three_copies = np.concatenate([rows, rows[:, :, :, 2:3], rows[:, :, :, 2:3]], axis=3)
    weighted = np.zeros((spec.num_kv_heads, 6), np.float32)
    weighted[:, 2] = np.log(3)
    run = lambda feeds: biased_prefill.run(["logits"], feeds)[0]               # noqa: E731
    copies = run(_feeds(spec, three_copies, np.zeros((spec.num_kv_heads, 8), np.float32)))
    np.testing.assert_allclose(run(_feeds(spec, rows, weighted)), copies, atol=1e-4)
    assert not np.allclose(run(_feeds(spec, rows, np.zeros_like(weighted))), copies, atol=1e-4)
    hidden = np.zeros_like(weighted)
    hidden[:, 2] = MASK_MIN                                                     # an empty summary: no row at all
    np.testing.assert_allclose(run(_feeds(spec, rows, hidden)), run(_feeds(spec, np.delete(rows, 2, axis=3),
                                                                           np.zeros((spec.num_kv_heads, 5)))),
                               atol=1e-4)
