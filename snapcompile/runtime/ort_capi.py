"""ONNX Runtime's C API through ctypes, for what its Python API lacks: ONNX Runtime sessions (the
graphs it runs) that share one PrepackedWeightsContainer. "Session" in this module is always ONNX
Runtime's (a kept conversation is the session store's, snapcompile.sessions).

An ONNX Runtime CPU kernel pre-packs its constant weights into its own layout when a session is
created (MatMul into MLAS's GEMM layout, MatMulNBits into its int4/int8 kernels' layout), and each
session keeps its own packed copy: with one session per graph (prefill buckets, decode slot buckets,
select, tail) memory was weights x graphs. Sessions created with one container and given the same
weights as shared initializers (`AddInitializer`) pre-pack each weight once and reuse it
(onnxruntime_c_api.h: CreateSessionFromArrayWithPrepackedWeightsContainer). The Python wheel ships
the library the C API lives in (`onnxruntime/capi/libonnxruntime.so.<version>`); this module loads
it once per process. ctypes releases the GIL for every call, so a running graph holds no Python
thread.
"""
from __future__ import annotations

import ctypes
import importlib.util
from ctypes import POINTER, c_char_p, c_int, c_int64, c_size_t, c_uint32, c_void_p
from pathlib import Path

import numpy as np

from snapcompile.errors import SnapcompileError

