"""`snapcompile bench`: compressed vs dense static graphs vs PyTorch eager, in one process.

For each slot count N and context T, the systems are measured in turn, `repeats` times, their
order rotating between repeats; figures are medians with min/max. The systems: the compressed and
the dense artifact for each `--weights` format, PyTorch eager, and with `--peers` ONNX Runtime
GenAI builds of the model (bench/peers.py, a subprocess per measurement). Artifacts are built
once and cached: one compressed artifact per N (its cost does not depend on T) and one dense
artifact per (T, N), exported with max context T + new tokens so that the dense graph reads
exactly the context it serves.
"""
from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from snapcompile.bench import machine, measure
from snapcompile.bench.partial_points import PointStore
from snapcompile.compiler.cache import ArtifactCache
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError

SYSTEMS = ("snapstream", "dense", "eager")


def system_name(policy: str, weights: str) -> str:
    """"snapstream" / "dense" for fp32 weights, "snapstream-int4" etc. for the others."""
    return policy if weights == "fp32" else f"{policy}-{weights}"


def reference_systems(weight_formats) -> tuple[str, str]:
    """The snapstream and dense systems the main table and every ratio use: those of the first
    --weights format (fp32 unless --weights starts with another)."""
    return system_name("snapstream", weight_formats[0]), system_name("dense", weight_formats[0])


@dataclass(frozen=True)
class BenchConfig:
    source: str
    contexts: tuple[int, ...] = (1024, 2048, 4096, 8192)
    slots: tuple[int, ...] = (1, 4, 8, 16)
    budget: int = 512
    new_tokens: int = 64
    repeats: int = 3
    chunk: int = ExportConfig.chunk          # the product's own shapes (convert's default)
    eager: bool = True
    memory_limit_gib: float = 16.0       # for the "largest slot count that fits" figure
    eager_kv_limit_gib: float = 4.0      # eager points whose cache exceeds this are skipped (it is copied per step)
    prefill_repeats: int | None = None   # default: repeats
    weight_formats: tuple[str, ...] = ("fp32",)  # --weights of the snapstream and dense artifacts measured
    peers: tuple[str, ...] = ()          # ONNX Runtime GenAI precisions measured beside them

    def __post_init__(self):
        if not self.contexts or not self.slots or min(self.contexts) < 64 or min(self.slots) < 1:
            raise SnapcompileError("--contexts must be >= 64 tokens and --slots >= 1")
        if self.repeats < 1 or self.new_tokens < 2:
            raise SnapcompileError("--repeats must be >= 1 and --new-tokens >= 2")
        PolicyConfig(budget=self.budget)     # validates the budget
        if not self.weight_formats:
            raise SnapcompileError("--weights needs at least one format")
        for weight_format in self.weight_formats:
            ExportConfig(weight_format=weight_format)     # validates the format
        from snapcompile.bench.peers import PEER_PRECISIONS
        unknown = [p for p in self.peers if p not in PEER_PRECISIONS]
        if unknown:
            raise SnapcompileError(f"unknown --peers precision {unknown[0]!r}; "
                                   f"choose from {', '.join(PEER_PRECISIONS)}")

    def export(self, context: int, slots: int, weights: str = "fp32") -> ExportConfig:
        """The shapes of the artifacts measured at a context: room for the new tokens after it."""
        return ExportConfig(slots=slots, max_context=context + self.new_tokens + 1, chunk=min(self.chunk, context),
                            weight_format=weights)


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _open(folder: Path):
    """A backend whose cache pages are resident (so RSS shows what serving would hold)."""
    from snapcompile.runtime.ort_backend import OrtBackend
    backend = OrtBackend(folder)
    backend.make_graphs()                      # no timed run pays for making its graph
    for array in backend.keys + backend.values:
        array.fill(0.0)
    return backend


