"""`snapcompile export`, `convert` and `compress`: a model to an artifact folder. Every option's
default is the configuration dataclass's own (snapcompile.config)."""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path

import click

from snapcompile.cli.options import config_default as default
from snapcompile.cli.options import option_group
from snapcompile.config import (
    KV_DTYPES,
    LOWERINGS,
    POLICIES,
    POOLINGS,
    SCOPES,
    WEIGHT_FORMATS,
    ExportConfig,
    PolicyConfig,
)

_export_options = option_group(
    click.option("--slots", default=default(ExportConfig, "slots"), show_default=True,
                 help="Decode batch slots N (static)."),
    click.option("--max-context", default=default(ExportConfig, "max_context"), show_default=True,
                 help="Longest prompt (+ generation, for dense) in tokens: the dense cache length L."),
    click.option("--chunk", default=default(ExportConfig, "chunk"), show_default=True,
                 help="Prefill chunk length in tokens."),
    click.option("--weights", "weight_format", type=click.Choice(WEIGHT_FORMATS),
                 default=default(ExportConfig, "weight_format"), show_default=True,
                 help="How linear layers and the LM head are stored: fp32; fp16 (multiplied in float16); or "
                      "int8 / int4 blocks (weight-only; int4 keeps the head 8-bit). From a GGUF with 4/8-bit "
                      "blocks the file's own values are kept where the format holds them exactly."),
    click.option("--block-size", default=default(ExportConfig, "block_size"), show_default=True,
                 help="Inputs per int8/int4 quantization block (a power of two >= 16 dividing every layer's "
                      "input size). A GGUF's own blocks are kept only at 32: other sizes round its values a "
                      "second time, which costs accuracy."),
    click.option("--slot-buckets/--no-slot-buckets", default=default(ExportConfig, "slot_buckets"),
                 show_default=True,
                 help="Also write decode graphs for 1, 2, 4, ... slots below N, so that a step with few active "
                      "requests does not pay for N slots (each costs one graph and, on ONNX Runtime, its "
                      "own pre-packed weights)."),
    click.option("--tail", default=default(ExportConfig, "tail"), show_default=True, type=click.IntRange(min=0),
                 help="Tokens of the tail prefill graph, which runs a resumed conversation turn's last tokens over "
                      "the rows earlier selections dropped (serve/run --session-keep quantized); at least the "
                      "observation window. 0: no tail graph."),
    click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default=default(ExportConfig, "kv_dtype"),
                 show_default=True,
                 help="How the KV cache is stored, in the slots and in a prompt's rows while it is prefilled: "
                      "float16 halves both (each key and value rounded once where it is stored; attention still "
                      "computes in float32); int8 stores each head's row in 8 bits with its own scale, about a "
                      "quarter (ONNX Runtime only; no --summaries). docs/results/accuracy.md measures what each "
                      "costs. Standard lowering only."),
    click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path),
                 help="Artifact folder to write (atomically)."),
    click.option("--force", is_flag=True, help="Replace the output folder if it exists."),
)

_policy_options = option_group(
    click.option("--policy", type=click.Choice(POLICIES),
                 default=default(PolicyConfig, "policy"), show_default=True, help="Cache policy."),
    click.option("--budget", default=default(PolicyConfig, "budget"), show_default=True,
                 help="KV rows per sequence B."),
    click.option("--sinks", default=default(PolicyConfig, "sinks"), show_default=True,
                 help="Attention-sink tokens S always kept."),
    click.option("--window", default=default(PolicyConfig, "window"), show_default=True,
                 help="Observation window W (last prompt queries)."),
    click.option("--kernel", default=default(PolicyConfig, "kernel"), show_default=True,
                 help="Pooling width K (odd)."),
    click.option("--pooling", type=click.Choice(POOLINGS), default=default(PolicyConfig, "pooling"),
                 show_default=True, help="How window scores are pooled along positions."),
    click.option("--scope", type=click.Choice(SCOPES), default=default(PolicyConfig, "scope"), show_default=True,
                 help="Select per KV head, or one position set per layer."),
    click.option("--prompt-share", type=int, default=default(PolicyConfig, "prompt_share"),
                 help="Budget rows for the compressed prompt P (default: B minus a ring of >= B/4)."),
    click.option("--summaries", default=default(PolicyConfig, "summaries"), show_default=True,
                 type=click.IntRange(min=0),
                 help="Rows per layer and KV head that sum the rows each selection drops (one per "
                      "--summary-segment positions), for a resumed conversation turn to attend over; "
                      "they count in the budget (P is lowered by as many). 0: none."),
    click.option("--summary-segment", default=default(PolicyConfig, "summary_segment"), show_default=True,
                 type=click.IntRange(min=1), help="Positions per summary row (the last takes every later one)."),
    click.option("--lower", "lowering", type=click.Choice(LOWERINGS), default=LOWERINGS[0],
                 show_default=True,
                 help="standard: compressed attention and selection in standard ONNX ops (any runtime; "
                      "for TensorRT the selection's TopK needs P <= 3840). plugin: custom op nodes "
                      "SnapKVDecodeAttention / SnapKVSelect for the TensorRT plugin (no budget limit; "
                      "ONNX Runtime runs them through onnxruntime-extensions, float32)."),
)


def _export_config(slots, max_context, chunk, weight_format, block_size, slot_buckets, tail,
                   kv_dtype) -> ExportConfig:
    return ExportConfig(slots=slots, max_context=max_context, chunk=chunk, weight_format=weight_format,
                        block_size=block_size, slot_buckets=slot_buckets, tail=tail, kv_dtype=kv_dtype)


