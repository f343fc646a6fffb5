"""`snapcompile eval`: what the compression costs, measured through the compiled artifacts."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from snapcompile.cli_report import csv_option, write_report
from snapcompile.errors import SnapcompileError

DEFAULT_BUDGETS = (256, 512, 1024, 2048)


@click.command(name="eval")
@click.argument("model_or_dir")
@click.option("--task", type=click.Choice(["passkey", "multikey", "fidelity"]), default="passkey", show_default=True)
@click.option("--policies", default="dense,streamingllm,snapstream", show_default=True, callback=csv_option(str))
@click.option("--budgets", default=None, callback=csv_option(int),
              help="KV budgets; a budget >= a prompt's length compresses nothing and is skipped for it. "
                   f"[default: {','.join(map(str, DEFAULT_BUDGETS))}, or none when --ratios is given]")
@click.option("--ratios", default="", callback=csv_option(int),
              help="Compression ratios: at each length L, also evaluate budget L // ratio "
                   "(--ratios 4 is budget = context/4 at every length).")
@click.option("--lengths", default="1000,2000,4000,7500", show_default=True, callback=csv_option(int),
              help="Prompt lengths in tokens (chat template included).")
@click.option("--depths", default="0.1,0.5,0.9", show_default=True, callback=csv_option(float),
              help="Needle depths in [0, 1] (passkey, multikey).")
@click.option("--samples", default=3, show_default=True, help="Cases per (length, depth).")
@click.option("--seed", default=0, show_default=True)
@click.option("--scope", type=click.Choice(["head", "layer"]), default="head", show_default=True,
              help="SnapStream selection scope.")
@click.option("--slots", default=4, show_default=True, help="Engine slots (continuous batching).")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Where built artifacts are kept (default: $SNAPCOMPILE_CACHE/eval).")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=Path("results.json"), show_default=True,
              help="Results JSON; the Markdown table and plots are written beside it.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def eval_command(model_or_dir, task, policies, budgets, ratios, lengths, depths, samples, seed, scope, slots, cache_dir,
                 output, as_json):
    """Accuracy of dense, StreamingLLM and SnapStream artifacts on generated tasks.

    Builds (or reuses) the artifacts, runs every case through the engine, and writes OUTPUT
    (JSON), OUTPUT.md and PNG plots. Interrupted runs resume: finished cases are kept in
    OUTPUT.partial.jsonl until OUTPUT is written. A later run with a wider grid (more samples,
    depths, policies, budgets) reuses OUTPUT's cases. The same command and seed give the same table.
    """
    from tqdm import tqdm

    from snapcompile.evaluation import report
    from snapcompile.evaluation.runner import EvalConfig, partial_path, run_eval
    from snapcompile.models.loader import cache_root
    from snapcompile.atomic import check_output_file
    output = check_output_file(output, force=True)      # an existing results file is this run's to update
    unknown = set(policies) - {"dense", "streamingllm", "snapstream"}
    if unknown:
        raise SnapcompileError(f"unknown policies: {', '.join(sorted(unknown))}")
    if budgets is None:
        budgets = () if ratios else DEFAULT_BUDGETS
    config = EvalConfig(model_or_dir, task, policies, budgets, lengths, depths, samples, seed, slots=slots,
                        scope=scope, ratios=ratios)
    started = time.perf_counter()
    with tqdm(desc=f"eval {task}", unit="case", file=sys.stderr, disable=as_json) as bar:
        def progress(advance, total=None):
            if total is not None:
                bar.total = total
            bar.update(advance)
        records = run_eval(config, output, cache_dir or cache_root() / "eval", progress=progress,
                           log=lambda msg: tqdm.write(msg, file=sys.stderr))
    seconds = time.perf_counter() - started
    rows = report.summarize(records, task, config.ratios)
    lost = report.lost_cases(records) if task != "fidelity" else []
    payload = {"config": json.loads(json.dumps(config.__dict__)), "summary": rows, "lost": lost,
               "records": sorted(records, key=lambda r: r["id"]), "seconds_this_run": seconds}
    write_report(output, payload, report.markdown(rows, task) + report.lost_markdown(lost),
                 lambda stem: report.plots(rows, records, task, stem),
                 {"summary": rows, "seconds_this_run": seconds}, as_json, f"{seconds:.0f} s this run")
    partial_path(output).unlink(missing_ok=True)      # its records are in OUTPUT now