API_VERSION = 16
# OrtApi's members in order, up to the last one used here (the struct only ever grows at its end)
_ORDER = """CreateStatus GetErrorCode GetErrorMessage CreateEnv CreateEnvWithCustomLogger EnableTelemetryEvents
DisableTelemetryEvents CreateSession CreateSessionFromArray Run CreateSessionOptions SetOptimizedModelFilePath
CloneSessionOptions SetSessionExecutionMode EnableProfiling DisableProfiling EnableMemPattern DisableMemPattern
EnableCpuMemArena DisableCpuMemArena SetSessionLogId SetSessionLogVerbosityLevel SetSessionLogSeverityLevel
SetSessionGraphOptimizationLevel SetIntraOpNumThreads SetInterOpNumThreads CreateCustomOpDomain CustomOpDomain_Add
AddCustomOpDomain RegisterCustomOpsLibrary SessionGetInputCount SessionGetOutputCount
SessionGetOverridableInitializerCount SessionGetInputTypeInfo SessionGetOutputTypeInfo
SessionGetOverridableInitializerTypeInfo SessionGetInputName SessionGetOutputName
SessionGetOverridableInitializerName CreateRunOptions RunOptionsSetRunLogVerbosityLevel
RunOptionsSetRunLogSeverityLevel RunOptionsSetRunTag RunOptionsGetRunLogVerbosityLevel
RunOptionsGetRunLogSeverityLevel RunOptionsGetRunTag RunOptionsSetTerminate RunOptionsUnsetTerminate
CreateTensorAsOrtValue CreateTensorWithDataAsOrtValue IsTensor GetTensorMutableData FillStringTensor
GetStringTensorDataLength GetStringTensorContent CastTypeInfoToTensorInfo GetOnnxTypeFromTypeInfo
CreateTensorTypeAndShapeInfo SetTensorElementType SetDimensions GetTensorElementType GetDimensionsCount
GetDimensions GetSymbolicDimensions GetTensorShapeElementCount GetTensorTypeAndShape GetTypeInfo GetValueType
CreateMemoryInfo CreateCpuMemoryInfo CompareMemoryInfo MemoryInfoGetName MemoryInfoGetId MemoryInfoGetMemType
MemoryInfoGetType AllocatorAlloc AllocatorFree AllocatorGetInfo GetAllocatorWithDefaultOptions
AddFreeDimensionOverride GetValue GetValueCount CreateValue CreateOpaqueValue GetOpaqueValue
KernelInfoGetAttribute_float KernelInfoGetAttribute_int64 KernelInfoGetAttribute_string
KernelContext_GetInputCount KernelContext_GetOutputCount KernelContext_GetInput KernelContext_GetOutput
ReleaseEnv ReleaseStatus ReleaseMemoryInfo ReleaseSession ReleaseValue ReleaseRunOptions ReleaseTypeInfo
ReleaseTensorTypeAndShapeInfo ReleaseSessionOptions ReleaseCustomOpDomain GetDenotationFromTypeInfo
CastTypeInfoToMapTypeInfo CastTypeInfoToSequenceTypeInfo GetMapKeyType GetMapValueType GetSequenceElementType
ReleaseMapTypeInfo ReleaseSequenceTypeInfo SessionEndProfiling SessionGetModelMetadata
ModelMetadataGetProducerName ModelMetadataGetGraphName ModelMetadataGetDomain ModelMetadataGetDescription
ModelMetadataLookupCustomMetadataMap ModelMetadataGetVersion ReleaseModelMetadata CreateEnvWithGlobalThreadPools
DisablePerSessionThreads CreateThreadingOptions ReleaseThreadingOptions ModelMetadataGetCustomMetadataMapKeys
AddFreeDimensionOverrideByName GetAvailableProviders ReleaseAvailableProviders GetStringTensorElementLength
GetStringTensorElement FillStringTensorElement AddSessionConfigEntry CreateAllocator ReleaseAllocator
RunWithBinding CreateIoBinding ReleaseIoBinding BindInput BindOutput BindOutputToDevice GetBoundOutputNames
GetBoundOutputValues ClearBoundInputs ClearBoundOutputs TensorAt CreateAndRegisterAllocator SetLanguageProjection
SessionGetProfilingStartTimeNs SetGlobalIntraOpNumThreads SetGlobalInterOpNumThreads SetGlobalSpinControl
AddInitializer CreateEnvWithCustomLoggerAndGlobalThreadPools SessionOptionsAppendExecutionProvider_CUDA
SessionOptionsAppendExecutionProvider_ROCM SessionOptionsAppendExecutionProvider_OpenVINO SetGlobalDenormalAsZero
CreateArenaCfg ReleaseArenaCfg ModelMetadataGetGraphDescription SessionOptionsAppendExecutionProvider_TensorRT
SetCurrentGpuDeviceId GetCurrentGpuDeviceId KernelInfoGetAttributeArray_float KernelInfoGetAttributeArray_int64
CreateArenaCfgV2 AddRunConfigEntry CreatePrepackedWeightsContainer ReleasePrepackedWeightsContainer
CreateSessionWithPrepackedWeightsContainer CreateSessionFromArrayWithPrepackedWeightsContainer""".split()