def run_bench(config: BenchConfig, cache_dir: Path, progress: Callable[[int], None] | None = None,
              log: Callable[[str], None] = print, store: PointStore | None = None) -> dict:
    """Measure every point of `config`; `store` (bench/partial_points.py) keeps each finished point, and
    the points it already holds, from a killed run of the same configuration, are not measured again."""
    store = store or PointStore(None, config)
    cpu = machine.cpu_description()
    bandwidth = machine.memory_read_bandwidth()
    flops = machine.matmul_flops()
    artifacts = ArtifactCache(config.source, cache_dir, log)
    compressed = PolicyConfig(budget=config.budget)
    positions = artifacts.loaded.spec.max_positions
    if max(config.contexts) + config.new_tokens + 1 > positions:
        raise SnapcompileError(f"context {max(config.contexts)} + {config.new_tokens} new tokens exceeds the "
                               f"model's {positions} positions")
    model = artifacts.loaded.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    peers = _build_peers(config, artifacts, cache_dir, log)
    step_bytes = {}
    with _attention(model, "sdpa"):        # the eager baseline runs as `generate` would
        points, prefill = _measure_points(config, artifacts, compressed, model, weight_bytes, peers, step_bytes,
                                          store, progress, log)
    for point in points:
        point["prefill"] = prefill[point["context"]]
        _add_roofline(point, config, artifacts.loaded.spec, weight_bytes, step_bytes, bandwidth, flops)
        _add_ratios(point, config.weight_formats)
    return {"config": asdict(config), "cpu": cpu, "read_bandwidth_bytes_per_s": bandwidth,
            "bandwidth_bytes_per_s": machine.memory_bandwidth(), "matmul_flops_per_s": flops,
            "weight_bytes": weight_bytes, "step_weight_bytes": step_bytes,
            "kv_bytes_per_token": artifacts.loaded.spec.kv_bytes_per_token, "points": points,
            "fits": _fits(config, artifacts.loaded.spec, weight_bytes), "resumed_points": store.resumed}


def _build_peers(config: BenchConfig, artifacts: ArtifactCache, cache_dir: Path, log) -> dict:
    """system name -> PeerModel, built from the safetensors folder of the model measured."""
    if not config.peers:
        return {}
    from snapcompile.bench.peers import PeerModel, build_peer
    folder = artifacts.loaded.folder
    if folder is None:
        raise SnapcompileError("--peers needs a model loaded from a Hugging Face folder or a built-in name")
    return {f"ortgenai-{p}": PeerModel(build_peer(folder, p, Path(cache_dir) / "peers", log)) for p in config.peers}


def _step_weight_bytes(backend, model_bytes: int) -> int:
    """Weight bytes a decode step reads: the model's float32 bytes, or for a quantized artifact
    what its graphs hold but the float16 embedding table (a step gathers a row of it)."""
    report = backend.manifest.weights_report
    return report["step_weight_bytes"] if report.get("format", "fp32") != "fp32" else model_bytes


def _measure_points(config: BenchConfig, artifacts: ArtifactCache, compressed: PolicyConfig, model,
                    model_bytes: int, peers: dict, step_bytes: dict, store: PointStore, progress,
                    log) -> tuple[list[dict], dict]:
    """Decode timings at every (slots, context) point and prefill timings per context;
    step_bytes gets each artifact system's weight bytes per step (model_bytes: the fp32 model's).
    Points the store holds are taken from it."""
    points, prefill = [], dict(store.prefill)
    dense = PolicyConfig(policy="dense")
    for slots in config.slots:
        snaps = None
        for context in config.contexts:
            done = store.points.get((slots, context))
            if done is not None:
                points.append(done["point"])
                step_bytes.update(done["step_bytes"])
            else:
                if snaps is None:
                    snaps = {system_name("snapstream", w): _open(artifacts.get(
                        config.export(max(config.contexts), slots, w), compressed)) for w in config.weight_formats}
                points.append(_measure_context(config, artifacts, dict(snaps), dense, model, model_bytes, peers,
                                               step_bytes, prefill, store, context, slots, log))
            if progress:
                progress(1)
        del snaps
    return points, prefill


