"""PromptCache: a prompt's rows kept through every change of layout (no model needed)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from snapcompile.runtime.prompt_cache import PromptCache

HEADS, DIM, MAX_ROWS = 3, 2, 48
LAYOUTS = (8, 16, 24, 32, 48)


class HostArrays:
    """The part of a Device a PromptCache uses, on numpy arrays."""
    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, np.dtype(dtype))


@given(steps=st.lists(st.tuples(st.integers(0, 12), st.sampled_from(LAYOUTS)), min_size=1, max_size=12))
def test_live_rows_survive_every_lay_out(steps):
    """Append rows, lay them out for graphs of several sizes (growing and shrinking): each layer's
    K and V rows read back through the current views are the rows written, head by head."""
    cache = PromptCache(HostArrays(), 2, HEADS, DIM, MAX_ROWS, "float32")
    cache.reset()
    written = np.random.default_rng(0).standard_normal((2, 2, HEADS, MAX_ROWS, DIM)).astype(np.float32)
    for count, rows in steps:
        count = min(count, MAX_ROWS - cache.live)
        if cache.live + count > cache.rows:
            cache.lay_out(MAX_ROWS)
        begin, end = cache.live, cache.live + count
        for layer in range(2):
            cache.keys[layer][0, :, begin:end] = written[layer, 0, :, begin:end]
            cache.values[layer][0, :, begin:end] = written[layer, 1, :, begin:end]
        cache.filled_to(end)
        if rows >= cache.live:
            cache.lay_out(rows)
        assert cache.keys[0].shape == (1, HEADS, cache.rows, DIM)
        for layer in range(2):
            np.testing.assert_array_equal(cache.keys[layer][0, :, :end], written[layer, 0, :, :end])
            np.testing.assert_array_equal(cache.values[layer][0, :, :end], written[layer, 1, :, :end])


def test_views_of_every_size_share_one_buffer_per_layer():
    cache = PromptCache(HostArrays(), 1, HEADS, DIM, MAX_ROWS, "float32")
    small_keys, _ = cache.view(16)
    cache.lay_out(16)
    cache.keys[0][0, 2, 5] = 7.0                 # head 2, row 5 of the 16-row layout
    assert small_keys[0][0, 2, 5, 0] == 7.0
    assert np.shares_memory(small_keys[0], cache.view(MAX_ROWS)[0][0])


def test_a_layout_smaller_than_the_live_rows_is_refused():
    cache = PromptCache(HostArrays(), 1, HEADS, DIM, MAX_ROWS, "float32")
    cache.filled_to(20)
    with pytest.raises(ValueError, match="20 live rows"):
        cache.lay_out(16)
    cache.truncate(10)
    cache.lay_out(16)
    assert cache.rows == 16
