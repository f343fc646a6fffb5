"""`snapcompile bench`."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from snapcompile.bench.graph_choice import MEASURES
from snapcompile.cli.options import config_default, csv_option, report_options
from snapcompile.cli.reports import write_report
from snapcompile.config import PolicyConfig


@click.command()
@click.argument("model")
@click.option("--contexts", default="1024,2048,4096,8192", show_default=True, callback=csv_option(int))
@click.option("--slots", default="1,4,8,16", show_default=True, callback=csv_option(int))
@click.option("--budget", default=config_default(PolicyConfig, "budget"), show_default=True,
              help="SnapStream KV budget B.")
@click.option("--new-tokens", default=64, show_default=True, help="Decode steps timed per repeat.")
@click.option("--repeats", default=3, show_default=True, help="Repeats per point (median, min, max).")
@click.option("--prefill-repeats", type=int, default=None, help="Repeats of the prefill timings (default: --repeats).")
@click.option("--no-eager", is_flag=True, help="Skip the PyTorch eager baseline.")
@click.option("--eager-kv-limit-gib", default=4.0, show_default=True,
              help="Skip eager points whose KV cache exceeds this (transformers copies it every step).")
@click.option("--memory-limit-gib", default=16.0, show_default=True,
              help="Memory for the 'largest slot count that fits' figure.")
@click.option("--weights", default="fp32", show_default=True, callback=csv_option(str),
              help="Weight formats of the snapstream and dense artifacts, comma-separated (e.g. fp32,int4, or int4 "
                   "alone); the first is the one the main table and every ratio use. Systems of other formats "
                   "than fp32 are named snapstream-int4 etc.")
@click.option("--peers", default="", callback=csv_option(str),
              help="Also measure ONNX Runtime GenAI builds of the same model at these precisions "
                   "(fp32,int4), each point in a subprocess (pip install \"snapcompile[peers]\").")
@click.option("--force", is_flag=True, help="Replace the --output file if it exists.")
@click.option("--measure", type=click.Choice(MEASURES), default=MEASURES[0], show_default=True,
              help="points: the systems at every context x slots point (below). On an artifact folder as MODEL: "
                   "decode-slots, a decode step per active count (--slots) on the slot-bucket graph the backend "
                   "picks vs the N-slot graph (each slot holding a --contexts[0]-token prompt, --new-tokens steps); "
                   "prefill-schedules, one --contexts[0]-token prefill with each chunk on the smallest bucket "
                   "holding the rows so far vs on the prompt's own bucket. Both print only.")
@report_options("bench.json", "bench", "Results JSON; the Markdown table and plots are written beside it.")
def bench(model, contexts, slots, budget, new_tokens, repeats, prefill_repeats, no_eager, eager_kv_limit_gib,
          memory_limit_gib, weights, peers, force, measure, cache_dir, output, as_json):
    """Decode throughput, prefill time, KV memory and roofline: SnapStream vs dense vs PyTorch.

    MODEL is a built-in name, a Hugging Face folder or a GGUF file (artifacts are built and cached).
    Every point (context x slots) measures the three systems in turn in this process, repeated.
    A killed run resumes: finished points are kept in OUTPUT.partial.jsonl until OUTPUT is written,
    and the same command measures only the others (the JSON counts them as resumed_points).
    With --measure decode-slots or prefill-schedules, MODEL is an artifact folder and one choice of
    the backend's graphs is measured against its alternative, side by side.
    """
    if measure != "points":
        _graph_choice(measure, Path(model), contexts[0], slots, new_tokens, repeats, as_json)
        return
    from tqdm import tqdm

    from snapcompile.atomic import check_output_file
    from snapcompile.bench import report
    from snapcompile.bench.partial_points import PointStore, partial_path
    from snapcompile.bench.runner import BenchConfig, run_bench
    from snapcompile.cli import progress_bar
    from snapcompile.models.loader import cache_root
    config = BenchConfig(model, contexts, slots, budget, new_tokens, repeats, eager=not no_eager,
                         memory_limit_gib=memory_limit_gib, eager_kv_limit_gib=eager_kv_limit_gib,
                         prefill_repeats=prefill_repeats, weight_formats=tuple(weights), peers=tuple(peers))
    output = check_output_file(output, force, read_folders=(Path(model),))
    started = time.perf_counter()
    with progress_bar(total=len(contexts) * len(slots), desc="bench", unit="point", disable=as_json) as bar:
        result = run_bench(config, cache_dir or cache_root() / "bench", progress=bar.update,
                           log=lambda msg: tqdm.write(msg, file=sys.stderr), store=PointStore(output, config))
    result["seconds"] = time.perf_counter() - started
    write_report(output, result, report.markdown(result), lambda stem: report.plots(result, stem), result,
                 as_json, f"{result['seconds']:.0f} s")
    partial_path(output).unlink(missing_ok=True)      # its points are in OUTPUT now


def _graph_choice(measure: str, folder: Path, length: int, active: list[int], steps: int, repeats: int,
                  as_json: bool) -> None:
    """`--measure decode-slots | prefill-schedules` on the artifact `folder`: a line per row (or JSON)."""
    import json

    from snapcompile.artifact.manifest import MANIFEST
    from snapcompile.bench import graph_choice
    from snapcompile.bench.machine import cpu_description, describe_cpu
    from snapcompile.errors import SnapcompileError
    from snapcompile.runtime.ort_backend import OrtBackend
    if not (folder / MANIFEST).is_file():
        raise SnapcompileError(f"--measure {measure} runs on an artifact folder; {folder} has no {MANIFEST}")
    backend = OrtBackend(folder)
    backend.make_graphs()                          # no timed run pays for making its graph
    if measure == "decode-slots":
        rows = graph_choice.decode_slots(backend, active, length, steps, repeats)
    else:
        rows = graph_choice.prefill_schedules(backend, length, repeats)
    cpu = describe_cpu(cpu_description())          # with the load average
    if as_json:
        click.echo(json.dumps({"artifact": str(folder), "measure": measure, "rows": rows, "cpu": cpu}))
        return
    for row in rows:
        click.echo("  ".join(f"{key} {value}" for key, value in row.items()))
    click.echo(cpu)
