"""`snapcompile eval-ruler`: RULER's synthetic tasks through lm-evaluation-harness, against `serve`."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from snapcompile.cli.options import config_default, csv_option, kernel_option, report_options
from snapcompile.cli.reports import write_report
from snapcompile.config import KV_DTYPES, SCOPES, ExportConfig
from snapcompile.evaluation.ruler import RULER_TASKS
from snapcompile.evaluation.ruler_run import DEFAULT_CELLS, RulerConfig


@click.command(name="eval-ruler")
@click.argument("model_or_dir")
@click.option("--tasks", default=",".join(RULER_TASKS), show_default=True, callback=csv_option(str),
              help="RULER tasks of lm-eval (those whose data is made offline).")
@click.option("--lengths", default="2048,4096", show_default=True, callback=csv_option(int),
              help="RULER's max_seq_length: prompt plus answer, in tokens (>= 512; >= 1024 with ruler_vt).")
@click.option("--cells", default=",".join(DEFAULT_CELLS), show_default=True, callback=csv_option(str),
              help="What runs at each length L: 'dense', or POLICY/RATIO for POLICY at budget L // RATIO.")
@click.option("--weights", default="fp32", show_default=True, callback=csv_option(str),
              help="Weight formats (fp32, fp16, int8, int4); each gets its own artifacts and its own dense reference.")
@click.option("--limit", default=config_default(RulerConfig, "limit"), show_default=True, type=click.IntRange(min=1),
              help="Samples per task and length (lm-eval's --limit).")
@click.option("--slots", default=config_default(RulerConfig, "slots"), show_default=True,
              type=click.IntRange(min=1), help="Engine slots; lm-eval sends this many requests at once.")
@click.option("--chunk", default=config_default(RulerConfig, "chunk"), show_default=True,
              type=click.IntRange(min=1), help="Prefill chunk of the artifacts.")
@click.option("--scope", type=click.Choice(SCOPES), default=config_default(RulerConfig, "scope"), show_default=True,
              help="SnapStream selection scope.")
@kernel_option()
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default=config_default(ExportConfig, "kv_dtype"),
              show_default=True, help="KV cache of every artifact, dense's too (as convert's).")
@report_options("ruler.json", "eval", "Results JSON; the Markdown table and plots are written beside it. "
                "An interrupted run of the same configuration resumes from OUTPUT.partial.jsonl.")
def eval_ruler(model_or_dir, tasks, lengths, cells, weights, limit, slots, chunk, scope, kernel, kv_dtype, cache_dir,
               output, as_json):
    """RULER (niah_single_1, niah_multikey_2/3, vt, cwe, fwe) through lm-evaluation-harness.

    For each weight format, builds (or reuses) the dense and compressed artifacts, serves each with
    `snapcompile serve` and points `lm_eval --model local-completions` at it: lm-eval makes the data
    (offline, with the artifact's tokenizer), sends the prompts and scores the answers. Writes
    OUTPUT (JSON: every sample's score and answer), OUTPUT.md (score per task and cell, retention
    of dense's score, the samples lost with dense's own margin where the answers part: dense's
    request replayed through the dense artifact) and a plot per weight format. Needs lm-eval[ruler]
    (installed by scripts/setup.sh).
    """
    from tqdm import tqdm

    from snapcompile.atomic import check_output_file
    from snapcompile.cli import progress_bar
    from snapcompile.evaluation import ruler_report
    from snapcompile.evaluation.partial_results import partial_path
    from snapcompile.evaluation.ruler_run import run_ruler
    from snapcompile.models.loader import cache_root
    _check_lm_eval()
    output = check_output_file(output, force=True, read_folders=(Path(model_or_dir),))
    config = RulerConfig(model_or_dir, tasks, lengths, cells, weights, limit, slots, chunk, scope, kernel, kv_dtype)
    cache = cache_dir or cache_root() / "eval"
    started = time.perf_counter()
    with progress_bar(desc="eval-ruler", unit="run", total=len(config.units()), disable=as_json) as bar:
        units, margins = run_ruler(config, output, cache, cache / "ruler-work", progress=bar.update,
                                   log=lambda msg: tqdm.write(msg, file=sys.stderr))
    seconds = time.perf_counter() - started
    rows = ruler_report.summarize(units)
    lost = ruler_report.lost_samples(units, margins)
    payload = {"config": json.loads(json.dumps(config.__dict__)), "summary": rows, "lost": lost, "units": units,
               "seconds_this_run": seconds}
    table = ruler_report.markdown(rows, config.cells) + ruler_report.lost_markdown(lost)
    write_report(output, payload, table, lambda stem: ruler_report.plots(rows, stem),
                 {"summary": rows, "seconds_this_run": seconds}, as_json, f"{seconds:.0f} s this run")
    partial_path(output).unlink(missing_ok=True)


def _check_lm_eval() -> None:
    import importlib.util
    missing = [name for name in ("lm_eval", "nltk", "wonderwords") if importlib.util.find_spec(name) is None]
    if missing:
        raise click.ClickException(f"eval-ruler needs {', '.join(missing)}: pip install 'lm-eval[ruler,api]' "
                                   "(scripts/setup.sh installs it)")

