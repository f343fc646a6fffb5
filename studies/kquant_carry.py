"""What carrying a K-quant GGUF's weights into an artifact costs: SmolLM2-135M's GGUF re-encoded as a
llama.cpp "Q4_K_M"-like mixture (Q4_K and Q6_K where a row holds whole 256-value super-blocks, Q5_0
elsewhere, as llama.cpp falls back for rows of 576), written as a new GGUF, converted as any GGUF is.

    .venv/bin/python studies/kquant_carry.py OUT_DIR

Writes OUT_DIR/smollm2-kquant.gguf and prints the tensor types, the re-encoding's own relative error
against the original file's values (what llama.cpp's quantizer would cost, roughly: these encoders
are plain round-to-nearest, not its searched scales), and the commands that convert the file and
validate the artifacts (convert prints the carry's per-tensor error, validate the greedy agreement
with the float model of the K-quant file itself). The encoders write llama.cpp's block layouts
(ggml-common.h); tests check them by gguf's own decoder (studies/tests/test_kquant_carry.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

QK_K = 256


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, 256 k] -> Q4_K block bytes [n, 144 k]: 8 sub-blocks of 32 a super-block, each
    x ~ d sc q - dmin m, q in [0, 15], sc and m 6-bit, d and dmin float16."""
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(blocks.min(axis=2), 0.0)                        # [B, 8] <= 0
    scale = (blocks.max(axis=2) - low) / 15
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = (-low.min(axis=1) / 63).astype(np.float16)
    sc = _ratio(scale, d, 63)
    m = _ratio(-low, dmin, 63)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint((blocks + offset[..., None]) / np.where(step > 0, step, 1)[..., None]), 0, 15)
    q = q.astype(np.uint8)
    out = np.zeros((len(blocks), 144), np.uint8)
    out[:, 0:2] = d.reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = dmin.reshape(-1, 1).view(np.uint8)
    out[:, 4:16] = _pack_scales(sc.astype(np.uint8), m.astype(np.uint8))
    for j in range(4):
        out[:, 16 + 32 * j:48 + 32 * j] = q[:, 2 * j] | (q[:, 2 * j + 1] << 4)
    return out.reshape(x.shape[0], -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, 256 k] -> Q6_K block bytes [n, 210 k]: 16 sub-blocks of 16 a super-block, each
    x ~ d sc q, q in [-32, 31] stored + 32 (4 low bits in ql, 2 high in qh), sc int8, d float16."""
    blocks = x.reshape(-1, QK_K).astype(np.float32)
    scale = np.abs(blocks.reshape(-1, 16, 16)).max(axis=2) / 31
    d = (scale.max(axis=1) / 127).astype(np.float16)
    sc = _ratio(scale, d, 127)
    step = np.repeat(d.astype(np.float32)[:, None] * sc, 16, axis=1)
    q = (np.clip(np.rint(blocks / np.where(step > 0, step, 1)), -32, 31) + 32).astype(np.uint8)
    out = np.zeros((len(blocks), 210), np.uint8)
    for n in range(2):
        part = [q[:, 128 * n + 32 * i:128 * n + 32 * i + 32] for i in range(4)]
        out[:, 64 * n:64 * n + 32] = (part[0] & 0xF) | ((part[2] & 0xF) << 4)
        out[:, 64 * n + 32:64 * n + 64] = (part[1] & 0xF) | ((part[3] & 0xF) << 4)
        out[:, 128 + 32 * n:160 + 32 * n] = (part[0] >> 4) | ((part[1] >> 4) << 2) | ((part[2] >> 4) << 4) \
            | ((part[3] >> 4) << 6)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d.reshape(-1, 1).view(np.uint8)
    return out.reshape(x.shape[0], -1)


def _ratio(values: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """round(values / unit) in [0, top] (unit per row, float16; 0 where unit is 0), as float32."""
    unit = unit.astype(np.float32)[:, None]
    return np.clip(np.rint(values / np.where(unit > 0, unit, 1)), 0, top).astype(np.float32)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> Q4_K's 12 bytes (the inverse of llama.cpp's get_scale_min_k4)."""
    packed = np.zeros((len(sc), 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return packed


def target_type(name: str, row_length: int, layer: int):
    """llama.cpp's Q4_K_M choice, roughly: attn_v and ffn_down Q6_K in every other layer, Q4_K
    elsewhere; Q5_0 where a row is not whole super-blocks; the embedding and norms as they are."""
    import gguf
    T = gguf.GGMLQuantizationType
    if not name.startswith("blk.") or name.endswith("norm.weight"):
        return None
    if row_length % QK_K:
        return T.Q5_0
    return T.Q6_K if ("attn_v" in name or "ffn_down" in name) and layer % 2 == 0 else T.Q4_K


def rewrite(source: Path, target: Path) -> dict:
    """The GGUF `source` with its block tensors re-encoded by target_type; returns per type the
    tensor count and the re-encoding's relative error (median) against the source's values."""
    import gguf
    T = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    errors: dict[str, list[float]] = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        layer = int(tensor.name.split(".")[1]) if tensor.name.startswith("blk.") else -1
        kind = target_type(tensor.name, values.shape[-1], layer)
        if kind is None:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        encoder = {T.Q4_K: encode_q4_k, T.Q6_K: encode_q6_k}.get(kind)
        encoded = encoder(values) if encoder else gguf.quants.quantize(values, kind)
        back = gguf.quants.dequantize(encoded, kind)
        errors.setdefault(kind.name, []).append(float(np.linalg.norm(back - values) / np.linalg.norm(values)))
        writer.add_tensor(tensor.name, encoded, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {kind: {"tensors": len(e), "median_error": float(np.median(e))} for kind, e in sorted(errors.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    from snapcompile.models.loader import _smollm2_gguf
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / "smollm2-kquant.gguf"
    for kind, row in rewrite(_smollm2_gguf(), target).items():
        print(f"{kind}: {row['tensors']} tensors, re-encoding's relative error median {row['median_error']:.4f}")
    print(f"wrote {target}; then:\n  .venv/bin/snapcompile convert {target} -o {args.out}/int4 --weights int4 "
          f"--budget 512 --max-context 2048\n  .venv/bin/snapcompile validate {args.out}/int4 --json")


if __name__ == "__main__":
    main()
