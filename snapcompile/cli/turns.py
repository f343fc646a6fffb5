"""`snapcompile eval-turns` (multi-turn accuracy: each later turn re-prefilled, resumed or fed to the
ring) and `snapcompile bench-turns` (the time to first token of each turn)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from snapcompile.bench.turn_latency import DEFAULT_MODES as BENCH_DEFAULT_MODES
from snapcompile.bench.turn_latency import MODES as BENCH_MODES
from snapcompile.bench.turn_latency import TurnsBenchConfig
from snapcompile.cli.options import config_default, csv_option, kernel_option, report_options
from snapcompile.cli.reports import write_report
from snapcompile.config import KV_DTYPES, SCOPES, WEIGHT_FORMATS, ExportConfig
from snapcompile.evaluation.conversation_eval import DEFAULT_MODES, MODES, TurnsConfig
from snapcompile.evaluation.conversations import KINDS, PARTS


@click.command(name="eval-turns")
@click.argument("model_or_dir")
@click.option("--lengths", default="3000", show_default=True, callback=csv_option(int),
              help="Tokens of turn 1 (the document and its question).")
@click.option("--samples", default=config_default(TurnsConfig, "samples"), show_default=True,
              type=click.IntRange(min=1), help="Conversations per length, the kinds taking turns.")
@click.option("--part", type=click.Choice(PARTS), default=config_default(TurnsConfig, "part"), show_default=True,
              help="Which conversations: 'tune' to choose a policy or mode on, 'held-out' to report (with a "
                   "--seed chosen after the tuning).")
@click.option("--seed", default=0, show_default=True, type=int, help="Draws the part's conversations.")
@click.option("--kinds", default=",".join(KINDS), show_default=True, callback=csv_option(str),
              help="Kinds of document (numbers, names, dates, codes: facts of that kind; two-documents: two "
                   "memos of two kinds).")
@click.option("--ratio", default=config_default(TurnsConfig, "ratio"), show_default=True, type=click.IntRange(min=2),
              help="Budget B = the final conversation's length // RATIO.")
@click.option("--policy", type=click.Choice(("snapstream", "streamingllm")), default="snapstream", show_default=True)
@click.option("--weights", type=click.Choice(WEIGHT_FORMATS), default="fp32", show_default=True)
@click.option("--chunk", default=config_default(TurnsConfig, "chunk"), show_default=True, type=click.IntRange(min=1))
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default=config_default(ExportConfig, "kv_dtype"),
              show_default=True, help="The KV cache of every artifact, dense's too (convert --kv-dtype); a dense "
                                      "run of another dtype can be the reference through --reference.")
@click.option("--modes", default=",".join(DEFAULT_MODES), show_default=True, callback=csv_option(str),
              help=f"Which of {', '.join(MODES)} to run (dense: the reference).")
@kernel_option()
@click.option("--scope", type=click.Choice(SCOPES), default=config_default(TurnsConfig, "scope"), show_default=True,
              help="SnapStream selection scope.")
@click.option("--prompt-share", type=click.IntRange(min=1), default=None,
              help="Prompt share P of the budget (default: B minus a ring of B/4).")
@click.option("--summaries", type=click.IntRange(min=0), default=0, show_default=True,
              help="Summary rows of the dropped rows per layer and KV head, within B (convert --summaries).")
@click.option("--summary-segment", type=click.IntRange(min=1), default=config_default(TurnsConfig, "summary_segment"),
              show_default=True, help="Positions per summary row.")
@click.option("--reference", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="The results of an earlier run on the same conversations whose dense records are the "
                   "reference here (to measure a policy variant with --modes resume without rerunning dense).")
@report_options("turns.json", "eval", "Results JSON; the Markdown table is written beside it. An interrupted run "
                "of the same configuration resumes from OUTPUT.partial.jsonl.")
def eval_turns(model_or_dir, lengths, samples, part, seed, kinds, ratio, policy, weights, chunk, kv_dtype, modes,
               kernel, scope, prompt_share, summaries, summary_segment, reference, cache_dir, output, as_json):
    """Multi-turn accuracy on generated conversations, each turn reaching the cache several ways.

    A conversation is a document of facts (numbers, names, dates, door codes, or two memos) of
    about LENGTH tokens with a question, then four follow-ups of 5 to 200 tokens, each asking
    about another fact or about the previous answer, the answers asked for in different lengths;
    every turn sends the conversation so far. Modes: dense (every turn prefilled whole, the
    reference), reprefill (the compressed artifact, every turn prefilled whole), resume-full
    (serve's default --session-keep full: every prompt row kept, each turn re-selected as if
    prefilled whole), resume (--session-keep slot: the kept B rows), ring (each turn's
    tokens fed through decode steps, no re-selection) and resume-quantized (not run by default:
    --session-keep quantized). Reports accuracy per mode and turn, and of the later answers dense
    and reprefill got right the share each mode kept, with dense's margins on the lost ones.
    """
    from tqdm import tqdm

    from snapcompile.atomic import check_output_file
    from snapcompile.cli import progress_bar
    from snapcompile.evaluation.conversation_eval import check_config, later_turns, reference_records, retention
    from snapcompile.evaluation.conversation_runs import run_turns
    from snapcompile.evaluation.partial_results import partial_path
    from snapcompile.models.loader import cache_root
    output = check_output_file(output, force=True, read_folders=(Path(model_or_dir),))
    config = TurnsConfig(model_or_dir, tuple(lengths), samples, seed, part, tuple(kinds), ratio, policy, weights,
                         chunk, modes=tuple(modes), kernel=kernel, scope=scope, prompt_share=prompt_share,
                         summaries=summaries, summary_segment=summary_segment, kv_dtype=kv_dtype)
    check_config(config)
    dense = reference_records(reference, config) if reference is not None and "dense" not in modes else []
    started = time.perf_counter()
    with progress_bar(desc="eval-turns", unit="conversation", total=len(modes) * samples * len(lengths),
                      disable=as_json) as bar:
        records = run_turns(config, output, cache_dir or cache_root() / "eval", progress=bar.update,
                            log=lambda msg: tqdm.write(msg, file=sys.stderr))
    seconds = time.perf_counter() - started
    rows, later = retention(dense + records), later_turns(dense + records)
    payload = {"config": json.loads(json.dumps(config.__dict__)), "retention": rows, "later_turns": later,
               "records": records, "reference": None if reference is None else str(reference),
               "seconds_this_run": seconds}
    write_report(output, payload, _markdown(rows, later, config), lambda stem: [],
                 {"retention": rows, "later_turns": later}, as_json, f"{seconds:.0f} s this run")
    partial_path(output).unlink(missing_ok=True)


def _markdown(rows: list[dict], later: list[dict], config: TurnsConfig) -> str:
    turns = sorted({r["turn"] for r in rows})
    head = "| mode | " + " | ".join(f"turn {t}" for t in turns) + " |\n|---|" + "---|" * len(turns) + "\n"

    def table(title: str, cell) -> str:
        lines = []
        for mode in MODES:
            by_turn = {r["turn"]: r for r in rows if r["mode"] == mode}
            if by_turn:
                lines.append(f"| {mode} | " + " | ".join(cell(by_turn.get(t)) for t in turns) + " |")
        return f"{title}\n\n{head}" + "\n".join(lines) + "\n\n"

    def fmt(value) -> str:
        return "-" if value is None else f"{value:.2f}"
    cases = max((r["cases"] for r in rows), default=0)
    share = "B minus a ring of B/4" if config.prompt_share is None else str(config.prompt_share)
    summaries = (f", {config.summaries} summary rows of {config.summary_segment} positions"
                 if config.summaries else "")
    cache = "" if config.kv_dtype == "float32" else f", {config.kv_dtype} KV cache"
    intro = (f"{config.policy} at B = final length // {config.ratio} (K = {config.kernel}, {config.scope} scope, "
             f"P = {share}{summaries}), {config.weight_format} weights{cache}, {cases} conversations per mode of the "
             f"{config.part} part (seed {config.seed}; {', '.join(config.kinds)}).\n\n")
    return (intro + _later_table(later)
            + table("Accuracy per turn (answer found in the reply):", lambda r: fmt(r and r["accuracy"]))
            + table("Share of dense's accuracy:", lambda r: fmt(r and r["share_of_dense"]))
            + table("Of the answers dense got right, the share kept:", lambda r: fmt(r and r["dense_sure_kept"]))
            + table("Of the answers reprefill got right, the share kept:", lambda r: fmt(r and r["reprefill_kept"])))


def _later_table(later: list[dict]) -> str:
    """Turns 2..5 together: the answers each mode kept of dense's and of reprefill's."""
    lines = ["Later turns (2..5) together:\n", "| mode | right | of dense's right kept | of reprefill's right kept | "
             "dense's margins on the lost |", "|---|---|---|---|---|"]
    for r in later:
        lines.append(f"| {r['mode']} | {r['right']} of {r['answers']} | {r['of_dense_kept']} of {r['dense_right']} | "
                     f"{r['of_reprefill_kept']} of {r['reprefill_right']} | "
                     f"{', '.join(f'{m:.2f}' for m in r['lost_dense_margins']) or '-'} |")
    return "\n".join(lines) + "\n\n"


@click.command(name="bench-turns")
@click.argument("model_or_dir")
@click.option("--turns", default=config_default(TurnsBenchConfig, "turns"), show_default=True,
              type=click.IntRange(2, 64))
@click.option("--turn-tokens", default=config_default(TurnsBenchConfig, "turn_tokens"), show_default=True,
              type=click.IntRange(min=16), help="Tokens of each user message.")
@click.option("--answer-tokens", default=config_default(TurnsBenchConfig, "answer_tokens"), show_default=True,
              type=click.IntRange(min=1), help="Tokens generated per turn (EOS ignored).")
@click.option("--repeats", default=config_default(TurnsBenchConfig, "repeats"), show_default=True,
              type=click.IntRange(min=1), help="Conversations per mode; the modes alternate.")
@click.option("--ratio", default=config_default(TurnsBenchConfig, "ratio"), show_default=True,
              type=click.IntRange(min=2), help="Budget B = the final conversation's length // RATIO.")
@click.option("--policy", type=click.Choice(("snapstream", "streamingllm")), default="snapstream", show_default=True)
@click.option("--weights", type=click.Choice(WEIGHT_FORMATS), default="fp32", show_default=True)
@click.option("--chunk", default=config_default(TurnsBenchConfig, "chunk"), show_default=True,
              type=click.IntRange(min=1))
@click.option("--modes", default=",".join(BENCH_DEFAULT_MODES), show_default=True, callback=csv_option(str),
              help=f"Which of {', '.join(BENCH_MODES)} to time.")
@kernel_option()
@click.option("--summaries", type=click.IntRange(min=0), default=0, show_default=True,
              help="Summary rows of the compressed artifact (convert --summaries).")
@report_options("bench-turns.json", "bench", "Results JSON; the Markdown table is written beside it.")
def bench_turns(model_or_dir, turns, turn_tokens, answer_tokens, repeats, ratio, policy, weights, chunk, modes,
                kernel, summaries, cache_dir, output, as_json):
    """Time to first token of each turn of a growing conversation: dense and compressed, every turn
    prefilled whole or resumed from the kept cache.

    Each turn adds a user message of --turn-tokens and an answer of --answer-tokens. TTFT is the
    median over --repeats conversations per mode (a new conversation each, the modes alternating).
    Also reports the bytes one kept conversation holds.
    """
    from tqdm import tqdm

    from snapcompile.atomic import check_output_file
    from snapcompile.bench import turn_latency as bench
    from snapcompile.bench.machine import cpu_description
    from snapcompile.cli import progress_bar
    from snapcompile.compiler.cache import ArtifactCache
    from snapcompile.config import ExportConfig
    from snapcompile.models.loader import cache_root
    output = check_output_file(output, force=True, read_folders=(Path(model_or_dir),))
    config = bench.TurnsBenchConfig(model_or_dir, turns, turn_tokens, answer_tokens, repeats, ratio, policy,
                                    weights, chunk, tuple(modes), kernel, summaries)
    export = ExportConfig(slots=1, max_context=config.final_length + 64, chunk=chunk, weight_format=weights)
    cache = ArtifactCache(model_or_dir, cache_dir or cache_root() / "bench", lambda m: tqdm.write(m, file=sys.stderr))
    dense = cache.dense(export)
    compressed = cache.get(export, config.compressed_policy()) if set(modes) - {"dense", "dense-resume"} else None
    engines = bench.open_engines(dense, compressed, config.modes)
    tokenizer, chat = engines[config.modes[0]].tokenizer, engines[config.modes[0]].backend.manifest.chat
    runs, started = [], time.perf_counter()
    with progress_bar(desc="bench-turns", unit="conversation", total=repeats * len(config.modes),
                      disable=as_json) as bar:
        for repeat in range(repeats):
            texts = bench.user_texts(tokenizer, config, repeat)
            for mode in config.modes[repeat % 2:] + config.modes[:repeat % 2]:
                engine = engines[mode]
                rows = bench.run_conversation(engine, chat, texts, answer_tokens)
                kept = max(engine.sessions.entry_bytes(), default=None) if engine.sessions else None
                runs.append({"mode": mode, "repeat": repeat, "turns": rows, "kept_bytes": kept})
                bar.update(1)
    rows = bench.medians(runs)
    payload = {"config": json.loads(json.dumps(config.__dict__)), "budget": config.budget, "medians": rows,
               "runs": runs, "cpu": cpu_description(), "seconds": time.perf_counter() - started}
    write_report(output, payload, _bench_markdown(payload), lambda stem: [], {"medians": rows}, as_json,
                 f"{payload['seconds']:.0f} s")


def _bench_markdown(payload: dict) -> str:
    from snapcompile.bench.machine import describe_cpu
    rows, config = payload["medians"], payload["config"]
    by = {(r["mode"], r["turn"]): r for r in rows}
    modes = [m for m in BENCH_MODES if (m, 1) in by]
    turns = sorted({r["turn"] for r in rows})
    lines = ["| turn | prompt tokens | " + " | ".join(f"{m} TTFT (s)" for m in modes) + " |",
             "|---|---|" + "---|" * len(modes)]
    for turn in turns:
        cells = [f"{by[(m, turn)]['ttft_median_s']:.2f}" + (f" ({by[(m, turn)]['cached_tokens']} resumed)"
                                                           if by[(m, turn)]["cached_tokens"] else "")
                 for m in modes]
        lines.append(f"| {turn} | {by[(modes[0], turn)]['prompt_tokens']} | " + " | ".join(cells) + " |")
    growth = ", ".join(f"{m} {by[(m, turns[-1])]['ttft_median_s'] / by[(m, 1)]['ttft_median_s']:.2f}x" for m in modes)
    kept = {r["mode"]: r["kept_bytes"] for r in payload["runs"] if r["kept_bytes"]}
    memory = ", ".join(f"{m} {b / 2**20:.1f} MiB" for m, b in kept.items())
    summaries = f", {config['summaries']} summary rows" if config.get("summaries") else ""
    return (f"{config['policy']} B = {payload['budget']} (K = {config.get('kernel')}{summaries}), "
            f"{config['weight_format']} weights, median of "
            f"{config['repeats']} conversations per mode; {describe_cpu(payload['cpu'])}.\n\n" + "\n".join(lines)
            + f"\n\nTTFT of turn {turns[-1]} / turn 1: {growth}. One kept conversation after its last turn: "
            f"{memory}.\n")
