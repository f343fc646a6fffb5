"""`eval-ruler`'s report: scores per (weights, length, task, cell) beside dense, the samples each
compressed cell lost, the Markdown table and a plot per weight format."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from snapcompile.evaluation.ruler_margin import margin_id

ALL_TASKS = "mean"


def summarize(units: list[dict]) -> list[dict]:
    """One row per (weights, length, task, cell) and a `mean` row over the tasks: the mean score,
    its share of dense's (`retention`), and `kept_solved`: of the samples dense answered fully,
    the share this cell answered fully too (None where dense solved none)."""
    dense = _dense_samples(units)
    rows = []
    for unit in units:
        reference = dense.get((unit["weights"], unit["length"]), {})
        samples = _by_sample(unit)
        tasks = sorted({task for task, _ in samples})
        for task in [*tasks, ALL_TASKS]:
            keys = [k for k in samples if task in (ALL_TASKS, k[0])]
            rows.append(_row(unit, task, [samples[k] for k in keys], [reference[k] for k in keys if k in reference]))
    return rows


def _dense_samples(units: list[dict]) -> dict[tuple[str, int], dict]:
    """(weights, length) -> dense's samples by (task, doc_id): what every other cell is paired with."""
    return {(u["weights"], u["length"]): _by_sample(u) for u in units if u["cell"] == "dense"}


def _by_sample(unit: dict) -> dict[tuple[str, int], dict]:
    return {(s["task"], s["doc_id"]): s for s in unit["samples"]}


def _row(unit: dict, task: str, samples: list[dict], reference: list[dict]) -> dict:
    score = _mean([s["score"] for s in samples])
    dense = _mean([s["score"] for s in reference]) if len(reference) == len(samples) else None
    solved = [i for i, s in enumerate(reference) if s["score"] == 1.0] if dense is not None else []
    return {"weights": unit["weights"], "length": unit["length"], "task": task, "cell": unit["cell"],
            "policy": unit["policy"], "ratio": unit["ratio"], "budget": unit["budget"], "n": len(samples),
            "score": score, "dense": dense, "retention": score / dense if dense else None,
            "kept_solved": _mean([samples[i]["score"] == 1.0 for i in solved]) if solved else None}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def lost_samples(units: list[dict], margins: dict[str, dict] | None = None) -> list[dict]:
    """Each sample a compressed cell scored below dense on: both answers and the target, and
    `margin` (ruler_margin.margin_at: dense's own margin where the answers part) where `margins`
    has it."""
    dense = _dense_samples(units)
    lost = []
    for unit in units:
        reference = dense.get((unit["weights"], unit["length"]))
        if unit["cell"] == "dense" or reference is None:
            continue
        for key, sample in sorted(_by_sample(unit).items()):
            base = reference.get(key)
            if base is not None and sample["score"] < base["score"]:
                lost.append({"weights": unit["weights"], "length": unit["length"], "cell": unit["cell"],
                             "task": key[0], "doc_id": key[1], "score": sample["score"], "dense_score": base["score"],
                             "prediction": sample["prediction"], "dense_prediction": base["prediction"],
                             "target": sample["target"], "input_sha": sample.get("input_sha")})
                if margins and margin_id(lost[-1]) in margins:
                    lost[-1]["margin"] = margins[margin_id(lost[-1])]
    return lost


def markdown(rows: list[dict], cells: tuple[str, ...]) -> str:
    """Score per task (retention of dense's score) with a column per cell, per weights and length."""
    by_key = {(r["weights"], r["length"], r["task"], r["cell"]): r for r in rows}
    groups = sorted({(r["weights"], r["length"]) for r in rows})
    tasks = sorted({r["task"] for r in rows if r["task"] != ALL_TASKS}) + [ALL_TASKS]
    head = ["weights", "length", "task", *cells]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for weights, length in groups:
        for task in tasks:
            cols = [_cell_text(by_key.get((weights, length, task, cell))) for cell in cells]
            lines.append(f"| {weights} | {length} | {task} | " + " | ".join(cols) + " |")
    n = max((r["n"] for r in rows if r["task"] != ALL_TASKS), default=0)
    return ("\n".join(lines) + f"\n\nScore: RULER's string match (lm-eval), mean over {n} samples per task; in "
            "brackets the share of dense's score, then of the samples dense solved, the share kept.\n")


