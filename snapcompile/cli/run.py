"""`snapcompile run` and `snapcompile validate`."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import click

from snapcompile.bench.machine import cpu_description, describe_cpu
from snapcompile.cli.options import FiniteRange, session_cache_option
from snapcompile.errors import ParityError, SnapcompileError, check_text
from snapcompile.runtime import BACKENDS, PROVIDERS
from snapcompile.validate.tolerances import (
    DEFAULT_TIE_GAP,
    DEFAULT_TOLERANCE,
    FP16_TIE_GAP,
    FP16_TOLERANCE,
    INT8_KV_MIN_AGREEMENT,
    INT8_KV_TIE_GAP,
    INT8_KV_TOLERANCE,
)


def _load_prompt_records(prompt: tuple[str, ...], prompts_file: Path | None, demo: bool) -> list:
    from snapcompile.passkeys import demo_prompts
    from snapcompile.prompts_file import PromptRecord, read_prompts_file
    sources = sum([bool(prompt), prompts_file is not None, demo])
    if sources != 1:
        raise SnapcompileError("give exactly one of --prompt (repeatable), --prompts FILE.jsonl or --demo")
    if prompts_file is not None:
        return read_prompts_file(prompts_file)
    flag = "--demo prompt" if demo else "--prompt"
    texts = demo_prompts() if demo else [check_text(text, f"--prompt {i}") for i, text in enumerate(prompt, 1)]
    return [PromptRecord({"prompt": text}, f"{flag} {index}") for index, text in enumerate(texts, 1)]


def _percentile(values: list[float], q: float) -> float | None:
    import numpy as np
    return float(np.percentile(values, q)) if values else None


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", multiple=True, help="Prompt text (repeat for several).")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path),
              help='JSONL file: {"prompt": ...} or {"turns": [...]} (a conversation: each turn is sent with the '
                   'turns and answers before it), optional "id", "max_new_tokens", "stop", "temperature", "top_k", '
                   '"top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias" '
                   '({"token id": bias}), "seed".')
@click.option("--demo", is_flag=True, help="Run the built-in demo prompts (two questions and a pass-key prompt).")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, help="Nucleus sampling mass in (0, 1].")
@click.option("--min-p", default=0.0, show_default=True,
              help="Drop tokens below this share of the likeliest one's probability (0 = off).")
@click.option("--repetition-penalty", default=1.0, show_default=True,
              help="Divide (multiply, if negative) the logits of tokens already in the prompt or output (1 = off).")
@click.option("--presence-penalty", default=0.0, show_default=True,
              help="Subtract from the logits of tokens already generated, once (OpenAI's, in [-2, 2]).")
@click.option("--frequency-penalty", default=0.0, show_default=True,
              help="Subtract this times a token's count in the output from its logit (OpenAI's, in [-2, 2]).")
@click.option("--seed", type=int, default=None, help="Sampling seed (per request: seed + request index).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--top-logprobs", default=0, show_default=True,
              help="Record the N likeliest tokens (with natural-log probabilities) at every generated token "
                   "in the JSON / JSONL results.")
@click.option("--raw", is_flag=True, help="Do not apply the chat template of instruct models.")
@click.option("--ignore-eos", is_flag=True, help="Generate past EOS up to --max-new-tokens (fixed-length benchmarks).")
@click.option("--provider", type=click.Choice(list(PROVIDERS)), default="cpu", show_default=True,
              help="ONNX Runtime execution provider.")
@click.option("--backend", type=click.Choice(BACKENDS), default="ort", show_default=True,
              help="ort: ONNX Runtime on an artifact folder; trt: TensorRT engines from `snapcompile build`.")
@click.option("--slots", "max_slots", type=click.IntRange(min=1), default=None,
              help="Serve at most this many requests at once (default: all of the artifact's static slots).")
@click.option("--prefill-tokens-per-step", type=click.IntRange(min=1), default=None,
              help="Prompt tokens prefilled between two decode steps (default: one chunk).")
@session_cache_option()
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Write results as JSONL (checked before anything runs). Each result is appended to "
                   "OUTPUT.partial as it finishes; the whole file is written atomically at the end and the "
                   "partial one removed. A run that ends early, or a disk that refuses the file, leaves the "
                   "results in OUTPUT.partial (or prints them), and the error says where; the same command "
                   "run again resumes, running only the prompts OUTPUT.partial lacks.")
@click.option("--force", is_flag=True, help="Replace the --output file (and start over, dropping its .partial).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (results and summary).")
def run(artifact, prompt, prompts_file, demo, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
        presence_penalty, frequency_penalty, seed, stop, top_logprobs,
        raw, ignore_eos, provider, backend, max_slots, prefill_tokens_per_step, session_cache_bytes, session_keep,
        output, force, as_json):
    """Generate for prompts with continuous batching over the artifact's static slots.

    Every request value (command line and prompts file) is checked before the artifact loads; a
    request that still fails while running gets an error result and the others go on (exit 1).
    """
    from snapcompile.atomic import PartialLines, check_output_file
    from snapcompile.cli.run_partial import open_partial, run_identity
    from snapcompile.engine.conversation import Conversation
    from snapcompile.engine.engine import Engine
    if output is not None:
        output = check_output_file(output, force, inputs=(prompts_file,), read_folders=(artifact,))
        check_output_file(PartialLines.path_of(output), True, inputs=(prompts_file,), read_folders=(artifact,))
    records = _load_prompt_records(prompt, prompts_file, demo)
    defaults = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                    frequency_penalty=frequency_penalty, logit_bias={}, seed=seed, max_new_tokens=max_new_tokens,
                    stop=stop, top_logprobs=top_logprobs)
    _request_without_prompt({"prompt": ""}, 0, defaults)        # the command line's own values
    pending = [_request_without_prompt(record.fields, index, defaults, record.where)
               for index, record in enumerate(records)]
    turn_ids = _refuse_duplicate_ids(pending, records)
    resumed = None
    if output is not None:
        from snapcompile.artifact.manifest import read_manifest
        identity = run_identity(read_manifest(artifact), records, {**defaults, "raw": raw, "ignore_eos": ignore_eos})
        resumed = open_partial(output, identity, turn_ids, force)
    partial = resumed.lines if resumed is not None else None
    try:
        engine = Engine.from_artifact(artifact, provider=provider, prefill_tokens_per_step=prefill_tokens_per_step,
                                      backend=backend, max_slots=max_slots, session_cache_bytes=session_cache_bytes,
                                      session_keep=session_keep)
        chat = engine.backend.manifest.chat and not raw
        todo = [c for c in range(len(records)) if resumed is None or not resumed.rows[c]]
        if resumed is not None and resumed.finished:
            click.echo(f"resuming: {resumed.finished} of {len(records)} prompts finished in {partial.path}", err=True)
        conversations = [Conversation(replace(pending[c], ignore_eos=ignore_eos), records[c].turns) for c in todo]
        new_rows, results, elapsed = _run_rows(engine, conversations, [records[c].fields for c in todo], chat,
                                               top_logprobs, partial, quiet=not sys.stderr.isatty() and as_json)
    except BaseException as err:
        if partial is not None:
            partial.close()
            if partial.lines and isinstance(err, KeyboardInterrupt):   # the signal's error line says where
                raise KeyboardInterrupt(f"the {partial.lines} results finished so far are in {partial.path}: run the "
                                        "same command again to go on from them") from None
            if partial.lines:
                click.echo(f"kept the {partial.lines} results finished so far in {partial.path}", err=True)
        raise
    rows = _in_prompt_order(new_rows, todo, resumed.rows if resumed is not None else None)
    summary = _summary(engine, results, elapsed)
    summary["resumed"] = len(rows) - len(results)
    if any("correct" in row for row in rows):
        summary["correct"] = sum(row.get("correct", False) for row in rows)
    if output:
        _write_results(partial, rows)
    if as_json:
        click.echo(json.dumps({"results": rows, "summary": summary}))
    else:
        if not output:
            for row in rows:
                shown = row["text"] if row["error"] is None else f"[error] {row['error']}"
                click.echo(f"--- {row['id']} ({row['prompt_tokens']} prompt tokens, {row['finish_reason']})\n{shown}")
        click.echo(_format_summary(summary), err=True)
    if summary["errors"]:
        sys.exit(1)   # every result was written; some requests could not be served


def _run_rows(engine, conversations, fields: list[dict], chat: bool, top_logprobs: int | None,
              partial, quiet: bool) -> tuple[list[list[dict]], list, float]:
    """Every conversation run to its end: its rows (one a turn, in turn order), every Result in
    conversation order, and the run's seconds. Each row is also appended to `partial` (a
    PartialLines, or None) as its turn finishes."""
    from snapcompile.cli import progress_bar
    from snapcompile.engine.conversation import run_conversations
    rows: dict[int, list[dict]] = {id(conversation): [] for conversation in conversations}
    fields_of = {id(conversation): record for conversation, record in zip(conversations, fields)}

    def finished(conversation, result) -> None:
        turn = len(conversation.results) - 1
        row = _result_row(engine, conversation, turn, result, fields_of[id(conversation)], top_logprobs)
        rows[id(conversation)].append(row)
        if partial is not None:
            partial.append(json.dumps(row))
        bar.update(1)
    start = engine.clock()
    with progress_bar(total=sum(len(c.turns) for c in conversations), desc="requests", unit="req",
                      disable=quiet) as bar:
        run_conversations(engine, conversations, chat, on_result=finished)
    elapsed = engine.clock() - start
    return [rows[id(c)] for c in conversations], [r for c in conversations for r in c.results], elapsed


def _result_row(engine, conversation, turn: int, result, fields: dict, top_logprobs: int | None) -> dict:
    """One results-file row: the turn's prompt and answer, counts, and (when asked) its top log
    probabilities and whether it holds the record's expected "answer"."""
    row = {"id": result.request_id, "turn": turn + 1, "prompt": conversation.turns[turn], "text": result.text,
           "finish_reason": result.finish_reason, "error": result.error, "prompt_tokens": result.prompt_tokens,
           "cached_tokens": result.cached_tokens, "output_tokens": len(result.output_ids), "ttft_s": result.ttft_s}
    if top_logprobs:
        row["top_logprobs"] = [[{"id": i, "token": engine.tokenizer.decode([i]), "logprob": lp} for i, lp in top]
                               for top in result.top_logprobs]
    if "answer" in fields:      # prompts files may carry the expected answer
        row["correct"] = str(fields["answer"]) in row["text"]
    return row


