"""Properties of the PyTorch reference policy (the oracle every backend is checked against)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from snapcompile.config import PolicyConfig
from snapcompile.reference.oracle import ReferenceSequence
from snapcompile.reference.policy import pool_scores, snapkv_select, streaming_select, top_positions, window_scores
from tests.conftest import random_prompts


def _random_layer(heads, kv_heads, length, window, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, window, dim, generator=gen) * 2,
            torch.randn(kv_heads, length, dim, generator=gen) * 2)


@settings(max_examples=40, deadline=None)
@given(length=st.integers(40, 120), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       pooling=st.sampled_from(["max", "avg"]), scope=st.sampled_from(["head", "layer"]), seed=st.integers(0, 99))
def test_selection_invariants(length, kv_heads, group, pooling, scope, seed):
    policy = PolicyConfig(budget=32, sinks=3, window=6, kernel=5, pooling=pooling, scope=scope)
    query, keys = _random_layer(kv_heads * group, kv_heads, length, policy.window, seed=seed)
    picked = snapkv_select(query, keys, policy, 0.35).indices
    share = policy.resolved_prompt_share
    assert picked.shape == (kv_heads, share)
    for row in picked.tolist():
        assert row == sorted(set(row)), "positions unique and ascending"
        assert row[:3] == [0, 1, 2], "sinks kept"
        assert row[-6:] == list(range(length - 6, length)), "window kept"
        assert all(0 <= p < length for p in row)
    if scope == "layer":
        assert all(torch.equal(picked[0], row) for row in picked)


def test_heads_select_different_positions():
    policy = PolicyConfig(budget=32, sinks=2, window=4, kernel=3)
    query, keys = _random_layer(4, 2, 100, 4, seed=3)
    picked = snapkv_select(query, keys, policy, 0.5).indices
    assert not torch.equal(picked[0], picked[1])


def test_gqa_averaging_hand_computed():
    """Two query heads share one KV head; each head's window query looks at one position only."""
    keys = torch.zeros(1, 6, 2)
    keys[0, 1] = torch.tensor([10.0, 0.0])      # position 1 answers head 0
    keys[0, 2] = torch.tensor([0.0, 10.0])      # position 2 answers head 1
    query = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])   # [H=2, W=1, D=2]
    scores = window_scores(query, keys, scale=1.0)        # [1, T-W=5]
    e = np.exp(10.0)
    head0 = np.array([1, e, 1, 1, 1, 1]) / (e + 5)
    head1 = np.array([1, 1, e, 1, 1, 1]) / (e + 5)
    expected = ((head0 + head1) / 2)[:5]
    np.testing.assert_allclose(scores[0].numpy(), expected, rtol=1e-5)


def test_window_queries_are_causal():
    """The first window query must not see the positions after it."""
    keys = torch.zeros(1, 5, 1)
    keys[0, 4] = 100.0
    query = torch.ones(1, 2, 1)                  # window positions 3 and 4
    probs_prefix = window_scores(query, keys, 1.0)
    # query at position 3 spreads over 0..3 (key 4 hidden); query 4 puts everything on key 4
    np.testing.assert_allclose(probs_prefix[0].numpy(), [0.125, 0.125, 0.125], rtol=1e-5)


def test_pooling_semantics():
    scores = torch.tensor([[1.0, 0.0, 0.0, 4.0]])
    np.testing.assert_allclose(pool_scores(scores, 3, "max").numpy(), [[1, 1, 4, 4]])
    np.testing.assert_allclose(pool_scores(scores, 3, "avg").numpy(), [[1 / 3, 1 / 3, 4 / 3, 4 / 3]], rtol=1e-6)


def test_ties_go_to_the_lower_position():
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.5]])
    assert top_positions(scores, 3).tolist() == [[1, 3, 0]]


def test_streamingllm_keeps_sinks_and_most_recent():
    policy = PolicyConfig(policy="streamingllm", budget=16, sinks=2, window=4)
    kept = streaming_select(40, 2, policy).indices
    assert kept[0].tolist() == [0, 1] + list(range(40 - 10, 40))


