"""K-quant and Q5_0 GGUF tensors read exactly: gguf's reader (what convert reads through,
models/tensors.gguf_values) against a decoder written here from llama.cpp's block layouts
(ggml-quants.c, dequantize_row_*: float32 arithmetic in its order), on blocks of random bytes with
finite scales; and a type snapcompile cannot read refused by name."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from snapcompile.errors import SnapcompileError
from snapcompile.models.loader import check_gguf_file
from snapcompile.models.tensors import GGUFTensors, gguf_values

T = gguf.GGMLQuantizationType
QK_K = 256


def _half(raw: np.ndarray) -> np.ndarray:
    """float16 bytes [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _scale_min_k4(scales: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 packed bytes."""
    q = scales.astype(np.uint8)
    if j < 4:
        return q[:, j] & 63, q[:, j + 4] & 63
    return (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4), (q[:, j + 4] >> 4) | ((q[:, j] >> 6) << 4)


def decode_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, qs = _half(blocks[:, 0:2]), _half(blocks[:, 2:4]), blocks[:, 4:16], blocks[:, 16:144]
    out = []
    for j in range(4):                                  # 64 values each: low then high nibbles of 32 bytes
        q = qs[:, 32 * j:32 * j + 32]
        for half, nibbles in ((0, q & 0xF), (1, q >> 4)):
            sc, m = _scale_min_k4(scales, 2 * j + half)
            out.append((d * sc.astype(np.float32))[:, None] * nibbles.astype(np.float32)
                       - (dmin * m.astype(np.float32))[:, None])
    return np.concatenate(out, axis=1)


def decode_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales = _half(blocks[:, 0:2]), _half(blocks[:, 2:4]), blocks[:, 4:16]
    qh, qs = blocks[:, 16:48], blocks[:, 48:176]
    out = []
    for j in range(4):
        q = qs[:, 32 * j:32 * j + 32]
        for half, nibbles in ((0, q & 0xF), (1, q >> 4)):
            high = ((qh >> (2 * j + half)) & 1) * 16
            sc, m = _scale_min_k4(scales, 2 * j + half)
            out.append((d * sc.astype(np.float32))[:, None] * (nibbles + high).astype(np.float32)
                       - (dmin * m.astype(np.float32))[:, None])
    return np.concatenate(out, axis=1)


def decode_q6_k(blocks: np.ndarray) -> np.ndarray:
    ql, qh, scales = blocks[:, 0:128], blocks[:, 128:192], blocks[:, 192:208].view(np.int8)
    d = _half(blocks[:, 208:210])
    out = np.empty((blocks.shape[0], QK_K), np.float32)
    for n in range(2):                                  # two halves of 128 values
        low, high, sc = ql[:, 64 * n:64 * n + 64], qh[:, 32 * n:32 * n + 32], scales[:, 8 * n:8 * n + 8]
        for part, (nib, shift) in enumerate(((low[:, :32] & 0xF, 0), (low[:, 32:] & 0xF, 2),
                                             (low[:, :32] >> 4, 4), (low[:, 32:] >> 4, 6))):
            q = (nib | (((high >> shift) & 3) << 4)).astype(np.int8) - np.int8(32)
            for l16 in range(2):                        # is = l / 16
                rows = slice(l16 * 16, l16 * 16 + 16)
                scale = (d * sc[:, l16 + 2 * part].astype(np.float32))[:, None]
                out[:, 128 * n + 32 * part + l16 * 16:128 * n + 32 * part + l16 * 16 + 16] = \
                    scale * q[:, rows].astype(np.float32)
    return out


def decode_q5_0(blocks: np.ndarray) -> np.ndarray:
    d = _half(blocks[:, 0:2])
    qh = np.ascontiguousarray(blocks[:, 2:6]).view("<u4")[:, 0]
    qs = blocks[:, 6:22]
    j = np.arange(16)
    low = (qs & 0x0F) | (((qh[:, None] >> j) << 4) & 0x10).astype(np.uint8)
    high = (qs >> 4) | ((qh[:, None] >> (j + 12)) & 0x10).astype(np.uint8)
    values = np.concatenate([low, high], axis=1).astype(np.int32) - 16
    return values.astype(np.float32) * d[:, None]


DECODERS = {T.Q4_K: decode_q4_k, T.Q5_K: decode_q5_k, T.Q6_K: decode_q6_k, T.Q5_0: decode_q5_0}
SCALE_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q5_0: (0,)}   # float16 fields, byte offsets


def random_blocks(kind, rows: int, row_length: int, seed: int) -> np.ndarray:
    """Random block bytes [rows, row bytes] of `kind`, each float16 scale field a finite value."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows * row_length // block, size), dtype=np.uint8)
    for offset in SCALE_FIELDS[kind]:
        data[:, offset:offset + 2] = rng.uniform(-0.05, 0.05, (len(data), 1)).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def _write(path, tensors: dict) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for name, (kind, data) in tensors.items():           # data: block bytes [rows, row bytes]
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", list(DECODERS), ids=lambda k: k.name)
def test_a_k_quant_tensor_reads_as_llama_cpp_decodes_it(kind, tmp_path):
    rows, row_length = 6, 2 * QK_K
    data = random_blocks(kind, rows, row_length, seed=kind.value)
    _write(tmp_path / "k.gguf", {"blk.0.ffn_down.weight": (kind, data)})
    check_gguf_file(tmp_path / "k.gguf")
    tensor = GGUFTensors(tmp_path / "k.gguf").by_name["model.layers.0.mlp.down_proj.weight"]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    expected = DECODERS[kind](data.reshape(-1, size)).reshape(rows, row_length)
    got = gguf_values(tensor).reshape(rows, row_length)
    assert np.isfinite(expected).all() and np.array_equal(got, expected)


@pytest.mark.parametrize("kind", [T.Q8_K, T.I32, T.Q1_0], ids=lambda k: k.name)
def test_a_type_snapcompile_cannot_read_is_refused_by_name(kind, tmp_path):
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = np.zeros((1, size * 2), np.uint8)
    _write(tmp_path / "bad.gguf", {"blk.0.ffn_down.weight": (kind, data)})
    with pytest.raises(SnapcompileError, match=f"tensor blk.0.ffn_down.weight is of type {kind.name}, which "
                                               "snapcompile cannot read \\(it reads F32, F16, Q4_0"):
        check_gguf_file(tmp_path / "bad.gguf")
