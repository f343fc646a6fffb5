"""Benchmark tables (Markdown) and plots (PNG)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from snapcompile.atomic import save_figure_atomic
from snapcompile.bench.runner import reference_systems


def markdown(result: dict) -> str:
    eager = result["config"]["eager"]
    snap, dense = reference_systems(result["config"]["weight_formats"])
    head = (f"| context | slots | {snap} tok/s | {dense} tok/s | " + ("eager tok/s | " if eager else "")
            + "snap/dense | " + ("snap/eager | " if eager else "")
            + "ms/step snap (dense) | % of roofline bound snap / dense | KV/slot snap / dense | "
            + "prefill s snap / dense / eager (selection share) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in result["points"]:
        s, r = p["systems"], p["ratios"]
        cells = [str(p["context"]), str(p["slots"]), _range(s[snap]["tokens_per_s"]), _range(s[dense]["tokens_per_s"])]
        if eager:
            cells.append(_range(s["eager"]["tokens_per_s"]) if "eager" in s else "skipped (memory)")
        cells.append(f"{r['snapstream_vs_dense']:.2f}x")
        if eager:
            cells.append(f"{r['snapstream_vs_eager']:.1f}x" if r["snapstream_vs_eager"] else "—")
        cells.append(f"{s[snap]['step_ms']['median']:.1f} ({s[dense]['step_ms']['median']:.1f})")
        cells.append(f"{100 * s[snap]['fraction_of_bound']:.0f}% ({s[snap]['bound']}) / "
                     f"{100 * s[dense]['fraction_of_bound']:.0f}% ({s[dense]['bound']})")
        cells.append(f"{_mib(s[snap]['kv_bytes_per_slot'])} / {_mib(s[dense]['kv_bytes_per_slot'])}")
        pre = p["prefill"]
        eager_prefill = f" / {pre['eager']['seconds']['median']:.2f}" if "eager" in pre else ""
        cells.append(f"{pre[snap]['seconds']['median']:.2f} / {pre[dense]['seconds']['median']:.2f}"
                     f"{eager_prefill} ({100 * pre[snap]['selection_share']:.1f}%)")
        lines.append("| " + " | ".join(cells) + " |")
    lines += _formats_table(result)
    read = result.get("read_bandwidth_bytes_per_s", result["bandwidth_bytes_per_s"]) / 1e9
    bw = result["bandwidth_bytes_per_s"] / 1e9
    lines.append("")
    if "cpu" in result:
        from snapcompile.bench.machine import describe_cpu
        lines.append(f"CPU: {describe_cpu(result['cpu'])}.")
        lines.append("")
    lines.append(f"Measured in the same run: read bandwidth {read:.1f} GB/s (copy {bw:.1f} GB/s), float32 matmul "
                 f"{result['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s; float32 weights "
                 f"{result['weight_bytes'] / 2**20:.0f} MiB. Roofline bound = max(bytes read / read bandwidth, "
                 "FLOPs / float32 matmul rate), which one binds in parentheses. tok/s: median [min-max] over "
                 "repeats.")
    return "\n".join(lines) + "\n"


def _formats_table(result: dict) -> list[str]:
    """Decode tok/s of every weight format and peer side by side (when more than the reference ran)."""
    points = result["points"]
    names = [n for n in points[0]["systems"] if n != "eager"]
    if names == list(reference_systems(result["config"]["weight_formats"])):
        return []
    head = "| context x slots | " + " | ".join(f"{n} tok/s" for n in names) + " | % of roofline bound |"
    lines = ["", head, "|" + "---|" * (head.count("|") - 1)]
    for p in points:
        s = p["systems"]
        bound = ", ".join(f"{n} {100 * s[n]['fraction_of_bound']:.0f}%" for n in names if "fraction_of_bound" in s[n])
        lines.append(f"| {p['context']} x {p['slots']} | "
                     + " | ".join(f"{s[n]['tokens_per_s']['median']:.1f}" for n in names) + f" | {bound} |")
    ratios = sorted({k for p in points for k in p["ratios"] if k.startswith("snapstream-")})
    if ratios:
        head = "| context x slots | " + " | ".join(r.replace("_vs_", " / ") for r in ratios) + " |"
        lines += ["", head, "|" + "---|" * (head.count("|") - 1)]
        for p in points:
            lines.append(f"| {p['context']} x {p['slots']} | "
                         + " | ".join(f"{p['ratios'][r]:.2f}x" for r in ratios) + " |")
    return lines


def _range(stats: dict) -> str:
    return f"{stats['median']:.1f} [{stats['min']:.1f}-{stats['max']:.1f}]"


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def plots(result: dict, stem: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points = result["points"]
    slot_counts = sorted({p["slots"] for p in points})
    systems = [s for s in (*reference_systems(result["config"]["weight_formats"]), "eager")
               if any(s in p["systems"] for p in points)]
    fig, axes = plt.subplots(1, len(slot_counts), figsize=(4 * len(slot_counts), 3.2), squeeze=False)
    for ax, slots in zip(axes[0], slot_counts):
        values = []
        for name in systems:
            xs = [(p["context"], p["systems"][name]["tokens_per_s"]["median"]) for p in points
                  if p["slots"] == slots and name in p["systems"]]
            if xs:
                ax.plot(*zip(*sorted(xs)), marker="o", label=name)
                values += [y for _, y in xs]
        ax.set(title=f"{slots} slots", xlabel="context (tokens)", ylabel="decode tok/s", xscale="log", yscale="log")
        _context_ticks(ax, points)
        label_narrow_log_axis(ax, values)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [stem.with_name(stem.name + "-decode.png")]
    save_figure_atomic(fig, paths[0])
    plt.close(fig)

    fig, (mem, fit) = plt.subplots(1, 2, figsize=(9, 3.2))
    contexts = sorted({p["context"] for p in points})
    per_token = result["kv_bytes_per_token"]
    budget = result["config"]["budget"]
    mem.plot(contexts, [c * per_token / 2**20 for c in contexts], marker="o", label="dense")
    mem.plot(contexts, [min(budget, c) * per_token / 2**20 for c in contexts], marker="o",
             label=f"snapstream B={budget}")
    mem.set(xlabel="context (tokens)", ylabel="KV MiB per slot", xscale="log", yscale="log", title="KV memory per slot")
    _context_ticks(mem, points)
    label_narrow_log_axis(mem, [c * per_token / 2**20 for c in contexts])
    mem.legend(fontsize=7)
    fits = result["fits"]
    fit.plot([f["context"] for f in fits], [f["dense_max_slots"] for f in fits], marker="o", label="dense")
    fit.plot([f["context"] for f in fits], [f["snapstream_max_slots"] for f in fits], marker="o", label="snapstream")
    fit.set(xlabel="context (tokens)", ylabel="max slots", xscale="log", yscale="log",
            title=f"slots that fit in {result['config']['memory_limit_gib']:g} GiB")
    _context_ticks(fit, points)
    label_narrow_log_axis(fit, [f[key] for f in fits for key in ("dense_max_slots", "snapstream_max_slots")])
    fit.legend(fontsize=7)
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-memory.png"))
    save_figure_atomic(fig, paths[1])
    plt.close(fig)
    return paths


MAX_VALUE_TICKS = 6


def label_narrow_log_axis(ax, values: list[float]) -> None:
    """Label a log y axis that spans less than a decade (one point, or close ones), where matplotlib
    puts no labelled tick: ticks at the plotted values (at most MAX_VALUE_TICKS, spread in log space)."""
    positive = sorted({float(v) for v in values if v and v > 0})
    if not positive or positive[-1] / positive[0] >= 10:
        return
    if len(positive) > MAX_VALUE_TICKS:
        positive = [float(v) for v in np.geomspace(positive[0], positive[-1], MAX_VALUE_TICKS)]
    ax.set_yticks(positive, [f"{v:.3g}" for v in positive])
    ax.minorticks_off()


def _context_ticks(ax, points: list[dict]) -> None:
    contexts = sorted({p["context"] for p in points})
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.minorticks_off()