def _measure_context(config: BenchConfig, artifacts: ArtifactCache, systems: dict, dense: PolicyConfig, model,
                     model_bytes: int, peers: dict, step_bytes: dict, prefill: dict, store: PointStore,
                     context: int, slots: int, log) -> dict:
    """One point (and the context's prefill timings, while no point measured them for every
    system), recorded in the store once both are done."""
    for w in config.weight_formats:
        systems[system_name("dense", w)] = _open(artifacts.get(config.export(context, slots, w), dense))
    own_bytes = {name: _step_weight_bytes(b, model_bytes) for name, b in systems.items()}
    step_bytes.update(own_bytes)
    systems.update(peers)
    eager_kv = measure.eager_kv_bytes(model, context + config.new_tokens, slots)
    if config.eager and eager_kv <= config.eager_kv_limit_gib * 2**30:
        systems["eager"] = model
    elif config.eager:
        log(f"eager skipped at context {context}, {slots} slots: {eager_kv / 2**30:.1f} GiB of KV "
            f"> --eager-kv-limit-gib {config.eager_kv_limit_gib:g}")
    point = _measure_point(config, systems, context, slots)
    measured = [n for n in systems if not n.startswith("ortgenai")]   # peers prefill whole batches
    if context not in prefill or len(prefill[context]) < len(measured):
        prefill[context] = _measure_prefill(config, systems, context)
        store.add_prefill(context, prefill[context])
    store.add_point(point, own_bytes)
    return point