def _write_results(partial, rows: list[dict]) -> None:
    """The results file at once; when the disk refuses it, the error says where the results are
    (the partial file, or standard output where they are printed)."""
    from snapcompile.errors import SnapcompileError
    text = "".join(json.dumps(row) + "\n" for row in rows)
    try:
        partial.finish(text)
    except SnapcompileError:
        if not partial.intact:
            click.echo(text, nl=False)
        raise


def _request_without_prompt(record: dict, index: int, defaults: dict, where: str | None = None):
    """A validated Request of one prompts record (no token ids yet); fields the record lacks come
    from the command line. Errors name `where` (the file line or the --prompt)."""
    from snapcompile.engine.request import Request, SamplingParams, logit_bias_pairs
    fields = {key: record.get(key, default) for key, default in defaults.items()}
    if "seed" not in record and defaults["seed"] is not None:
        fields["seed"] = defaults["seed"] + index
    stop = fields["stop"]
    try:
        if not isinstance(stop, (str, list, tuple)):
            raise SnapcompileError(f"stop must be a string or a list of strings, got {stop!r}")
        sampling = SamplingParams(**{name: fields[name] for name in SAMPLING_FIELDS},
                                  logit_bias=logit_bias_pairs(fields["logit_bias"]))
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        return Request([], max_new_tokens=fields["max_new_tokens"], stop=stops, sampling=sampling,
                       request_id=str(record.get("id", index)), top_logprobs=fields["top_logprobs"])
    except SnapcompileError as err:
        raise SnapcompileError(f"{where}: {err}" if where else str(err)) from None


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")


