"""An artifact's weight files mapped into memory, each initializer an array viewing its bytes, and
their pages let go when no run needs them resident.

ONNX Runtime's graphs (naming.ort_graphs) read their weights from weights.bin (norms, the embedding,
float linear layers) and ort_weights.bin (the forms only ONNX Runtime reads: MatMulNBits' layout,
float32 forms of float16 weights), both written by the export. Every session is given the same
arrays (ort_capi.OrtEnvironment), so each weight is pre-packed once; nothing is converted here.
"""
from __future__ import annotations

import mmap
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from snapcompile.artifact.manifest import WEIGHTS
from snapcompile.artifact.onnx_io import external_span
from snapcompile.errors import SnapcompileError


class WeightArrays:
    """An artifact's initializers as numpy arrays: external ones are read-only views of their
    memory-mapped file, each made once per process."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._maps: dict[str, np.memmap] = {}           # file name -> its mapping
        self._arrays: dict[tuple, np.ndarray] = {}
        self._lock = threading.Lock()

    def array(self, tensor: TensorProto) -> np.ndarray:
        """The initializer's values: a view of its file for external data, else its own array."""
        key = (tensor.name, tuple(tensor.dims), tensor.data_type)
        if key not in self._arrays:
            if tensor.data_location != TensorProto.EXTERNAL:
                self._arrays[key] = numpy_helper.to_array(tensor)
            else:
                location, offset, size = external_span(tensor, self.folder)
                dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
                self._arrays[key] = self._mapped(location)[offset:offset + size].view(dtype).reshape(tuple(tensor.dims))
        return self._arrays[key]

    def _mapped(self, name: str) -> np.memmap:
        """The mapping of weight file `name` (one of the artifact's two: `external_span` checked it), made once."""
        with self._lock:
            if name not in self._maps:
                if (self.folder / name).stat().st_size == 0:
                    raise SnapcompileError(f"{self.folder}: a graph reads from {name}, which is empty; refused")
                self._maps[name] = np.memmap(self.folder / name, dtype=np.uint8, mode="r")
            return self._maps[name]

    def drop_resident_pages(self) -> None:
        """Let the kernel drop both files' resident pages from this process's memory (they are read
        again from the file if touched: an embedding row, a weight a later session pre-packs)."""
        for mapped in list(self._maps.values()):
            _drop(mapped)

    def drop_file_pages(self) -> None:
        """Let the kernel drop weights.bin's resident pages (the only file a run reads from: the
        embedding rows a Gather reads; the rest is read only while sessions pre-pack it): one madvise
        over the file (its cost: studies/page_release.py)."""
        if WEIGHTS in self._maps:
            _drop(self._maps[WEIGHTS])

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


def _drop(mapped: np.memmap) -> None:
    """MADV_DONTNEED over a whole read-only file mapping."""
    if len(mapped._mmap):
        mapped._mmap.madvise(mmap.MADV_DONTNEED, 0, len(mapped._mmap))
