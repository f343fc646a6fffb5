"""Block-wise weight-only quantization of linear layers (int4 / int8), and its graph form.

A matrix W [N out, K in] is held as integer values q [N, K] (int4: [-8, 7], int8: [-128, 127]),
one float32 scale per block of `block_size` consecutive inputs, and optionally one float32 offset
per block:  W[n, k] = q[n, k] * scale[n, k // bs] + offset[n, k // bs].

Offsets exist only for blocks kept from a GGUF file whose format has a block minimum (Q4_1:
w = d * u + m with u in [0, 15] is q = u - 8, scale d, offset m + 8d). Everything quantized here
from float weights is symmetric (no offset).

In the graph the values are a standard ONNX INT4 / INT8 initializer [K, N] dequantized by a
blocked DequantizeLinear (opset 21, axis 0, zero point 0) feeding MatMul: the form TensorRT's
ONNX parser takes, and the one ONNX Runtime's CPU provider fuses into its MatMulNBits kernel.
An offset adds sum_b(sum_{k in block b} x[k]) * offset[b], one small MatMul on block sums.

The graphs ONNX Runtime opens (`emit_nbits_matmul`) hold the same values in its MatMulNBits
kernel's own layout, written once by the export (`nbits_initializers`), so no process converts them.
MatMulNBits (onnxruntime contrib ops): B uint8 [N, K/bs, bs*bits/8], element k of row n in the low
nibble first (4 bits), unsigned with the default zero point 2^(bits-1); scales float32 [N, K/bs];
Y = A @ dequant(B).T. Our values are signed, so u = q + 2^(bits-1).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from snapcompile.errors import SnapcompileError
from snapcompile.graphs.builder import MICROSOFT
from snapcompile.nibbles import pack_nibbles, unpack_nibbles

ONNX_TYPE = {8: TensorProto.INT8, 4: TensorProto.INT4}


@dataclass
class BlockQuantized:
    """One matrix W [N, K] in blocks of `block_size` along K (see the module docstring).

    values int8 [N, K]; scales float32 [N, K/bs]; offsets float32 [N, K/bs] or None.
    exact_blocks / requantized_blocks: how many blocks hold a source file's own quantized values
    unchanged, and how many were quantized here from float weights."""

    values: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    bits: int
    block_size: int
    exact_blocks: int = 0
    requantized_blocks: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape

    def dequantize(self, rows: slice = slice(None)) -> np.ndarray:
        """W's `rows` (all by default) as float32 [n, K], computed as the graph's DequantizeLinear
        (+ offset) defines it."""
        values, scales = self.values[rows], self.scales[rows]
        n, k = values.shape
        w = values.reshape(n, k // self.block_size, self.block_size).astype(np.float32) * scales[:, :, None]
        if self.offsets is not None:
            w = w + self.offsets[rows][:, :, None]
        return w.reshape(n, k)

    def relative_error(self, weight: np.ndarray, rows_at_once: int = 1024) -> float:
        """||W - dequantize()|| / ||W|| (Frobenius) against the float weight W [N, K] it stands for,
        a few rows at a time (no temporary the size of an LM head)."""
        error = norm = 0.0
        for start in range(0, weight.shape[0], rows_at_once):
            rows = slice(start, start + rows_at_once)
            source = weight[rows].astype(np.float64)
            error += float(np.square(self.dequantize(rows) - source).sum())
            norm += float(np.square(source).sum())
        return (error / norm) ** 0.5 if norm else 0.0

    def nbits_initializers(self, name: str) -> list[TensorProto]:
        """`name`.nbits and .nbits_scales: the values and scales in MatMulNBits' layout
        (`emit_nbits_matmul`)."""
        n, k = self.values.shape
        unsigned = (self.values.astype(np.int16) + (1 << (self.bits - 1))).astype(np.uint8)      # [N, K]
        packed = pack_nibbles(unsigned) if self.bits == 4 else unsigned
        return [numpy_helper.from_array(packed.reshape(n, k // self.block_size, -1), f"{name}.nbits"),
                numpy_helper.from_array(np.ascontiguousarray(self.scales), f"{name}.nbits_scales")]

    def layout(self) -> QuantizedLayout:
        return QuantizedLayout(self.values.shape, self.bits, self.block_size, self.offsets is not None)

    def initializers(self, name: str) -> list[TensorProto]:
        """The `name`.qweight / .qscale (/ .qoffset) initializers `emit_matmul` reads."""
        tensors = [initializer(f"{name}.qweight", self), numpy_helper.from_array(
            np.ascontiguousarray(self.scales.T), f"{name}.qscale")]
        if self.offsets is not None:
            tensors.append(numpy_helper.from_array(np.ascontiguousarray(self.offsets.T), f"{name}.qoffset"))
        return tensors


@dataclass(frozen=True)
class QuantizedLayout:
    """What a graph needs to know of a BlockQuantized matrix once its values are written away:
    shape [N, K], bits, block size, whether it has offsets."""

    shape: tuple[int, int]
    bits: int
    block_size: int
    has_offsets: bool


QUANTIZE_CHUNK = 1 << 24   # values quantized at once: bounds the temporaries of a large matrix (an LM head)


def quantize(weight: np.ndarray, bits: int, block_size: int, name: str) -> BlockQuantized:
    """Symmetric round-to-nearest block quantization of W [N, K] float32 with ONNX Runtime's
    quantizer (onnxruntime.capi quantize_matmul_{4,8}bits, the kernel its own tools use), a few
    rows at a time (blocks never span rows), so no temporary is larger than QUANTIZE_CHUNK values."""
    n, k = weight.shape
    if k % block_size:
        raise SnapcompileError(f"--block-size {block_size} does not divide the {k} inputs of {name}; "
                               "choose a block size that divides every layer's input size")
    values = np.empty((n, k), np.int8)
    scales = np.empty((n, k // block_size), np.float32)
    step = max(1, QUANTIZE_CHUNK // k)
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        values[rows], scales[rows] = _quantize_rows(weight[rows], bits, block_size)
    return BlockQuantized(values, scales, None, bits, block_size, requantized_blocks=scales.size)


def _quantize_rows(weight: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """W [n, K] -> signed values int8 [n, K], scales float32 [n, K / block_size]."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits
    n, k = weight.shape
    blocks, per_byte = k // block_size, 8 // bits
    packed = np.zeros((n, blocks, block_size // per_byte), np.uint8)
    scales = np.zeros((n, blocks), np.float32)
    zero_points = np.zeros((n, -(-blocks // per_byte)), np.uint8)
    kernel = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    kernel(packed, np.ascontiguousarray(weight.T, np.float32), scales, zero_points, block_size, n, k, True)
    unsigned = packed.reshape(n, -1) if bits == 8 else unpack_nibbles(packed.reshape(n, -1))
    return (unsigned.astype(np.int16) - (1 << (bits - 1))).astype(np.int8), scales   # zero point 2^(bits-1)


def pack_int4(values: np.ndarray) -> bytes:
    """Signed int4 values (any shape, row-major) -> ONNX INT4 raw bytes (first value in the low
    nibble; an odd count is padded with a zero nibble)."""
    return pack_nibbles((values.reshape(-1).astype(np.int16) & 0x0F).astype(np.uint8)).tobytes()


def initializer(name: str, matrix: BlockQuantized) -> TensorProto:
    """The values as the [K, N] INT4 / INT8 initializer the DequantizeLinear reads."""
    kn = np.ascontiguousarray(matrix.values.T)
    raw = pack_int4(kn) if matrix.bits == 4 else kn.tobytes()
    return helper.make_tensor(name, ONNX_TYPE[matrix.bits], list(kn.shape), raw, raw=True)


def emit_matmul(b, x: str, name: str, matrix: QuantizedLayout, tensor) -> str:
    """x [..., K] float32 -> x @ W.T [..., N] with W held as `name`.qweight / .qscale / .qoffset
    initializers, added here to the GraphBuilder `b`; tensor(initializer_name) gives each one's
    TensorProto (called only for those b's store has not written)."""
    for part in ("qweight", "qscale") + (("qoffset",) if matrix.has_offsets else ()):
        b.tensor(f"{name}.{part}", partial(tensor, f"{name}.{part}"))
    w = b.op("DequantizeLinear", f"{name}.qweight", f"{name}.qscale", axis=0, block_size=matrix.block_size)
    y = b.op("MatMul", x, w)
    return y if not matrix.has_offsets else _add_offsets(b, x, y, name, matrix)


def _add_offsets(b, x: str, y: str, name: str, matrix: QuantizedLayout) -> str:
    """y + the blocks' offsets' share of x @ W.T: one small MatMul on x's block sums."""
    _, k = matrix.shape
    sums = b.op("ReduceSum", b.op("Reshape", x, b.const([-1, k // matrix.block_size, matrix.block_size])),
                b.const([-1]), keepdims=0)                                     # [rows, K/bs] block sums
    correction = b.op("Reshape", b.op("MatMul", sums, f"{name}.qoffset"), b.op("Shape", y))
    return b.op("Add", y, correction)


ACCURACY_LEVEL = 4    # MatMulNBits' int8 activations (ONNX Runtime's fast path); validate runs level 1


def emit_nbits_matmul(b, x: str, name: str, matrix: QuantizedLayout, tensor) -> str:
    """`emit_matmul`'s product in ONNX Runtime's form: one MatMulNBits node (com.microsoft) reading
    `name`.nbits / .nbits_scales (`BlockQuantized.nbits_initializers`), the offsets added the same way."""
    n, k = matrix.shape
    for part in ("nbits", "nbits_scales") + (("qoffset",) if matrix.has_offsets else ()):
        b.tensor(f"{name}.{part}", partial(tensor, f"{name}.{part}"))
    y = b.op("MatMulNBits", x, f"{name}.nbits", f"{name}.nbits_scales", domain=MICROSOFT, K=k, N=n,
             bits=matrix.bits, block_size=matrix.block_size, accuracy_level=ACCURACY_LEVEL)
    return y if not matrix.has_offsets else _add_offsets(b, x, y, name, matrix)