def _refuse_duplicate_ids(requests: list, records: list) -> list[list[str]]:
    """Before any work: every request id the run will give (a conversation's turns are ID/1, ID/2, ...,
    `Conversation`) is unique, so no result can be lost to a collision after the run. Returns each
    conversation's turn ids."""
    seen, turn_ids = set(), []
    for request, record in zip(requests, records):
        turns = len(record.turns)
        ids = [request.request_id] if turns == 1 else [f"{request.request_id}/{k}" for k in range(1, turns + 1)]
        for request_id in ids:
            if request_id in seen:
                raise SnapcompileError(f"{record.where}: id {request_id!r} is used by an earlier prompt")
            seen.add(request_id)
        turn_ids.append(ids)
    return turn_ids


def _in_prompt_order(new_rows: list[list[dict]], ran: list[int], kept: list[list[dict]] | None) -> list[dict]:
    """Every row in prompt order: new_rows[i] those of conversation ran[i], kept[c] those a resumed
    run kept of conversation c."""
    by_conversation = [list(rows) for rows in kept] if kept is not None else [[] for _ in ran]
    for conversation, rows in zip(ran, new_rows):
        by_conversation[conversation] = rows
    return [row for rows in by_conversation for row in rows]


def _summary(engine, results, elapsed: float) -> dict:
    tokens = sum(len(r.output_ids) for r in results)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    steps = engine.decode_step_seconds
    prompt_tokens = sum(r.prompt_tokens for r in results if r.error is None)
    graphs_made, graphs_made_s = engine.backend.graphs_made_on_use()
    return {"requests": len(results), "errors": sum(r.error is not None for r in results),
            "prompt_tokens": prompt_tokens, "cached_tokens": sum(r.cached_tokens for r in results),
            "output_tokens": tokens, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed else None,
            "prompt_tokens_per_s": prompt_tokens / elapsed if elapsed else None,
            "ttft_p50_s": _percentile(ttfts, 50), "ttft_p95_s": _percentile(ttfts, 95),
            "step_p50_ms": _ms(_percentile(steps, 50)), "step_p95_ms": _ms(_percentile(steps, 95)),
            "decode_steps": engine.decode_steps, "kv_bytes": engine.kv_bytes_allocated(),
            "slots": engine.scheduler.pool.num_slots, "policy": engine.backend.manifest.policy.policy,
            "graphs_made_on_use": graphs_made, "graphs_made_on_use_s": graphs_made_s,
            "kernels": engine.backend.device.kernels(engine.backend.manifest), "cpu": describe_cpu(cpu_description())}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _fmt(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.3g}{unit}"


