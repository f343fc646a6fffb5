"""The ONNX Runtime form of an artifact's graphs: every weight a shared array, each quantized linear
layer one MatMulNBits node.

The artifact's graphs are standard ONNX (a quantized layer is a blocked DequantizeLinear of an INT4 /
INT8 [K, N] initializer feeding MatMul: the form TensorRT parses). ONNX Runtime's CPU provider fuses
that pair into its MatMulNBits kernel itself, but the fused weights are new initializers of each
session, so no two sessions could share them. Here the pair is replaced before the session is
created by a MatMulNBits node (com.microsoft) whose weights, in its layout, are arrays computed once
per process and given to every session as shared initializers, so that one PrepackedWeightsContainer
(runtime/ort_capi.py) pre-packs each of them once. Float weights are views of the memory-mapped
weights.bin. `validate` runs this form against the PyTorch oracle like any other.

MatMulNBits (onnxruntime contrib ops): B uint8 [N, K/bs, bs*bits/8], element k of row n in the low
nibble first (4 bits), unsigned with the default zero point 2^(bits-1); scales float32 [N, K/bs];
Y = A @ dequant(B).T. Our values are signed two's complement, so u = q + 2^(bits-1).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, helper, numpy_helper

from snapcompile.artifact.manifest import WEIGHTS
from snapcompile.nibbles import pack_nibbles, unpack_nibbles

_QUANT_TYPES = {TensorProto.INT4: 4, TensorProto.INT8: 8}


class WeightArrays:
    """An artifact's weights as numpy arrays, each made once per process: float initializers are
    views of weights.bin (memory-mapped), quantized ones are converted to MatMulNBits' layout."""

    def __init__(self, folder: Path, spill_folder: Path | None = None):
        """spill_folder: where converted weights are written (an unlinked file, gone with the
        process) so that their pages, like weights.bin's, can leave memory once pre-packed; None
        keeps them in memory."""
        self.path = Path(folder) / WEIGHTS
        self._blob: np.memmap | None = None
        self._arrays: dict[tuple, np.ndarray] = {}
        self._spill_folder = spill_folder
        self._spill = None                      # the open unlinked file
        self._spilled: list[np.memmap] = []
        self._lock = threading.Lock()           # the spill file and the arrays, for prefetch_nbits' threads

    def raw(self, tensor: TensorProto) -> np.ndarray:
        """The bytes of an external initializer, viewed in weights.bin (uint8)."""
        self._map_weights()
        info = external_data_helper.ExternalDataInfo(tensor)
        offset = info.offset or 0
        return self._blob[offset:offset + info.length]

    def _map_weights(self) -> None:
        if self._blob is None:
            self._blob = np.memmap(self.path, dtype=np.uint8, mode="r")

    def float_array(self, tensor: TensorProto) -> np.ndarray:
        """A float initializer: a view of weights.bin, or its own array when the graph holds it."""
        key = ("float", tensor.name, tuple(tensor.dims))
        if key not in self._arrays:
            if tensor.data_location != TensorProto.EXTERNAL:
                self._arrays[key] = numpy_helper.to_array(tensor)
            else:
                dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
                self._arrays[key] = self.raw(tensor).view(dtype).reshape(tuple(tensor.dims))
        return self._arrays[key]

    def nbits_weight(self, tensor: TensorProto, block_size: int) -> np.ndarray:
        """qweight INT4/INT8 [K, N] -> MatMulNBits B uint8 [N, K/bs, bs*bits/8]."""
        bits, (k, n) = _QUANT_TYPES[tensor.data_type], tensor.dims
        # by its stored bytes, unless the graph holds it (small) or rows share a byte (odd N)
        stored = tensor.data_location == TensorProto.EXTERNAL and (bits == 8 or n % 2 == 0)
        return self._converted(("nbits", tensor.name, block_size), tensor, lambda: (
            stored_nbits_layout(self.raw(tensor), k, n, bits, block_size) if stored
            else nbits_layout(self._signed_values(tensor), bits, block_size)))

    def prefetch_nbits(self, weights: list[tuple[TensorProto, int]]) -> None:
        """nbits_weight of each (tensor, block_size) not converted yet, on every core at once
        (up to 4 threads: numpy's copies and XORs release the GIL). One core's conversion set a
        model's first session time (the 8B shape's weights: 23 s)."""
        todo = {("nbits", tensor.name, block): (tensor, block) for tensor, block in weights}
        todo = [pair for key, pair in todo.items() if key not in self._arrays]
        if not todo:
            return
        self._map_weights()                     # once, before the threads read it
        with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
            for _ in pool.map(lambda pair: self.nbits_weight(*pair), todo):
                pass

    def _converted(self, key: tuple, tensor: TensorProto, convert) -> np.ndarray:
        """convert()'s array for `tensor`, made once and file-backed; the source's pages of
        weights.bin, read once, may then go."""
        if key not in self._arrays:
            array = convert()
            with self._lock:
                self._arrays[key] = self._file_backed(array)
                if tensor.data_location == TensorProto.EXTERNAL:
                    info = external_data_helper.ExternalDataInfo(tensor)
                    self._drop(self._blob, info.offset or 0, info.length)
        return self._arrays[key]

    def _file_backed(self, array: np.ndarray) -> np.ndarray:
        """`array`'s values in a read-only mapping of the spill file (or `array` without one)."""
        if self._spill_folder is None:
            return array
        import tempfile
        try:
            if self._spill is None:
                self._spill_folder.mkdir(parents=True, exist_ok=True)
                self._spill = tempfile.TemporaryFile(dir=self._spill_folder)
            offset = self._spill.seek(0, 2)
            self._spill.write(np.ascontiguousarray(array).data)
            self._spill.flush()
        except OSError:              # read-only or full disk: keep this one in memory (correct, larger)
            return array
        mapped = np.memmap(self._spill, dtype=array.dtype, mode="r", offset=offset, shape=array.shape)
        self._spilled.append(mapped)
        return mapped

    def _signed_values(self, tensor: TensorProto) -> np.ndarray:
        """An INT4 / INT8 initializer's values as int8 [K, N]."""
        if tensor.data_location != TensorProto.EXTERNAL:
            return numpy_helper.to_array(tensor).astype(np.int8)
        raw = self.raw(tensor)
        if tensor.data_type == TensorProto.INT8:
            return raw.view(np.int8).reshape(tuple(tensor.dims))
        values = unpack_nibbles(raw).astype(np.int8)         # ONNX INT4: two a byte, low nibble first
        values = np.where(values > 7, values - 16, values).astype(np.int8)
        k, n = tensor.dims
        return values[:k * n].reshape(k, n)

    def float32_weight(self, tensor: TensorProto) -> np.ndarray:
        """A float16 initializer of weights.bin in float32 (its values exactly), file-backed like
        the converted quantized weights."""
        return self._converted(("float32", tensor.name), tensor, lambda: self.float_array(tensor).astype(np.float32))

    def transposed_scales(self, tensor: TensorProto) -> np.ndarray:
        """qscale [K/bs, N] -> MatMulNBits scales [N, K/bs] (float32)."""
        key = ("scales", tensor.name)
        if key not in self._arrays:
            self._arrays[key] = np.ascontiguousarray(self.float_array(tensor).T)
        return self._arrays[key]

    def drop_resident_pages(self) -> None:
        """Let the kernel drop weights.bin's and the spill file's pages from this process's memory
        (they are read again from the file if touched: an embedding row, a weight a later session
        pre-packs)."""
        self.drop_file_pages()
        for mapped in self._spilled:
            self._drop(mapped, 0, None)

    def drop_file_pages(self) -> None:
        """Let the kernel drop weights.bin's resident pages (the only file a run reads from: the
        converted weights are read only while sessions pre-pack them): one madvise over the file
        (its cost: studies/page_release.py)."""
        if self._blob is not None:
            self._drop(self._blob, 0, None)

    @contextmanager
    def pages_released_while(self, interval_s: float = 0.05):
        """Drop the weight files' resident pages every `interval_s` seconds for the duration of the
        block, and once at its end. A session pre-packs every weight it is given, and ONNX Runtime's
        container recognises a weight only by its pre-packed bytes, so every session reads all of
        them again: without this, each session's reading of the files (GBs at 8B) sits in RSS beside
        the packed copy until the session is made. The pages are clean file pages: a page dropped
        while it is being read is read again from the page cache."""
        stop = threading.Event()

        def release():
            while not stop.wait(interval_s):
                self.drop_resident_pages()
        releaser = threading.Thread(target=release, name="weight-page-release", daemon=True)
        releaser.start()
        try:
            yield
        finally:
            stop.set()
            releaser.join()
            self.drop_resident_pages()

    @staticmethod
    def _drop(mapped: np.memmap, start: int, length: int | None) -> None:
        """MADV_DONTNEED over [start, start + length) of a read-only file mapping (None: to its end)."""
        import mmap
        begin = start // mmap.PAGESIZE * mmap.PAGESIZE
        size = len(mapped._mmap) - begin if length is None else start + length - begin
        mapped._mmap.madvise(mmap.MADV_DONTNEED, begin, size)


