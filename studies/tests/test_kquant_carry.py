"""studies/kquant_carry.py's encoders write llama.cpp's block layouts: gguf's own decoder reads
their blocks back to values within a round-to-nearest step of the input."""
import gguf
import numpy as np
import pytest

from studies.kquant_carry import encode_q4_k, encode_q6_k

T = gguf.GGMLQuantizationType


@pytest.mark.study
@pytest.mark.parametrize("encode, kind, bound", [(encode_q4_k, T.Q4_K, 0.09), (encode_q6_k, T.Q6_K, 0.025)])
def test_encoded_blocks_decode_back_close_to_the_input(encode, kind, bound):
    x = np.random.default_rng(1).standard_normal((5, 768)).astype(np.float32)
    x[0] = np.abs(x[0])                      # a row with no negative value (Q4_K's min is then 0)
    blocks = encode(x)
    assert blocks.shape == (5, 3 * gguf.GGML_QUANT_SIZES[kind][1])
    back = gguf.quants.dequantize(blocks, kind)
    assert np.linalg.norm(back - x) / np.linalg.norm(x) < bound
    assert np.abs(back - x).max() < 0.2 * np.abs(x).max()