def _format_summary(s: dict) -> str:
    fmt = _fmt      # a short name keeps the format below readable
    answers = f" | answers correct {s['correct']}/{s['requests'] + s['resumed']}" if "correct" in s else ""
    resumed = f" (and {s['resumed']} results of the run resumed)" if s["resumed"] else ""
    cached = f" ({s['cached_tokens']} resumed from kept caches)" if s["cached_tokens"] else ""
    count = s["graphs_made_on_use"]
    made = (f" | {count} graph{'s' if count > 1 else ''} made at first use in {s['graphs_made_on_use_s']:.2f} s, "
            "part of the times above" if count else "")
    return (f"{s['requests']} requests{resumed} ({s['errors']} errors), {s['prompt_tokens']} prompt{cached} + "
            f"{s['output_tokens']} generated tokens in {s['seconds']:.2f} s = "
            f"{fmt(s['prompt_tokens_per_s'])} prompt tok/s, "
            f"{fmt(s['tokens_per_s'])} generated tok/s"
            f" | TTFT p50 {fmt(s['ttft_p50_s'], ' s')} p95 {fmt(s['ttft_p95_s'], ' s')}"
            f" | step p50 {fmt(s['step_p50_ms'], ' ms')} p95 {fmt(s['step_p95_ms'], ' ms')}"
            f" | KV {s['kv_bytes'] / 2**20:.1f} MiB ({s['slots']} slots, {s['policy']}){made}{answers}"
            f"\n{s['kernels']} on {s['cpu']}")


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompt", multiple=True, help="Prompt text (repeat for several).")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), help="JSONL prompts file.")
@click.option("--demo", is_flag=True, help="Use the built-in demo prompts.")
@click.option("--steps", default=32, show_default=True, type=click.IntRange(min=1),
              help="Decode steps compared after the prefill step.")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--tolerance", default=None, type=FiniteRange(min=0),
              help=f"Fail when max |logit difference| exceeds this. [default: {DEFAULT_TOLERANCE:g}; "
                   f"{FP16_TOLERANCE:g} for --weights fp16 artifacts, whose logits are float16, and --kv-dtype "
                   f"float16; {INT8_KV_TOLERANCE:g} for --kv-dtype int8]")
@click.option("--min-agreement", default=None, type=FiniteRange(0, 1),
              help="Fail when greedy-token agreement (0..1) is below this. "
                   f"[default: 1; {INT8_KV_MIN_AGREEMENT:g} for --kv-dtype int8]")
@click.option("--tie-gap", default=None, type=FiniteRange(min=0),
              help="Selection differences whose score gap is below this are reported as near-ties, not failures. "
                   f"[default: {DEFAULT_TIE_GAP:g}; {FP16_TIE_GAP:g} for --weights fp16 and --kv-dtype float16; "
                   f"{INT8_KV_TIE_GAP:g} for --kv-dtype int8]")
@click.option("--backend", type=click.Choice(BACKENDS), default="ort", show_default=True,
              help="ort: ONNX Runtime on an artifact folder; trt: TensorRT engines from `snapcompile build`.")
@click.option("--matmul", type=click.Choice(("fp32", "int8")), default="fp32", show_default=True,
              help="How ONNX Runtime multiplies int8/int4 weights: fp32 (dequantized blocks; the graph's exact "
                   "arithmetic, what parity is checked on) or int8 (its fast kernels, which also quantize the "
                   "activations per block; what run, serve, eval and bench use).")
