"""Turns evaluation records into a summary, a Markdown table and PNG plots."""
from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from snapcompile.atomic import save_figure_atomic

SURE_MARGIN = 0.1   # dense answered "surely" when every answer token beat the runner-up by this much
LONG_GENERATION = ("agreement", "kl", "agreement_past_budget", "first_divergence", "recall", "dense_recall")


def _median_of(group: list[dict], name: str) -> float | None:
    values = [r[name] for r in group if r.get(name) is not None]
    return float(statistics.median(values)) if values else None


def _mean_of(group: list[dict], name: str) -> float | None:
    """The mean of a fidelity measure over the records that have it (None if none has)."""
    values = [r[name] for r in group if r.get(name) is not None]
    return sum(values) / len(values) if values else None


def _label(row: dict) -> str:
    if row["policy"] == "dense":
        return "dense"
    if row.get("ratio"):
        return f"{row['policy']} B=L/{row['ratio']}"
    return f"{row['policy']} B={row['budget']}"


def _case_key(record: dict) -> tuple:
    return record["length"], record["depth"], record.get("sample", 0)


def summarize(records: list[dict], task: str, ratios=()) -> list[dict]:
    """One row per (policy, budget, length): accuracy for retrieval, agreement/KL for fidelity.

    A budget equal to length // r for one of `ratios` is labelled by its ratio (row["ratio"]).
    """
    groups = defaultdict(list)
    for r in records:
        groups[(r["policy"], r["budget"], r["length"])].append(r)
    rows = []
    for (policy, budget, length), group in sorted(groups.items(), key=lambda kv: (kv[0][0] != "dense", kv[0][0],
                                                                                   kv[0][1] or 0, kv[0][2])):
        ratio = next((q for q in ratios if budget is not None and length // q == budget), None)
        row = {"policy": policy, "budget": budget, "length": length, "ratio": ratio, "cases": len(group)}
        if task == "fidelity":
            row.update({name: _mean_of(group, name) for name in LONG_GENERATION})
            row["first_divergence"] = _median_of(group, "first_divergence")
            row["generated"] = max(r.get("generated") or 0 for r in group)
        else:
            row["accuracy"] = sum(r["correct"] for r in group) / len(group)
        rows.append(row)
    if task != "fidelity":
        _add_retention(rows, groups)
    return rows


def _add_retention(rows: list[dict], groups: dict) -> None:
    """retained_vs_dense: accuracy / dense accuracy at the same length (None where dense got
    nothing right). kept_of_dense_correct: of the cases dense answered correctly, the share this
    row answered correctly too (paired by case; None without such cases). kept_of_dense_sure: the
    same over the cases dense answered with an answer margin >= SURE_MARGIN (dense_sure of them;
    None when the records carry no margins)."""
    dense = {r["length"]: r["accuracy"] for r in rows if r["policy"] == "dense"}
    for r in rows:
        base = dense.get(r["length"])
        r["retained_vs_dense"] = r["accuracy"] / base if base else None
        dense_cases = groups.get(("dense", None, r["length"]), [])
        mine = groups[(r["policy"], r["budget"], r["length"])]
        r["kept_of_dense_correct"] = _kept(mine, {_case_key(c) for c in dense_cases if c["correct"]})
        if any("answer_margin" in c for c in dense_cases):
            sure = {_case_key(c) for c in dense_cases if (c.get("answer_margin") or 0) >= SURE_MARGIN}
            r["dense_sure"], r["kept_of_dense_sure"] = len(sure), _kept(mine, sure)


def _kept(records: list[dict], keys: set) -> float | None:
    """The share of `records` whose case is in `keys` that are correct (None if there are none)."""
    paired = [c for c in records if _case_key(c) in keys]
    return sum(c["correct"] for c in paired) / len(paired) if paired else None


def lost_cases(records: list[dict]) -> list[dict]:
    """Cases dense answered correctly that a compressed policy got wrong, with both answers and
    dense's answer margin (how close dense itself came to answering otherwise)."""
    dense = {_case_key(r): r for r in records if r["policy"] == "dense" and r["correct"]}
    lost = []
    for r in records:
        right = dense.get(_case_key(r))
        if r["policy"] != "dense" and right and not r["correct"]:
            lost.append({"policy": r["policy"], "budget": r["budget"], "case": r["id"].split("/", 1)[1],
                         "answer": r["answer"], "dense_text": right["text"], "text": r["text"],
                         "dense_margin": right.get("answer_margin")})
    return sorted(lost, key=lambda c: (c["policy"], c["budget"], c["case"]))


def _percent(value) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def heading(config) -> str:
    """The line above an evaluation's tables: what was evaluated (model, weights and their block
    size, seed, SnapStream's kernel and scope), so a table read alone says which artifacts it measured."""
    blocks = f" in blocks of {config.block_size}" if config.weight_format in ("int8", "int4") else ""
    cache = "" if config.kv_dtype == "float32" else f", {config.kv_dtype} KV cache"
    return (f"{config.task} on {config.source}: {config.weight_format} weights{blocks}{cache}, seed {config.seed}, "
            f"SnapStream kernel {config.kernel} scope {config.scope}, {config.slots} slots\n\n")


def markdown(rows: list[dict], task: str) -> str:
    """The results table; for retrieval tasks a second table of accuracy retained vs dense."""
    lengths = sorted({r["length"] for r in rows})
    labels = list(dict.fromkeys(_label(r) for r in rows))
    cells = {(_label(r), r["length"]): r for r in rows}
    metric = "greedy agreement / KL" if task == "fidelity" else "accuracy (cases)"
    header = " | ".join(f"{n} tokens" for n in lengths)
    lines = [f"| {task}: {metric} | {header} |", "|---|" + "---|" * len(lengths)]
    for label in labels:
        out = []
        for length in lengths:
            r = cells.get((label, length))
            if r is None:
                out.append("—")
            elif task == "fidelity":
                out.append(f"{r['agreement']:.3f} / {r['kl']:.3f}" + _budget_note(r))
            else:
                out.append(f"{100 * r['accuracy']:.0f}% ({r['cases']})" + _budget_note(r))
        lines.append(f"| {label} | " + " | ".join(out) + " |")
    if task == "fidelity":
        return "\n".join(lines) + "\n" + _long_generation_table(rows, labels, lengths, cells)
    lines += ["", f"| {task}: retained vs dense / kept of dense-correct / kept of dense-sure (sure cases) "
              f"| {header} |", "|---|" + "---|" * len(lengths)]
    for label in labels[1:] if labels and labels[0] == "dense" else labels:
        out = []
        for length in lengths:
            r = cells.get((label, length))
            out.append("—" if r is None else
                       f"{_percent(r['retained_vs_dense'])} / {_percent(r['kept_of_dense_correct'])}"
                       + (f" / {_percent(r['kept_of_dense_sure'])} ({r['dense_sure']})" if "dense_sure" in r else ""))
        lines.append(f"| {label} | " + " | ".join(out) + " |")
    if any("dense_sure" in r for r in rows):
        lines.append(f"\nDense-sure: dense answered correctly and every answer token beat the runner-up by >= "
                     f"{SURE_MARGIN} in probability.")
    return "\n".join(lines) + "\n"


def _long_generation_table(rows, labels, lengths, cells) -> str:
    """Agreement after the first B generated tokens, first divergence of the policy's own greedy
    continuation, and the recall probe (dense's in brackets); empty for records that predate them."""
    if not any(r.get("first_divergence") is not None for r in rows):
        return ""
    generated = max(r.get("generated") or 0 for r in rows)
    lines = [f"\n| fidelity, {generated} generated tokens: agreement past B / first divergence (median) / recall "
             "(dense) | "
             + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for label in labels:
        out = []
        for length in lengths:
            r = cells.get((label, length))
            out.append("—" if r is None or r["first_divergence"] is None else
                       f"{_fixed(r['agreement_past_budget'])} / {r['first_divergence']:.0f} / "
                       f"{_fixed(r['recall'])} ({_fixed(r['dense_recall'])})")
        lines.append(f"| {label} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def _fixed(value) -> str:
    return "—" if value is None else f"{value:.3f}"


def lost_markdown(lost: list[dict]) -> str:
    """A table of lost_cases() (empty string when nothing was lost)."""
    if not lost:
        return ""
    lines = ["", "Answers dense had right and a compressed policy got wrong:", "",
             "| policy | case | expected | dense answer (margin) | policy answer |", "|---|---|---|---|---|"]
    for c in lost:
        margin = "?" if c["dense_margin"] is None else f"{c['dense_margin']:.2f}"
        lines.append(f"| {c['policy']} B={c['budget']} | {c['case']} | {c['answer']} | {_cell(c['dense_text'])} "
                     f"({margin}) | {_cell(c['text'])} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """`text` fit for one Markdown table cell (one line, no column breaks, at most 48 characters)."""
    return text.replace("|", "\\|").replace("\n", " ")[:48]


def _budget_note(row: dict) -> str:
    return f", B={row['budget']}" if row.get("ratio") else ""


def plots(rows: list[dict], records: list[dict], task: str, stem: Path) -> list[Path]:
    """accuracy (or agreement) vs budget per policy and length, and vs length for the rows whose
    budget is a ratio of the length; for retrieval also vs depth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    metric = "agreement" if task == "fidelity" else "accuracy"
    written = [_budget_plot(rows, metric, stem, plt)]
    if any(r.get("ratio") for r in rows):
        written.append(_length_plot(rows, metric, stem, plt))
    if task != "fidelity":
        written.append(_depth_plot(records, stem, plt))
    return written


def _length_plot(rows: list[dict], metric: str, stem: Path, plt) -> Path:
    """`metric` vs prompt length: dense and every budget-ratio row (B = L/ratio)."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for label in dict.fromkeys(_label(r) for r in rows if r["policy"] == "dense" or r.get("ratio")):
        points = sorted((r["length"], r[metric]) for r in rows if _label(r) == label)
        style = ({"color": "gray", "linestyle": "--", "marker": "s", "markerfacecolor": "none", "zorder": 3}
                 if label == "dense" else {"marker": "o"})
        ax.plot(*zip(*points), label=label, **style)
    ax.set(xlabel="prompt tokens", ylabel=metric, ylim=(-0.05, 1.05), title=f"{metric} vs length")
    _log_ticks(ax, {r["length"] for r in rows})
    ax.legend(fontsize=7)
    return _save(fig, stem, "length", plt)


def _budget_plot(rows: list[dict], metric: str, stem: Path, plt) -> Path:
    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4 * len(lengths), 3.2), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for policy in sorted({r["policy"] for r in rows if r["policy"] != "dense"}):
            points = sorted((r["budget"], r[metric]) for r in rows if r["policy"] == policy and r["length"] == length)
            if points:
                ax.plot(*zip(*points), marker="o", label=policy)
        dense = [r[metric] for r in rows if r["policy"] == "dense" and r["length"] == length]
        if dense:
            ax.axhline(dense[0], color="gray", linestyle="--", label="dense")
        ax.set(title=f"{length} tokens", xlabel="budget B", ylabel=metric, ylim=(-0.05, 1.05))
        _log_ticks(ax, {r["budget"] for r in rows if r["budget"] and r["length"] == length})
        ax.legend(fontsize=7)
    return _save(fig, stem, "budget", plt)


def _log_ticks(ax, values) -> None:
    """A log x axis ticked at exactly `values`."""
    values = sorted(values)
    ax.set_xscale("log")
    ax.set_xticks(values, [str(v) for v in values])
    ax.minorticks_off()


def _save(fig, stem: Path, kind: str, plt) -> Path:
    fig.tight_layout()
    path = stem.with_name(f"{stem.name}-{kind}.png")
    save_figure_atomic(fig, path)
    plt.close(fig)
    return path


def _depth_plot(records: list[dict], stem: Path, plt) -> Path:
    """Accuracy vs needle depth, per policy at the budget nearest a quarter of each length."""
    series = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r["policy"] == "dense" or _nearest_quarter(records, r):
            label = "dense" if r["policy"] == "dense" else f"{r['policy']} B~L/4"
            series[label][r["depth"]].append(r["correct"])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for label, by_depth in sorted(series.items()):
        depths = sorted(by_depth)
        ax.plot(depths, [sum(by_depth[d]) / len(by_depth[d]) for d in depths], marker="o", label=label)
    ax.set(xlabel="needle depth", ylabel="accuracy", ylim=(-0.05, 1.05), title="accuracy vs depth")
    ax.legend(fontsize=7)
    return _save(fig, stem, "depth", plt)


def _nearest_quarter(records: list[dict], record: dict) -> bool:
    budgets = {r["budget"] for r in records if r["policy"] == record["policy"] and r["length"] == record["length"]}
    return record["budget"] == min(budgets, key=lambda b: abs(b - record["length"] / 4))