def stored_nbits_layout(stored: np.ndarray, k: int, n: int, bits: int, block_size: int,
                        columns: int = 128) -> np.ndarray:
    """A weight's bytes as the artifact stores it -> MatMulNBits B uint8 [N, K/bs, bs*bits/8], the
    same array as nbits_layout of its values. stored: uint8, INT8 [K, N] or INT4 [K, N] two a byte
    along N (low nibble first; N even, so no byte spans two rows). Done `columns` of N at a time: the
    transpose of a tile that stays in cache is ~15x faster than numpy's transpose of the whole
    weight (an int4 [2048, 8192] weight: 0.02 s against 0.31 s), which set a 1B model's load time."""
    flip = 0x88 if bits == 4 else 0x80       # two's complement -> + 2^(bits-1), per nibble / byte
    rows = stored.reshape(k, n // 2 if bits == 4 else n)
    out = np.empty((n, k * bits // 8), np.uint8)
    for first in range(0, n, columns):
        count = min(columns, n - first)
        if bits == 4:
            tile = rows[:, first // 2:(first + count) // 2] ^ flip
            codes = np.empty((count, k), np.uint8)            # [columns, K] unsigned codes
            codes[0::2], codes[1::2] = (tile & 0x0F).T, (tile >> 4).T
            out[first:first + count] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        else:
            out[first:first + count] = (rows[:, first:first + count] ^ flip).T
    return out.reshape(n, k // block_size, -1)


def nbits_layout(signed: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """Signed values int8 [K, N] -> unsigned [N, K/bs, bs*bits/8], element k of a row in the low
    nibble first (4 bits)."""
    k, n = signed.shape
    unsigned = np.ascontiguousarray((signed.T.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8))   # [N, K]
    if bits == 4:
        unsigned = pack_nibbles(unsigned)
    return unsigned.reshape(n, k // block_size, -1)


def ort_form(model: onnx.ModelProto, weights: WeightArrays, accuracy_level: int) -> tuple[onnx.ModelProto,
                                                                                         dict[str, np.ndarray]]:
    """A copy of `model` (loaded without its data) for ONNX Runtime, and name -> array of every
    initializer its sessions share. Each DequantizeLinear(qweight, qscale) -> MatMul pair becomes
    one MatMulNBits."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    arrays: dict[str, np.ndarray] = {}
    dequantized = {node.output[0]: node for node in graph.node if node.op_type == "DequantizeLinear"
                   and node.input[0] in initializers and initializers[node.input[0]].data_type in _QUANT_TYPES}
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    fusable = {index: dequantized[node.input[1]] for index, node in enumerate(graph.node) if node.op_type == "MatMul"
               and len(node.input) == 2 and node.input[1] in dequantized and consumers[node.input[1]] == 1}
    weights.prefetch_nbits([(initializers[source.input[0]], _block_size(source)) for source in fusable.values()])
    fused, nodes, replaced = set(), [], {}
    for index, node in enumerate(graph.node):
        source = fusable.get(index)
        half = initializers.get(node.input[1]) if node.op_type in ("MatMul", "Gemm") else None
        if half is not None and half.data_type == TensorProto.FLOAT16 and half.data_location == TensorProto.EXTERNAL:
            nodes.extend(_float32_product(node, half, weights, arrays, replaced))
            continue
        if source is None:
            nodes.append(node)
            continue
        qweight, qscale = initializers[source.input[0]], initializers[source.input[1]]
        block = _block_size(source)
        k, n = qweight.dims
        b_name, s_name = f"{qweight.name}.nbits", f"{qscale.name}.nbits"
        arrays[b_name] = weights.nbits_weight(qweight, block)
        arrays[s_name] = weights.transposed_scales(qscale)
        replaced |= {b_name: qweight.name, s_name: qscale.name}
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], b_name, s_name], list(node.output),
                                      name=node.name, domain="com.microsoft", K=k, N=n,
                                      bits=_QUANT_TYPES[qweight.data_type], block_size=block,
                                      accuracy_level=accuracy_level))
        fused.add(source.output[0])
    nodes = [node for node in nodes if not (node.op_type == "DequantizeLinear" and node.output[0] in fused)]
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in graph.node for name in node.input}
    for tensor in graph.initializer:
        if tensor.name in used and tensor.data_location == TensorProto.EXTERNAL:
            arrays[tensor.name] = weights.float_array(tensor)
    kept = [tensor for tensor in graph.initializer if tensor.name in used]
    kept += [_standing_in(name, arrays[name], initializers[source]) for name, source in replaced.items()]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if fused and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model, arrays


def _block_size(dequantize: onnx.NodeProto) -> int:
    return next(a.i for a in dequantize.attribute if a.name == "block_size")


def _float32_product(node: onnx.NodeProto, half: TensorProto, weights: WeightArrays, arrays: dict,
                     replaced: dict) -> list[onnx.NodeProto]:
    """A MatMul / Gemm of float16 activations by a float16 weight, as ONNX Runtime's CPU provider
    computes it (it has no float16 kernel for them and inserts casts to float32), but with the
    float32 weight made once per process and shared: left to the provider, each session folds the
    cast into a float32 copy of its own (a copy of every weight per graph, ~0.6 GiB a session at
    SmolLM2 in fp16). The product is float32, rounded to float16 after, as the graph defines it."""
    b_name = f"{half.name}.float32"
    arrays[b_name] = weights.float32_weight(half)
    replaced[b_name] = half.name
    activations, product = f"{node.name}.a32", f"{node.name}.y32"
    inputs = [activations, b_name] + [f"{node.name}.c32" for _ in node.input[2:3]]
    casts = [helper.make_node("Cast", [node.input[0]], [activations], name=f"{node.name}.cast_a", to=TensorProto.FLOAT)]
    casts += [helper.make_node("Cast", [c], [f"{node.name}.c32"], name=f"{node.name}.cast_c", to=TensorProto.FLOAT)
              for c in node.input[2:3]]
    product_node = onnx.NodeProto()
    product_node.CopyFrom(node)
    del product_node.input[:], product_node.output[:]
    product_node.input.extend(inputs)
    product_node.output.append(product)
    back = helper.make_node("Cast", [product], [node.output[0]], name=f"{node.name}.cast_y", to=TensorProto.FLOAT16)
    return [*casts, product_node, back]


_ONNX_TYPES = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.float32): TensorProto.FLOAT}


def _standing_in(name: str, array: np.ndarray, source: TensorProto) -> TensorProto:
    """The declaration of a shared initializer made here (`array`, converted from the weights.bin
    tensor `source`: the same byte size, or twice it for a float16 weight made float32). Its
    external data names `source`'s bytes because a model may not point at memory; the session
    never reads them, every session being given `array` itself (AddInitializer)."""
    if source.data_location != TensorProto.EXTERNAL:         # a small tensor the graph holds itself
        return numpy_helper.from_array(array, name)
    proto = TensorProto(name=name, data_type=_ONNX_TYPES[array.dtype], dims=list(array.shape))
    proto.data_location = TensorProto.EXTERNAL
    proto.external_data.extend(source.external_data)
    return proto