_STATUS = c_void_p          # OrtStatus*: NULL on success
_OUT = POINTER(c_void_p)
_SIGNATURES = {             # name -> (return type, argument types), as onnxruntime_c_api.h declares them
    "GetErrorMessage": (c_char_p, [c_void_p]),
    "CreateEnvWithGlobalThreadPools": (_STATUS, [c_int, c_char_p, c_void_p, _OUT]),
    "CreateThreadingOptions": (_STATUS, [_OUT]),
    "SetGlobalIntraOpNumThreads": (_STATUS, [c_void_p, c_int]),
    "SetGlobalInterOpNumThreads": (_STATUS, [c_void_p, c_int]),
    "DisablePerSessionThreads": (_STATUS, [c_void_p]),
    "CreateSessionOptions": (_STATUS, [_OUT]),
    "SetSessionGraphOptimizationLevel": (_STATUS, [c_void_p, c_int]),
    "SetSessionLogSeverityLevel": (_STATUS, [c_void_p, c_int]),
    "AddSessionConfigEntry": (_STATUS, [c_void_p, c_char_p, c_char_p]),
    "AddInitializer": (_STATUS, [c_void_p, c_char_p, c_void_p]),
    "CreateCpuMemoryInfo": (_STATUS, [c_int, c_int, _OUT]),
    "CreateTensorWithDataAsOrtValue": (_STATUS, [c_void_p, c_void_p, c_size_t, POINTER(c_int64), c_size_t, c_int,
                                                 _OUT]),
    "CreatePrepackedWeightsContainer": (_STATUS, [_OUT]),
    "CreateAndRegisterAllocator": (_STATUS, [c_void_p, c_void_p, c_void_p]),
    "CreateSessionFromArrayWithPrepackedWeightsContainer": (_STATUS, [c_void_p, c_char_p, c_size_t, c_void_p,
                                                                      c_void_p, _OUT]),
    "CreateIoBinding": (_STATUS, [c_void_p, _OUT]),
    "BindInput": (_STATUS, [c_void_p, c_char_p, c_void_p]),
    "BindOutput": (_STATUS, [c_void_p, c_char_p, c_void_p]),
    "RunWithBinding": (_STATUS, [c_void_p, c_void_p, c_void_p]),
    **{f"Release{kind}": (None, [c_void_p]) for kind in
       ("Status", "SessionOptions", "Value", "Session", "IoBinding", "PrepackedWeightsContainer", "MemoryInfo",
        "ThreadingOptions")},
}
_ELEMENT_TYPES = {np.dtype(np.float32): 1, np.dtype(np.uint8): 2, np.dtype(np.int8): 3, np.dtype(np.int32): 6,
                  np.dtype(np.int64): 7, np.dtype(np.bool_): 9, np.dtype(np.float16): 10}
_ORT_ENABLE_ALL, _LOG_FATAL = 99, 4


class _OrtApiBase(ctypes.Structure):
    _fields_ = [("GetApi", c_void_p), ("GetVersionString", c_void_p)]


class OrtCApi:
    """The library's function table, with each function this module calls typed."""

    def __init__(self, library: Path):
        lib = ctypes.CDLL(str(library))
        lib.OrtGetApiBase.restype = POINTER(_OrtApiBase)
        base = lib.OrtGetApiBase().contents
        table = ctypes.CFUNCTYPE(c_void_p, c_uint32)(base.GetApi)(API_VERSION)
        if not table:
            raise SnapcompileError(f"{library} does not offer ONNX Runtime C API version {API_VERSION}")
        pointers = ctypes.cast(table, POINTER(c_void_p))
        for name, (restype, argtypes) in _SIGNATURES.items():
            setattr(self, name, ctypes.CFUNCTYPE(restype, *argtypes)(pointers[_ORDER.index(name)]))

    def check(self, status, what: str) -> None:
        """Raise SnapcompileError with ONNX Runtime's message when `status` is not NULL."""
        if status:
            message = self.GetErrorMessage(status).decode(errors="replace")
            self.ReleaseStatus(status)
            raise SnapcompileError(f"ONNX Runtime: {what}: {message.splitlines()[0] if message else 'failed'}")

    def new(self, function: str, *args, what: str) -> int:
        """Call a C API constructor whose last argument is the object it creates; return that object."""
        out = c_void_p()
        self.check(getattr(self, function)(*args, ctypes.byref(out)), what)
        return out.value


_API: OrtCApi | None = None


def c_api() -> OrtCApi:
    """The process's one OrtCApi over the library of the installed onnxruntime wheel."""
    global _API
    if _API is None:
        # found, not imported: the Python module is ~23 MiB of RSS this process does not use
        spec = importlib.util.find_spec("onnxruntime")
        if spec is None or not spec.submodule_search_locations:
            raise SnapcompileError("onnxruntime is not installed (bash scripts/setup.sh installs it)")
        folder = Path(spec.submodule_search_locations[0]) / "capi"
        found = sorted(folder.glob("libonnxruntime.so*"))
        if not found:
            raise SnapcompileError(f"the onnxruntime wheel at {folder} ships no libonnxruntime.so (its C API); "
                                   "reinstall onnxruntime from PyPI")
        _API = OrtCApi(found[-1])
    return _API


