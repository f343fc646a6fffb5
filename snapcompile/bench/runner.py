"""`snapcompile bench`: compressed vs dense static graphs vs PyTorch eager, in one process.

For each slot count N and context T, the three systems are measured in turn, `repeats` times,
their order rotating between repeats; figures are medians with min/max. Artifacts are built
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

from snapcompile.artifact_cache import ArtifactCache
from snapcompile.bench import machine, measure
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError

SYSTEMS = ("snapstream", "dense", "eager")


@dataclass(frozen=True)
class BenchConfig:
    source: str
    contexts: tuple[int, ...] = (1024, 2048, 4096, 8192)
    slots: tuple[int, ...] = (1, 4, 8, 16)
    budget: int = 512
    new_tokens: int = 64
    repeats: int = 3
    chunk: int = 256
    eager: bool = True
    memory_limit_gib: float = 16.0       # for the "largest slot count that fits" figure
    eager_kv_limit_gib: float = 4.0      # eager points whose cache exceeds this are skipped (it is copied per step)
    prefill_repeats: int | None = None   # default: repeats

    def __post_init__(self):
        if not self.contexts or not self.slots or min(self.contexts) < 64 or min(self.slots) < 1:
            raise SnapcompileError("--contexts must be >= 64 tokens and --slots >= 1")
        if self.repeats < 1 or self.new_tokens < 2:
            raise SnapcompileError("--repeats must be >= 1 and --new-tokens >= 2")
        PolicyConfig(budget=self.budget)     # validates the budget

    def export(self, context: int, slots: int) -> ExportConfig:
        """The shapes of the artifacts measured at a context: room for the new tokens after it."""
        return ExportConfig(slots=slots, max_context=context + self.new_tokens + 1, chunk=min(self.chunk, context))


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _open(folder: Path):
    """A backend whose cache pages are resident (so RSS shows what serving would hold)."""
    from snapcompile.runtime.ort_backend import OrtBackend
    backend = OrtBackend(folder)
    for array in backend.keys + backend.values:
        array.fill(0.0)
    return backend


def run_bench(config: BenchConfig, cache_dir: Path, progress: Callable[[int], None] | None = None,
              log: Callable[[str], None] = print) -> dict:
    bandwidth = machine.memory_bandwidth()
    flops = machine.matmul_flops()
    artifacts = ArtifactCache(config.source, cache_dir, log)
    compressed = PolicyConfig(budget=config.budget)
    positions = artifacts.loaded.spec.max_positions
    if max(config.contexts) + config.new_tokens + 1 > positions:
        raise SnapcompileError(f"context {max(config.contexts)} + {config.new_tokens} new tokens exceeds the "
                               f"model's {positions} positions")
    model = artifacts.loaded.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with _attention(model, "sdpa"):        # the eager baseline runs as `generate` would
        points, prefill = _measure_points(config, artifacts, compressed, model, progress, log)
    for point in points:
        point["prefill"] = prefill[point["context"]]
        _add_roofline(point, config, artifacts.loaded.spec, weight_bytes, bandwidth, flops)
        _add_ratios(point)
    return {"config": asdict(config), "bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops,
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": artifacts.loaded.spec.kv_bytes_per_token, "points": points,
            "fits": _fits(config, artifacts.loaded.spec, weight_bytes)}


def _measure_points(config: BenchConfig, artifacts: ArtifactCache, compressed: PolicyConfig, model, progress,
                    log) -> tuple[list[dict], dict]:
    """Decode timings at every (slots, context) point and prefill timings per context."""
    points, prefill = [], {}
    for slots in config.slots:
        snap_backend = _open(artifacts.get(config.export(max(config.contexts), slots), compressed))
        for context in config.contexts:
            dense_backend = _open(artifacts.get(config.export(context, slots), PolicyConfig(policy="dense")))
            systems = {"snapstream": snap_backend, "dense": dense_backend}
            eager_kv = measure.eager_kv_bytes(model, context + config.new_tokens, slots)
            if config.eager and eager_kv <= config.eager_kv_limit_gib * 2**30:
                systems["eager"] = model
            elif config.eager:
                log(f"eager skipped at context {context}, {slots} slots: {eager_kv / 2**30:.1f} GiB of KV "
                    f"> --eager-kv-limit-gib {config.eager_kv_limit_gib:g}")
            points.append(_measure_point(config, systems, context, slots))
            if context not in prefill or len(prefill[context]) < len(systems):
                prefill[context] = _measure_prefill(config, systems, context)
            del systems, dense_backend
            if progress:
                progress(1)
        del snap_backend
    return points, prefill


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
            else:
                seconds = measure.ort_decode_seconds(systems[name], context, slots, config.new_tokens, repeat)
            steps[name].append(statistics.median(seconds[1:]))    # the first step warms caches up
            rss[name] = max(rss.get(name, 0), machine.peak_rss_bytes() - before)
    result = {"context": context, "slots": slots, "systems": {}}
    for name, medians in steps.items():
        kv = (systems[name].kv_bytes_in_use() if name != "eager"
              else measure.eager_kv_bytes(systems[name], context + config.new_tokens, slots))
        result["systems"][name] = {"step_ms": _stats([1000 * s for s in medians]),
                                   "tokens_per_s": _stats([slots / s for s in medians]),
                                   "kv_bytes_per_slot": kv // slots, "peak_rss_growth_bytes": rss[name]}
    return result


def _measure_prefill(config: BenchConfig, systems: dict, context: int) -> dict:
    out = {}
    for name, system in systems.items():
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


def _add_roofline(point: dict, config: BenchConfig, spec, weight_bytes: int, bandwidth: float,
                  flops: float) -> None:
    """Per decode step: bytes it must move (weights once + the KV rows it reads) and FLOPs it
    must do (2 per weight per sequence, plus the attention products); the roofline bound is the
    larger of bytes / bandwidth and FLOPs / matmul throughput; fraction_of_bound = bound / measured."""
    rows = {"snapstream": min(config.budget, point["context"] + config.new_tokens),
            "dense": point["context"] + config.new_tokens + 1, "eager": point["context"] + config.new_tokens // 2}
    slots = point["slots"]
    for name, figures in point["systems"].items():
        step_bytes = weight_bytes + slots * rows[name] * spec.kv_bytes_per_token
        attention = 4 * slots * spec.num_layers * spec.num_heads * rows[name] * spec.head_dim
        step_flops = 2 * slots * weight_bytes // 4 + attention
        memory_ms, compute_ms = 1000 * step_bytes / bandwidth, 1000 * step_flops / flops
        figures.update(bytes_per_step=step_bytes, flops_per_step=step_flops, memory_bound_ms=memory_ms,
                       compute_bound_ms=compute_ms, bound_ms=max(memory_ms, compute_ms),
                       bound="memory" if memory_ms >= compute_ms else "compute")
        figures["fraction_of_bound"] = figures["bound_ms"] / figures["step_ms"]["median"]


def _add_ratios(point: dict) -> None:
    s = point["systems"]
    snap = s["snapstream"]["tokens_per_s"]["median"]
    point["ratios"] = {"snapstream_vs_dense": snap / s["dense"]["tokens_per_s"]["median"]}
    point["ratios"]["snapstream_vs_eager"] = (snap / s["eager"]["tokens_per_s"]["median"]) if "eager" in s else None
    if "dense" in point.get("prefill", {}) and "snapstream" in point.get("prefill", {}):
        p = point["prefill"]
        seconds = {name: p[name]["seconds"]["median"] for name in ("snapstream", "dense")}
        point["ratios"]["prefill_snapstream_vs_dense"] = seconds["snapstream"] / seconds["dense"]


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
