"""`snapcompile eval`: what the compression costs, measured through the compiled artifacts."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from snapcompile.cli.options import config_default, csv_option, kernel_option, report_options
from snapcompile.cli.reports import write_report
from snapcompile.config import KV_DTYPES, POLICIES, SCOPES, WEIGHT_FORMATS, ExportConfig
from snapcompile.errors import SnapcompileError
from snapcompile.evaluation.config import EvalConfig
from snapcompile.evaluation.tasks import TASKS

DEFAULT_BUDGETS = (256, 512, 1024, 2048)


@click.command(name="eval")
@click.argument("model_or_dir")
@click.option("--task", type=click.Choice(TASKS), default="passkey", show_default=True)
@click.option("--policies", default=",".join(POLICIES), show_default=True, callback=csv_option(str))
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
@click.option("--scope", type=click.Choice(SCOPES), default="head", show_default=True,
              help="SnapStream selection scope.")
@kernel_option()
@click.option("--slots", default=config_default(ExportConfig, "slots"), show_default=True,
              help="Engine slots (continuous batching).")
@click.option("--weights", type=click.Choice(WEIGHT_FORMATS), default=config_default(ExportConfig, "weight_format"),
              show_default=True, help="Weights of every artifact evaluated: fp32, fp16, int8 or int4 (fidelity "
              "compares them with the fp32 dense model).")
@click.option("--block-size", default=config_default(ExportConfig, "block_size"), show_default=True,
              help="int8 / int4: inputs per quantization block (as convert's; GGUF blocks are kept only at 32).")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default=config_default(ExportConfig, "kv_dtype"),
              show_default=True, help="KV cache of every artifact evaluated (as convert's; fidelity compares "
              "with the float32 dense model).")
@click.option("--generate", default=config_default(EvalConfig, "generate"), show_default=True,
              type=click.IntRange(min=48), help="fidelity: greedy tokens generated per case. Past the budget the "
              "ring wraps: the report adds the agreement after the first B tokens, where each policy's own "
              "continuation first leaves dense's, and a recall probe on the model's own early text.")
@report_options("results.json", "eval", "Results JSON; the Markdown table and plots are written beside it. "
                "An existing results file of the same model, task and seed is resumed and widened.")
def eval_command(model_or_dir, task, policies, budgets, ratios, lengths, depths, samples, seed, scope, kernel, slots,
                 weights, block_size, kv_dtype, generate, cache_dir, output, as_json):
    """Accuracy of dense, StreamingLLM and SnapStream artifacts on generated tasks.

    Builds (or reuses) the artifacts, runs every case through the engine, and writes OUTPUT
    (JSON), OUTPUT.md and PNG plots. Interrupted runs resume: finished cases are kept in
    OUTPUT.partial.jsonl until OUTPUT is written. A later run with a wider grid (more samples,
    depths, policies, budgets) reuses OUTPUT's cases. The same command and seed give the same table.
    """
    from tqdm import tqdm

    from snapcompile.atomic import check_output_file
    from snapcompile.cli import progress_bar
    from snapcompile.evaluation import report
    from snapcompile.evaluation.partial_results import partial_path
    from snapcompile.evaluation.runner import run_eval
    from snapcompile.models.loader import cache_root
    output = check_output_file(output, force=True,      # an existing results file is this run's to update
                               read_folders=(Path(model_or_dir),))
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SnapcompileError(f"unknown policies: {', '.join(sorted(unknown))}")
    if budgets is None:
        budgets = () if ratios else DEFAULT_BUDGETS
    config = EvalConfig(model_or_dir, task, policies, budgets, lengths, depths, samples, seed, slots=slots,
                        scope=scope, kernel=kernel, ratios=ratios, weight_format=weights, block_size=block_size,
                        kv_dtype=kv_dtype, generate=generate)
    started = time.perf_counter()
    with progress_bar(desc=f"eval {task}", unit="case", disable=as_json) as bar:
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
    write_report(output, payload, report.heading(config) + report.markdown(rows, task) + report.lost_markdown(lost),
                 lambda stem: report.plots(rows, records, task, stem),
                 {"summary": rows, "seconds_this_run": seconds}, as_json, f"{seconds:.0f} s this run")
    partial_path(output).unlink(missing_ok=True)      # its records are in OUTPUT now