@pytest.mark.parametrize("policy_name", ["snapstream", "streamingllm"])
def test_exact_with_dense_while_everything_fits(tiny_llama, policy_name):
    policy = PolicyConfig(policy=policy_name, budget=64, sinks=4, window=8, kernel=5)
    prompt = random_prompts([30])[0]
    dense = ReferenceSequence(tiny_llama.model, PolicyConfig(policy="dense"), 64)
    compressed = ReferenceSequence(tiny_llama.model, policy, 64)
    a, b = dense.feed(prompt), compressed.feed(prompt)
    for _ in range(64 - 30 - 1):                   # up to a full budget, before any wrap
        assert torch.allclose(a, b, atol=1e-5)
        token = int(a.argmax())
        a, b = dense.feed([token]), compressed.feed([token])
    assert torch.allclose(a, b, atol=1e-5)


def test_reference_dense_matches_hf_forward(tiny_llama):
    prompt = random_prompts([40], seed=5)[0]
    ref = ReferenceSequence(tiny_llama.model, PolicyConfig(policy="dense"), 80)
    logits = ref.feed(prompt)
    tokens = list(prompt)
    for _ in range(8):
        tokens.append(int(logits.argmax()))
        logits = ref.feed(tokens[-1:])
    with torch.no_grad():
        hf = tiny_llama.model(torch.tensor([tokens])).logits[0, -1]
    assert torch.allclose(logits, hf, atol=1e-4)


def test_ring_overwrites_oldest_generated_token(tiny_llama):
    policy = PolicyConfig(policy="snapstream", budget=40, sinks=2, window=4, kernel=3, prompt_share=36)
    prompt = random_prompts([60], seed=2)[0]
    ref = ReferenceSequence(tiny_llama.model, policy, 40)
    logits = ref.feed(prompt)
    cache = ref.caches[0]
    kept_keys = cache.keys[:, :36].clone()
    history = []
    for g in range(10):
        logits = ref.feed([int(logits.argmax())])
        history.append(cache.keys[:, 36 + g % 4].clone())
        assert torch.equal(cache.keys[:, :36], kept_keys), "kept prompt rows are never overwritten"
    # ring of 4 after 10 tokens holds tokens 6..9: row 36 + (g % 4)
    for g in range(6, 10):
        assert torch.equal(cache.keys[:, 36 + g % 4], history[g])


@pytest.mark.parametrize("policy", [
    PolicyConfig(policy="snapstream", budget=48, sinks=4, window=8, kernel=5),
    PolicyConfig(policy="snapstream", budget=40, sinks=2, window=16, kernel=7, scope="layer"),
    PolicyConfig(policy="streamingllm", budget=32, sinks=4, window=8),
])
def test_from_prefill_equals_running_the_prompt_under_the_policy(tiny_llama, policy):
    prompt = random_prompts([120], seed=9)[0]
    recorder = ReferenceSequence(tiny_llama.model, PolicyConfig(policy="dense"), 200, record_window=16)
    first = recorder.feed(prompt)
    started = ReferenceSequence.from_prefill(tiny_llama.model, recorder.recorded_prefill(), policy, policy.budget)
    direct = ReferenceSequence(tiny_llama.model, policy, policy.budget)
    assert torch.allclose(direct.feed(prompt), first, atol=1e-5)
    for a, b in zip(started.selections(), direct.selections()):
        assert torch.equal(a.indices, b.indices)
    token = int(first.argmax())
    for _ in range(40):                             # past the ring wrap
        a, b = started.feed([token]), direct.feed([token])
        assert torch.allclose(a, b, atol=1e-5)
        token = int(b.argmax())


def test_recorded_prefill_needs_a_recording(tiny_llama):
    sequence = ReferenceSequence(tiny_llama.model, PolicyConfig(policy="dense"), 64)
    sequence.feed(random_prompts([20])[0])
    with pytest.raises(ValueError, match="record_window"):
        sequence.recorded_prefill()
