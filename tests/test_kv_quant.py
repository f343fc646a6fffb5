"""Low-precision cache rows (sessions/kv_quant.py): KIVI-style groups, no model."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snapcompile.sessions.kv_quant import GROUP, KEY_AXIS, VALUE_AXIS, QuantizedRows, quantize_rows


def _rows(shape, seed=0, outlier_channel=None):
    rows = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    if outlier_channel is not None:
        rows[:, :, outlier_channel] *= 30
    return rows


def _group_ranges(rows, axis):
    """Per element, the range (max - min) of the GROUP-group it falls in along `axis`."""
    ranges = np.empty_like(rows)
    for start in range(0, rows.shape[axis], GROUP):
        part = [slice(None)] * 3
        part[axis] = slice(start, start + GROUP)
        group = rows[tuple(part)]
        ranges[tuple(part)] = group.max(axis=axis, keepdims=True) - group.min(axis=axis, keepdims=True)
    return ranges


@settings(max_examples=30, deadline=None)
@given(hkv=st.integers(1, 3), n=st.integers(1, 80), dim=st.integers(1, 70), bits=st.sampled_from([4, 8]),
       axis=st.sampled_from([KEY_AXIS, VALUE_AXIS]), seed=st.integers(0, 1000))
def test_every_value_comes_back_within_half_a_step_of_its_group(hkv, n, dim, bits, axis, seed):
    rows = _rows((hkv, n, dim), seed)
    held = quantize_rows(rows, bits, axis)
    back = held.dequantize()
    step = _group_ranges(rows, axis) / (2 ** bits - 1)
    # float16 minimum and step: a relative error of 2^-11 of the group's range on top
    assert back.shape == rows.shape and back.dtype == np.float32
    assert np.all(np.abs(back - rows) <= step / 2 + (2 ** bits) * 2 ** -11 * step + 1e-3 * np.abs(rows).max())
    np.testing.assert_array_equal(held.dequantize(min(n, 5)), back[:, :5])


def test_keys_are_grouped_per_channel_so_an_outlier_channel_costs_only_itself():
    """Rotated keys have a few large channels: grouped along rows (per channel), the other
    channels keep their own small range; grouped along dimensions they would share the outlier's."""
    keys = _rows((2, 96, 64), outlier_channel=3)
    per_channel = np.abs(quantize_rows(keys, 4, KEY_AXIS).dequantize() - keys)
    per_row = np.abs(quantize_rows(keys, 4, VALUE_AXIS).dequantize() - keys)
    quiet = [c for c in range(64) if c != 3]
    assert per_channel[:, :, quiet].mean() < per_row[:, :, quiet].mean() / 3


def test_bytes_are_the_bits_and_a_minimum_and_step_per_group():
    rows = _rows((3, 4 * GROUP, 64))
    for bits in (4, 8):
        for axis in (KEY_AXIS, VALUE_AXIS):
            held = quantize_rows(rows, bits, axis)
            groups = rows.size // GROUP
            assert held.nbytes == rows.size * bits // 8 + groups * 2 * 2
    assert quantize_rows(rows, 4, KEY_AXIS).nbytes < rows.nbytes / 6


def test_held_rows_are_read_only_and_bad_arguments_refused():
    held = quantize_rows(_rows((1, 40, 8)), 4, KEY_AXIS)
    assert isinstance(held, QuantizedRows)
    with pytest.raises(ValueError, match="read-only"):
        held.codes[0, 0, 0] = 1
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_rows(_rows((1, 4, 8)), 3, KEY_AXIS)


def test_a_constant_group_comes_back_exactly():
    rows = np.full((1, 40, 33), 2.5, np.float32)
    for axis in (KEY_AXIS, VALUE_AXIS):
        np.testing.assert_array_equal(quantize_rows(rows, 4, axis).dequantize(), rows)
