"""The Triton decode-attention kernel vs the PyTorch reference (Triton's interpreter on CPU)."""
import pytest
import torch

from snapcompile.plugins import torch_ops, triton_kernels  # triton is a dev dependency: no silent skip


def _case(slots, kv_heads, group, budget, dim, dtype, wrapped, seed=0):
    gen = torch.Generator().manual_seed(seed)
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)
    query = rand(slots, kv_heads, group, dim)
    key, value = rand(slots, kv_heads, 1, dim), rand(slots, kv_heads, 1, dim)
    key_cache, value_cache = rand(slots, kv_heads, budget, dim), rand(slots, kv_heads, budget, dim)
    if wrapped:      # ring full: every row valid, one being overwritten
        cache_len = torch.full((slots,), budget, dtype=torch.int64)
        write_index = torch.randint(budget // 2, budget, (slots,), generator=gen)
    else:            # filling up: rows [0, cache_len) valid, the write goes right after them
        cache_len = torch.randint(0, budget, (slots,), generator=gen)
        write_index = cache_len.clone()
    return query, key, value, key_cache, value_cache, write_index, cache_len


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("budget", [16, 100, 256])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("wrapped", [False, True])
def test_kernel_matches_reference(dtype, atol, budget, group, wrapped):
    args = _case(3, 2, group, budget, 64, dtype, wrapped, seed=budget + group)
    expected = torch_ops.decode_attention(*args, scale=0.125)
    got = triton_kernels.decode_attention(*args, scale=0.125)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


def test_idle_slot_attends_only_to_itself():
    args = list(_case(2, 1, 2, 16, 16, torch.float32, False))
    args[6] = torch.tensor([0, 5])     # slot 0 idle
    got = triton_kernels.decode_attention(*args, scale=0.25)
    torch.testing.assert_close(got[0], args[2][0].expand(1, 2, 16))


@pytest.mark.parametrize("length, group, window", [(100, 3, 8), (257, 1, 16), (64, 4, 4)])
def test_window_scores_kernel_matches_reference(length, group, window):
    from snapcompile.reference.policy import window_scores
    gen = torch.Generator().manual_seed(length)
    query = torch.randn(2 * group, window, 32, generator=gen)
    keys = torch.randn(2, length, 32, generator=gen)
    got = triton_kernels.window_scores(query, keys, 0.2)
    torch.testing.assert_close(got, window_scores(query, keys, 0.2), atol=1e-6, rtol=1e-4)


def test_selection_with_the_triton_scorer_equals_reference():
    from snapcompile.config import PolicyConfig
    from snapcompile.reference.policy import snapkv_select
    policy = PolicyConfig(budget=48, window=8, kernel=5)
    gen = torch.Generator().manual_seed(1)
    query, keys = torch.randn(6, 8, 32, generator=gen) * 2, torch.randn(2, 300, 32, generator=gen) * 2
    expected = snapkv_select(query, keys, policy, 0.2).indices
    got = snapkv_select(query, keys, policy, 0.2, scorer=triton_kernels.window_scores).indices
    assert torch.equal(got, expected)
