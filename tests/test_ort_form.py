"""The ONNX Runtime form's weight conversion (runtime/ort_form.py): MatMulNBits' layout made from an
artifact's stored bytes, tile by tile, equals the layout made from the values."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from snapcompile.nibbles import pack_nibbles
from snapcompile.runtime.ort_form import nbits_layout, stored_nbits_layout


def stored_bytes(signed: np.ndarray, bits: int) -> np.ndarray:
    """int8 values [K, N] as the artifact stores them: INT8 bytes, or ONNX INT4 (two a byte, low
    nibble first, over the flattened tensor)."""
    if bits == 8:
        return signed.view(np.uint8).reshape(-1)
    return pack_nibbles((signed.reshape(-1) & 0x0F).astype(np.uint8))


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([4, 8]), blocks=st.integers(1, 4), block_size=st.sampled_from([16, 32, 64]),
       half_n=st.integers(1, 150), columns=st.sampled_from([2, 8, 128]), seed=st.integers(0, 2**16))
def test_the_tiled_conversion_of_stored_bytes_equals_the_conversion_of_values(bits, blocks, block_size, half_n,
                                                                             columns, seed):
    k, n = blocks * block_size, 2 * half_n - (bits == 8 and seed % 2)      # int8 may have an odd N
    low = -(1 << (bits - 1))
    signed = np.random.default_rng(seed).integers(low, -low, (k, n)).astype(np.int8)
    ours = stored_nbits_layout(stored_bytes(signed, bits), k, n, bits, block_size, columns=columns)
    expected = nbits_layout(signed, bits, block_size)
    assert ours.shape == expected.shape == (n, blocks, block_size * bits // 8)
    np.testing.assert_array_equal(ours, expected)


def test_the_layout_puts_element_k_of_row_n_in_the_low_nibble_first():
    """MatMulNBits' contract, written out for one small weight: B[n, block, byte] holds elements
    2j and 2j + 1 of column n's block, unsigned (value + 8), the first in the low nibble."""
    signed = np.array([[-8, 7], [1, -1], [0, 3], [-2, 5]], np.int8)          # [K=4, N=2]
    layout = stored_nbits_layout(stored_bytes(signed, 4), 4, 2, 4, 4)
    column0 = [(-8 + 8) | ((1 + 8) << 4), (0 + 8) | ((-2 + 8) << 4)]
    column1 = [(7 + 8) | ((-1 + 8) << 4), (3 + 8) | ((5 + 8) << 4)]
    np.testing.assert_array_equal(layout.reshape(2, 2), np.array([column0, column1], np.uint8))