def _cell_text(row: dict | None) -> str:
    if row is None:
        return "-"
    text = f"{row['score']:.2f}"
    if row["cell"] != "dense" and row["retention"] is not None:
        text += f" ({100 * row['retention']:.0f}%"
        text += f"; {100 * row['kept_solved']:.0f}%)" if row["kept_solved"] is not None else ")"
    return text


def lost_markdown(lost: list[dict]) -> str:
    if not lost:
        return "\nNo sample scored below dense.\n"
    lines = ["\n### Samples scored below dense\n", "| weights | length | cell | task | doc | score | dense | "
             "dense's margin where they part | answer | dense's answer | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for item in lost:
        lines.append(f"| {item['weights']} | {item['length']} | {item['cell']} | {item['task']} | {item['doc_id']} | "
                     f"{item['score']:.2f} | {item['dense_score']:.2f} | {_margin_text(item.get('margin'))} | "
                     f"{_short(item['prediction'])} | {_short(item['dense_prediction'])} | "
                     f"{_short(', '.join(item['target']))} |")
    return "\n".join(lines) + ("\n\nDense's margin: p1 - p2 of dense's two likeliest tokens at the step where the "
                               "cell's answer leaves dense's (step, dense's two choices); ? where not measured.\n")


def _margin_text(margin: dict | None) -> str:
    if not margin or margin.get("dense_margin") is None:
        return "?" if not margin or margin.get("replayed", True) else "? (replay differs)"
    first, second = (_short(repr(c), 12) for c in margin["dense_choices"])
    return f"{margin['dense_margin']:.2f} (step {margin['parting_step']}: {first} / {second})"


def _short(text: str, chars: int = 60) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= chars else text[:chars - 1] + "…"


def plots(rows: list[dict], stem: Path) -> list[Path]:
    """Per weight format: a panel per task, score against compression ratio, a line per (policy,
    length), dense as a dashed line per length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from snapcompile.atomic import save_figure_atomic
    written = []
    for weights in sorted({r["weights"] for r in rows}):
        mine = [r for r in rows if r["weights"] == weights]
        tasks = sorted({r["task"] for r in mine if r["task"] != ALL_TASKS}) + [ALL_TASKS]
        fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.2), squeeze=False, sharey=True)
        for ax, task in zip(axes[0], tasks):
            _task_panel(ax, [r for r in mine if r["task"] == task], task)
        axes[0][0].set_ylabel("score")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        path = stem.with_name(f"{stem.name}-{weights}.png")
        save_figure_atomic(fig, path)
        plt.close(fig)
        written.append(path)
    return written


def _task_panel(ax, rows: list[dict], task: str) -> None:
    lines = defaultdict(list)
    colors = {length: f"C{i}" for i, length in enumerate(sorted({r["length"] for r in rows}))}
    for row in rows:
        if row["cell"] == "dense":
            ax.axhline(row["score"], linestyle="--", linewidth=1, label=f"dense {row['length']}",
                       color=colors[row["length"]])
        else:
            lines[(row["policy"], row["length"])].append((row["ratio"], row["score"]))
    for (policy, length), points in sorted(lines.items()):
        points.sort()
        color = colors[length]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if policy == "snapstream" else "s",
                linestyle="-" if policy == "snapstream" else ":", color=color, label=f"{policy} {length}")
    ax.set_title(task, fontsize=9)
    ax.set_xlabel("compression ratio (length / budget)")
    ax.set_ylim(-0.05, 1.05)