@click.option("--turns", default=1, show_default=True, type=click.IntRange(1, 16),
              help="Conversations of this many turns: each later turn adds --follow-up to everything so far and "
                   "resumes from the previous turn's kept cache on both sides (compared step by step).")
@click.option("--follow-up", default=" Tell me more about that.", show_default=True,
              help="The text (no chat template) that each later turn adds.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def validate(artifact, prompt, prompts_file, demo, steps, raw, tolerance, min_agreement, tie_gap, backend, matmul,
             turns, follow_up, as_json):
    """Compare the artifact step by step with the PyTorch oracle (same cache policy).

    Both run teacher-forced on the oracle's greedy tokens. Exit 1 when max |logit diff| >
    --tolerance, greedy agreement < --min-agreement, or selected positions differ beyond
    near-ties. With no prompts given, the demo prompts are used. With --turns, each prompt is a
    conversation whose later turns resume from the kept cache (docs/design.md, "Conversations that
    keep their cache").
    """
    from snapcompile.artifact.files import artifact_tokenizer
    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.prompts import encode
    from snapcompile.validate.parity import Validator, oracle_model, summarize
    from snapcompile.validate.tolerances import min_agreement as min_agreement_for
    from snapcompile.validate.tolerances import tie_gap as tie_gap_for
    from snapcompile.validate.tolerances import tolerance as tolerance_for
    if not (prompt or prompts_file or demo):
        demo = True
    records = _load_prompt_records(prompt, prompts_file, demo)
    manifest = read_manifest(artifact)
    tolerance = tolerance_for(manifest.export) if tolerance is None else tolerance
    tie_gap = tie_gap_for(manifest.export) if tie_gap is None else tie_gap
    min_agreement = min_agreement_for(manifest.export) if min_agreement is None else min_agreement
    tokenizer = artifact_tokenizer(artifact, manifest)
    prompts = [encode(tokenizer, r.prompt, manifest.chat and not raw) for r in records]
    follow_ids = encode(tokenizer, check_text(follow_up, "--follow-up"), False) if turns > 1 else []
    if turns > 1 and not follow_ids:
        raise SnapcompileError("--follow-up must have at least one token")
    later = (turns - 1) * (steps + 1 + len(follow_ids))       # what the later turns add
    limit = manifest.export.max_context - (0 if manifest.policy.compressed else steps + 1) - later
    if demo:          # the built-in prompts are cut to fit a small artifact (their last tokens kept)
        prompts = [p[-limit:] for p in prompts] if limit > 0 else prompts
    too_long = [len(p) for p in prompts if len(p) > limit]
    if too_long:
        raise SnapcompileError(f"a prompt of {too_long[0]} tokens leaves no room for {turns} turn(s) of {steps} "
                               f"steps within --max-context {manifest.export.max_context}")
    validator = Validator(artifact, oracle_model(artifact, manifest), tie_gap=tie_gap, backend=backend,
                          exact_matmul=matmul == "fp32")
    from snapcompile.cli import progress_bar
    with progress_bar(total=validator.work(len(prompts), steps, turns), desc="validate", unit="step",
                      disable=as_json) as bar:
        def advance(units: int, what: str) -> None:
            bar.set_postfix_str(what, refresh=False)
            bar.update(units)
        reports = (validator.run_turns(prompts, steps, turns, follow_ids, progress=advance) if turns > 1
                   else validator.run(prompts, steps, progress=advance))
    summary = summarize(reports, steps)
    summary.update(tolerance=tolerance, min_agreement=min_agreement, weight_format=manifest.export.weight_format,
                   matmul=matmul)
    summary["passed"] = (summary["max_abs_logit_diff"] <= tolerance and summary["greedy_agreement"] >= min_agreement
                         and not summary["selection_mismatches"])
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(f"prompts {summary['prompt_tokens']} tokens, {steps} steps: max |logit diff| "
                   f"{summary['max_abs_logit_diff']:.3g}, greedy agreement {summary['greedy_agreement']:.3f}, "
                   f"near-ties {len(summary['near_ties'])}, "
                   f"selection mismatches {len(summary['selection_mismatches'])}")
        if turns > 1:
            click.echo("  per turn max |logit diff|: " + ", ".join(
                f"turn {t} {d:.3g}" for t, d in summary["per_turn_max_abs_logit_diff"].items()))
        for tie in summary["near_ties"]:
            click.echo(f"  near-tie: prompt {tie['prompt']} layer {tie['layer']} head {tie['head']} "
                       f"gap {tie['score_gap']:.2e}")
    if not summary["passed"]:
        raise ParityError("parity check failed (see figures above)")