@click.command()
@click.argument("model")
@_export_options
def export(model, output, force, **export_args):
    """Export MODEL to dense-cache ONNX graphs (the baseline the passes rewrite).

    MODEL is a built-in name (smollm2-135m-instruct, tiny-llama, tiny-mistral, tiny-qwen2), a
    Hugging Face folder (config.json + safetensors) or a .gguf file.
    """
    from snapcompile.compiler.route import compile_artifact
    export_cfg = _export_config(**export_args)
    refuse_existing(output, force)
    with export_progress() as (progress, on_tensor):
        manifest = compile_artifact(model, export_cfg, PolicyConfig(policy="dense"), output, force=force,
                                    progress=progress, on_tensor=on_tensor)
    click.echo(f"wrote {output} ({', '.join(manifest.graphs)} graphs); {peak_memory()}")
    warn_requantized_gguf(manifest)


@click.command()
@click.argument("model")
@_export_options
@_policy_options
def convert(model, output, force, lowering, slots, max_context, chunk, weight_format, block_size, slot_buckets,
            tail, kv_dtype, **policy_args):
    """Export MODEL and compress its cache in one go (export + passes).

    The budget bounds the decode cache at B rows per slot whatever the context; prompts up to
    --max-context tokens are compressed to the prompt share P at prefill.
    """
    from snapcompile.compiler.route import compile_artifact
    export_cfg = _export_config(slots, max_context, chunk, weight_format, block_size, slot_buckets, tail, kv_dtype)
    policy = PolicyConfig(**policy_args)
    policy.check_against(export_cfg)
    refuse_existing(output, force)
    with export_progress() as (progress, on_tensor):
        manifest = compile_artifact(model, export_cfg, policy, output, lowering, force=force, progress=progress,
                                    on_tensor=on_tensor)
    click.echo(f"wrote {output}: policy {policy.policy}, {decode_blocks(manifest)} attention blocks rewritten; "
               f"{peak_memory()}")
    warn_requantized_gguf(manifest)


@click.command()
@click.argument("dense_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@_policy_options
def compress(dense_dir, output, force, lowering, **policy_args):
    """Run the compression passes on an existing dense export DENSE_DIR."""
    from snapcompile.passes.pipeline import compress_artifact
    manifest = compress_artifact(dense_dir, output, PolicyConfig(**policy_args), force=force, lowering=lowering)
    click.echo(f"wrote {output}: policy {manifest.policy.policy}, {decode_blocks(manifest)} attention blocks "
               "rewritten")


@contextmanager
def export_progress():
    """Progress bars on stderr over the model's tensors (read, converted and written one at a time) and
    then the dense graphs an export builds (the passes and the save follow); yields the two callbacks
    `compile_artifact` takes. Each bar is drawn at its first update, so a refusal before the work
    (memory, bad arguments) prints its error alone."""
    from snapcompile.cli import progress_bar
    with ExitStack() as stack:
        bars = {}

        def bar(desc: str, unit: str, total: int | None = None):
            if desc not in bars:
                bars[desc] = stack.enter_context(progress_bar(total=total, desc=desc, unit=unit, leave=False))
            return bars[desc]

        def on_tensor(name: str, done: int, count: int) -> None:
            tensors = bar("writing weights", "tensor", count)
            tensors.set_postfix_str(name, refresh=False)
            tensors.update(done - tensors.n)

        def progress(name: str, total: int) -> None:
            graphs = bar("building graphs", "graph", total)
            graphs.set_postfix_str(name, refresh=False)
            graphs.update(1)
        yield progress, on_tensor


def peak_memory() -> str:
    """The summary's memory figure: the weights are read, converted and written to weights.bin one
    tensor at a time and the graphs hold references, so this is the libraries, a few tensors and the
    graphs, whatever the model's size, --slots and --max-context are."""
    from snapcompile.bench.machine import peak_rss_bytes
    from snapcompile.memory import gib
    return f"peak RSS {gib(peak_rss_bytes())}"


def warn_requantized_gguf(manifest) -> None:
    """On stderr: the GGUF's quantized tensors rounded a second time here (K-quants always; Q4_0 /
    Q4_1 / Q8_0 blocks unless kept exactly), by type, with what it cost against the file's own values."""
    report = manifest.weights_report
    count = report.get("gguf_tensors_requantized", 0)
    if not count:
        return
    types = ", ".join(f"{kind} x{n}" for kind, n in report.get("gguf_requantized_types", {}).items())
    error = report.get("gguf_requantized_error")
    cost = f"; relative error median {error['median']:.3g}, worst {error['max']:.3g} ({error['worst']})" \
        if error else ""
    click.echo(f"warning: the GGUF file's quantized blocks of {count} tensor{'s' * (count != 1)}"
               f"{f' ({types})' if types else ''} were quantized again at {manifest.export.weight_format} blocks of "
               f"{manifest.export.block_size}: a second rounding{cost}. The file's blocks are kept exactly only for "
               "Q4_0 / Q4_1 / Q8_0 at --block-size 32 with --weights of at least the file's bits; --weights fp32 "
               "keeps every value; `validate` measures the cost (docs/results/weights.md)", err=True)


def decode_blocks(manifest) -> int:
    """Attention blocks the passes rewrote in the decode graph."""
    return max((p["blocks_rewritten"] for p in manifest.passes if p["graph"] == "decode"), default=0)


def refuse_existing(output: Path, force: bool, marker: str = "manifest.json") -> None:
    """Fail before loading a model when the output may not be written (the atomic writer checks again)."""
    from snapcompile.atomic import check_replaceable, resolve_output
    check_replaceable(resolve_output(output), force, marker)