@contextlib.contextmanager
def _attention(model, implementation: str):
    """Run `model` with another attention implementation, restoring its own afterwards."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def _measure_point(config: BenchConfig, systems: dict, context: int, slots: int) -> dict:
    steps = {name: [] for name in systems}
    rss = {}
    names = list(systems)
    for repeat in range(config.repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        for name in order:
            machine.reset_peak_rss()
            before = machine.rss_bytes()
            if name == "eager":
                seconds = measure.eager_decode_seconds(systems[name], context, slots, config.new_tokens, repeat)
            elif name.startswith("ortgenai"):
                seconds, rss[name] = systems[name].decode_seconds(context, slots, config.new_tokens, repeat)
                steps[name].append(statistics.median(seconds[1:]))
                continue
            else:
                seconds = measure.ort_decode_seconds(systems[name], context, slots, config.new_tokens, repeat)
            steps[name].append(statistics.median(seconds[1:]))    # the first step warms caches up
            rss[name] = max(rss.get(name, 0), machine.peak_rss_bytes() - before)
    result = {"context": context, "slots": slots, "systems": {}}
    for name, medians in steps.items():
        if name == "eager":
            kv = measure.eager_kv_bytes(systems[name], context + config.new_tokens, slots)
        elif name.startswith("ortgenai"):    # its KV buffers hold max_length rows per sequence
            kv = slots * (context + config.new_tokens + 1) * systems[name].kv_bytes_per_token
        else:
            kv = systems[name].kv_bytes_allocated()
        memory = "peak_rss_bytes" if name.startswith("ortgenai") else "peak_rss_growth_bytes"   # peers: their process
        result["systems"][name] = {"step_ms": _stats([1000 * s for s in medians]),
                                   "tokens_per_s": _stats([slots / s for s in medians]),
                                   "kv_bytes_per_slot": kv // slots, memory: rss[name]}
    return result


def _measure_prefill(config: BenchConfig, systems: dict, context: int) -> dict:
    out = {}
    for name, system in systems.items():
        if name.startswith("ortgenai"):      # it prefills the whole batch at once: not comparable
            continue
        totals, selects = [], []
        for repeat in range(config.prefill_repeats or config.repeats):
            if name == "eager":
                totals.append(measure.eager_prefill_seconds(system, context, repeat))
                selects.append(0.0)
            else:
                total, select = measure.ort_prefill_seconds(system, context, repeat)
                totals.append(total)
                selects.append(select)
        out[name] = {"seconds": _stats(totals), "selection_share": statistics.median(
            [s / t for s, t in zip(selects, totals)])}
    return out


def _add_roofline(point: dict, config: BenchConfig, spec, weight_bytes: int, step_bytes: dict, bandwidth: float,
                  flops: float) -> None:
    """Per decode step: bytes it must move (weights once + the KV rows it reads) and FLOPs it
    must do (2 per weight per sequence, plus the attention products); the roofline bound is the
    larger of bytes / read bandwidth (a step reads its weights and KV rows; it writes almost
    nothing) and FLOPs / float32 matmul throughput; fraction_of_bound = bound / measured."""
    rows = {"snapstream": min(config.budget, point["context"] + config.new_tokens),
            "dense": point["context"] + config.new_tokens + 1, "eager": point["context"] + config.new_tokens // 2}
    slots = point["slots"]
    for name, figures in point["systems"].items():
        if name.startswith("ortgenai"):
            continue
        kv_rows = rows[name.split("-")[0]]
        read = step_bytes.get(name, weight_bytes) + slots * kv_rows * spec.kv_bytes_per_token
        attention = 4 * slots * spec.num_layers * spec.num_heads * kv_rows * spec.head_dim
        step_flops = 2 * slots * weight_bytes // 4 + attention
        memory_ms, compute_ms = 1000 * read / bandwidth, 1000 * step_flops / flops
        figures.update(bytes_per_step=read, flops_per_step=step_flops, memory_bound_ms=memory_ms,
                       compute_bound_ms=compute_ms, bound_ms=max(memory_ms, compute_ms),
                       bound="memory" if memory_ms >= compute_ms else "compute")
        figures["fraction_of_bound"] = figures["bound_ms"] / figures["step_ms"]["median"]


def _add_ratios(point: dict, weight_formats) -> None:
    s = point["systems"]
    ref_snap, ref_dense = reference_systems(weight_formats)
    snap = s[ref_snap]["tokens_per_s"]["median"]
    point["ratios"] = {"snapstream_vs_dense": snap / s[ref_dense]["tokens_per_s"]["median"]}
    point["ratios"]["snapstream_vs_eager"] = (snap / s["eager"]["tokens_per_s"]["median"]) if "eager" in s else None
    if ref_dense in point.get("prefill", {}) and ref_snap in point.get("prefill", {}):
        p = point["prefill"]
        seconds = {name: p[name]["seconds"]["median"] for name in (ref_snap, ref_dense)}
        point["ratios"]["prefill_snapstream_vs_dense"] = seconds[ref_snap] / seconds[ref_dense]
    for name in (n for n in s if n.startswith("snapstream")):
        if name != ref_snap:
            point["ratios"][f"{name}_vs_{ref_snap}"] = s[name]["tokens_per_s"]["median"] / snap
        for peer in (p for p in s if p.startswith("ortgenai")):
            ours, theirs = s[name]["tokens_per_s"]["median"], s[peer]["tokens_per_s"]["median"]
            point["ratios"][f"{name}_vs_{peer}"] = ours / theirs


def _fits(config: BenchConfig, spec, weight_bytes: int) -> list[dict]:
    """Largest slot count whose KV cache fits in memory_limit minus the weights, per context."""
    free = config.memory_limit_gib * 2**30 - weight_bytes
    rows = []
    for context in config.contexts:
        dense = spec.kv_bytes_per_token * context
        snap = spec.kv_bytes_per_token * min(config.budget, context)
        rows.append({"context": context, "dense_max_slots": int(free // dense),
                     "snapstream_max_slots": int(free // snap)})
    return rows
