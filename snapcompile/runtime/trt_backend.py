"""TensorRT: building engines from an artifact, and the TensorRT device of the slot backend.

Every graph of an artifact has static shapes (the prefill chunk included), so each engine is
built for exactly those shapes and needs no optimization profile. Caches are CUDA tensors bound
to the execution contexts once by address. TensorRT is imported lazily; without it every entry
point fails with the extra to install.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from snapcompile.artifact.files import check_files, copy_support_files, file_sha256
from snapcompile.artifact.manifest import MANIFEST, Manifest, read_manifest
from snapcompile.atomic import atomic_directory, write_json_atomic
from snapcompile.errors import SnapcompileError
from snapcompile.plugins.trt_plugin import require_tensorrt
from snapcompile.runtime.backend import SlotBackend

ENGINES = "engines.json"


def check_trt_limits(manifest: Manifest) -> None:
    """The standard lowering's selection uses TopK with k = prompt share P; an int8 cache's rows are
    int8 tensors, which TensorRT takes only into DequantizeLinear."""
    from snapcompile.runtime.tensorrt_parser import TOPK_MAX, topk_fits
    if manifest.export.kv_dtype == "int8":
        raise SnapcompileError("--kv-dtype int8 is for ONNX Runtime: TensorRT takes int8 tensors only into "
                               "DequantizeLinear, and the cache's per-row scales are not built as such; convert "
                               "with --kv-dtype float16 for TensorRT")
    share = manifest.policy.resolved_prompt_share
    if "select" in manifest.graphs and manifest.lowering == "standard" and not topk_fits(share):
        raise SnapcompileError(
            f"prompt share {share} exceeds TensorRT's TopK limit of {TOPK_MAX}: "
            "convert with --lower plugin, or a smaller --budget / --prompt-share")


def check_parser_support(artifact: Path, manifest: Manifest) -> None:
    """The static check of every graph against TensorRT 10's ONNX parser support matrix
    (snapcompile.runtime.tensorrt_parser), before anything is built."""
    from snapcompile.artifact.onnx_io import load_graph
    from snapcompile.runtime.tensorrt_parser import artifact_parser_problems
    problems = artifact_parser_problems({name: load_graph(artifact, manifest, name) for name in manifest.graphs})
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SnapcompileError(f"TensorRT's ONNX parser would reject {problems[0]}{more}")


def build_engines(artifact: Path, output: Path, fp16: bool = False, force: bool = False,
                  workspace_gib: float = 4.0) -> dict:
    """Build one serialized engine per graph of `artifact` into `output` (written atomically)."""
    manifest = read_manifest(artifact)
    check_files(artifact, manifest)
    check_trt_limits(manifest)
    check_parser_support(artifact, manifest)
    trt = require_tensorrt()
    if manifest.lowering == "plugin":
        from snapcompile.plugins.trt_plugin import register
        register()
    logger = trt.Logger(trt.Logger.WARNING)
    info = {"fingerprint": manifest.fingerprint(), "fp16": fp16, "tensorrt": trt.__version__, "engines": {}}
    info["sha256"] = {}
    with atomic_directory(Path(output), force=force, marker=ENGINES) as staging:
        for name, entry in manifest.graphs.items():
            serialized = _build_one(trt, logger, Path(artifact) / entry["file"], fp16, workspace_gib)
            (staging / f"{name}.engine").write_bytes(serialized)
            info["engines"][name] = f"{name}.engine"
            info["sha256"][name] = file_sha256(staging / f"{name}.engine")
        copy_support_files(artifact, manifest, staging)
        shutil.copyfile(Path(artifact) / MANIFEST, staging / MANIFEST)
        write_json_atomic(staging / ENGINES, info)
    return info


def _build_one(trt, logger, onnx_path: Path, fp16: bool, workspace_gib: float) -> bytes:
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SnapcompileError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SnapcompileError(f"TensorRT failed to build an engine for {onnx_path}")
    return bytes(serialized)


class TrtGraph:
    """An execution context whose tensors are CUDA torch tensors bound by address."""

    def __init__(self, trt, runtime, path: Path):
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise SnapcompileError(f"{path} is not a TensorRT engine for this TensorRT/GPU")
        self.context = self.engine.create_execution_context()

    def bind(self, name: str, tensor, output: bool = False) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: binding needs a contiguous tensor")
        self.context.set_tensor_address(name, tensor.data_ptr())

    def run(self) -> None:
        import torch
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        stream.synchronize()


class TrtDevice:
    runs_ort_graphs = False          # the engines are built from the static graphs

    def __init__(self, folder: Path):
        self.trt = require_tensorrt()
        import torch
        if not torch.cuda.is_available():
            raise SnapcompileError("the TensorRT backend needs a CUDA GPU")
        self.torch, self.folder = torch, Path(folder)
        self.runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.WARNING))

    def check(self, folder: Path, manifest: Manifest) -> None:
        try:
            info = json.loads((Path(folder) / ENGINES).read_text())
        except FileNotFoundError:
            raise SnapcompileError(f"{folder} has no {ENGINES}: build engines with `snapcompile build`") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SnapcompileError(f"{folder}/{ENGINES} is corrupt: build the engines again") from None
        if not isinstance(info, dict):
            raise SnapcompileError(f"{folder}/{ENGINES} is corrupt: build the engines again")
        if info.get("fingerprint") != manifest.fingerprint():
            raise SnapcompileError(f"{folder}: the engines were built from a different artifact than {MANIFEST}")
        check_files(folder, manifest, manifest.support_files())
        for name in manifest.graphs:       # engine files are named by the graph, never by a path
            path = Path(folder) / f"{name}.engine"
            if not path.is_file() or file_sha256(path) != info.get("sha256", {}).get(name):
                raise SnapcompileError(f"{folder}/{name}.engine is missing or does not match engines.json; "
                                       "build the engines again")
        if manifest.lowering == "plugin":
            from snapcompile.plugins.trt_plugin import register
            register()
        self.engine_files = {name: f"{name}.engine" for name in manifest.graphs}

    def available_bytes(self) -> int:
        return self.torch.cuda.mem_get_info()[0]

    def zeros(self, shape, dtype: str):
        return self.torch.zeros(shape, dtype=getattr(self.torch, dtype), device="cuda")

    def graph(self, name: str, manifest: Manifest) -> TrtGraph:
        return TrtGraph(self.trt, self.runtime, self.folder / self.engine_files[name])

    def kernels(self, manifest: Manifest) -> str:
        """What multiplies the linear layers, for run summaries."""
        return f"TensorRT engines ({manifest.export.weight_format} weights; kernels chosen by TensorRT at build)"

    def upload(self, target, host: np.ndarray) -> None:
        target.copy_(self.torch.from_numpy(host))

    def download(self, tensor) -> np.ndarray:
        return tensor.cpu().numpy()

    def indices(self, host: np.ndarray):
        return self.torch.from_numpy(host).to("cuda")

    def release_pages(self) -> None:
        """Nothing to release: the engines hold their weights in GPU memory."""


class TrtBackend(SlotBackend):
    """SlotBackend on TensorRT engines built by `snapcompile build`."""

    def __init__(self, folder: Path):
        super().__init__(folder, TrtDevice(folder))