class TensorValues:
    """OrtValues over numpy arrays (no copy). Each array is kept alive as long as this object: an
    OrtValue only points at it."""

    def __init__(self):
        self.api = c_api()
        self.memory = self.api.new("CreateCpuMemoryInfo", 0, 0, what="CPU memory info")   # device allocator, default
        self._kept: list = []

    def value(self, array: np.ndarray, keep: bool = False) -> int:
        """A new OrtValue viewing `array` (C-contiguous); the caller releases it. keep: hold a
        reference to the array for this object's life (otherwise the caller keeps it alive)."""
        if not array.flags.c_contiguous:
            raise ValueError("an OrtValue needs a C-contiguous array")
        kind = _ELEMENT_TYPES.get(array.dtype)
        if kind is None:
            raise SnapcompileError(f"no ONNX element type for numpy {array.dtype}")
        shape = (c_int64 * max(array.ndim, 1))(*array.shape)
        if keep:
            self._kept.append(array)
        return self.api.new("CreateTensorWithDataAsOrtValue", self.memory, array.ctypes.data, array.nbytes,
                            shape, array.ndim, kind, what="tensor")

    def __del__(self):
        """A value keeps its own copy of the memory info: this one can go with this object."""
        if getattr(self, "memory", None):
            self.api.ReleaseMemoryInfo(self.memory)


def release_freed_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere).

    A session pre-packs every weight it is given even when the container already holds that packed
    form (the container knows a weight by its packed bytes), then frees its own copy. glibc serves
    such buffers with mmap until the first one is freed and from the heap after (its mmap threshold
    rises to the largest freed buffer), where a freed one stays in the process: each layer graph of
    a layer-by-layer prefill, made after the whole-model graphs, left its layer's weights once more
    in RSS (0.1 GiB a layer at the 8B shape, 3.2 GiB over its 32 layers; docs/results/performance.md,
    "The 8B shape: one 32000-token prompt")."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [c_size_t], c_int
        return libc
    except (OSError, AttributeError):        # not glibc: musl, macOS
        return None


_LIBC = _glibc()


class OrtEnvironment:
    """Sessions of one process that pre-pack each shared weight once (one PrepackedWeightsContainer),
    on the CPU execution provider, and run on one pool of `threads` threads (None: one a core)."""

    def __init__(self, threads: int | None = None):
        self.api = c_api()
        self.env = self._env_with_one_thread_pool(threads)
        self.container = self.api.new("CreatePrepackedWeightsContainer", what="pre-packed weights container")
        # one CPU arena for every session (session.use_env_allocators): sessions run one at a time,
        # so the process's work space is the largest graph's, not the sum of every graph's
        arena = self.api.new("CreateCpuMemoryInfo", 1, 0, what="CPU arena memory info")
        try:       # the environment keeps its own copy of the memory info
            self.api.check(self.api.CreateAndRegisterAllocator(self.env, arena, None), "shared CPU arena")
        finally:
            self.api.ReleaseMemoryInfo(arena)
        self.values = TensorValues()
        self._initializers: dict[int, int] = {}     # id(array) -> OrtValue, one per shared array

    def _env_with_one_thread_pool(self, threads: int | None) -> int:
        """An environment whose sessions share one intra-op thread pool. With a pool a session, the
        pools of the sessions that ran last spin on their cores while the next session works: the
        layer-by-layer prefill runs a session a layer in turn. ONNX Runtime keeps one environment a
        process: a later OrtEnvironment gets the first one's pool, whatever its `threads`."""
        api = self.api
        options = api.new("CreateThreadingOptions", what="thread pool options")
        try:
            api.check(api.SetGlobalIntraOpNumThreads(options, threads or 0), "thread pool options")
            api.check(api.SetGlobalInterOpNumThreads(options, 1), "thread pool options")   # nodes run in order
            return api.new("CreateEnvWithGlobalThreadPools", _LOG_FATAL, b"snapcompile", options,
                           what="environment")
        finally:
            api.ReleaseThreadingOptions(options)

    def initializer(self, array: np.ndarray) -> int:
        """The OrtValue every session receives for `array` (the same array object, the same value)."""
        key = id(array)
        if key not in self._initializers:
            self._initializers[key] = self.values.value(array, keep=True)
        return self._initializers[key]

    def open_graph(self, model_bytes: bytes, initializers: dict[str, np.ndarray], config: dict[str, str],
                   what: str) -> BoundGraph:
        """A session on a serialized ONNX model whose external initializers are all in `initializers`
        (name -> array, shared with every other session given the same array)."""
        api = self.api
        options = api.new("CreateSessionOptions", what="session options")
        try:
            api.check(api.SetSessionGraphOptimizationLevel(options, _ORT_ENABLE_ALL), what)
            api.check(api.SetSessionLogSeverityLevel(options, _LOG_FATAL), what)
            api.check(api.DisablePerSessionThreads(options), what)      # the environment's pool
            for key, value in ({"session.use_env_allocators": "1"} | config).items():
                api.check(api.AddSessionConfigEntry(options, key.encode(), value.encode()), what)
            for name, array in initializers.items():
                api.check(api.AddInitializer(options, name.encode(), self.initializer(array)), f"{what}: {name}")
            handle = api.new("CreateSessionFromArrayWithPrepackedWeightsContainer", self.env, model_bytes,
                             len(model_bytes), options, self.container, what=what)
        finally:
            api.ReleaseSessionOptions(options)
        release_freed_heap()
        return BoundGraph(self, handle, what)

    def __del__(self):
        """Runs once every BoundGraph (each holds this object) is gone: the container and the
        shared values can go."""
        api = getattr(self, "api", None)
        if api is None:
            return
        for value in getattr(self, "_initializers", {}).values():
            api.ReleaseValue(value)
        if getattr(self, "container", None):
            api.ReleasePrepackedWeightsContainer(self.container)


class _Handle:
    """An OrtSession, released when the last BoundGraph bound to it goes."""

    def __init__(self, owner: OrtEnvironment, handle: int):
        self.owner, self.handle = owner, handle

    def __del__(self):
        self.owner.api.ReleaseSession(self.handle)


class BoundGraph:
    """An ONNX Runtime session and one IoBinding of it: inputs and outputs bound to numpy arrays by address.
    `another_binding` gives the same session with a binding of its own (graphs of one family,
    naming.ort_graphs, bound to buffers of their own sizes)."""

    def __init__(self, owner: OrtEnvironment, handle: int | _Handle, what: str):
        self.ort_session = handle if isinstance(handle, _Handle) else _Handle(owner, handle)
        self.owner, self.api, self.values, self.what = owner, owner.api, owner.values, what
        self.handle = self.ort_session.handle
        self.binding = None
        self.binding = self.api.new("CreateIoBinding", self.handle, what=what)

    def another_binding(self, what: str) -> BoundGraph:
        return BoundGraph(self.owner, self.ort_session, what)

    def __del__(self):
        if self.binding:
            self.api.ReleaseIoBinding(self.binding)

    def bind(self, name: str, array: np.ndarray, output: bool = False) -> None:
        """Bind a C-contiguous array by address (no copy; it must outlive the binding)."""
        value = self.values.value(array)
        try:
            bind = self.api.BindOutput if output else self.api.BindInput
            self.api.check(bind(self.binding, name.encode(), value), f"{self.what}: binding {name}")
        finally:
            self.api.ReleaseValue(value)        # the binding holds its own reference

    def run(self) -> None:
        self.api.check(self.api.RunWithBinding(self.handle, None, self.binding), f"running {self.what}")
