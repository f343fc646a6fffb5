"""The `snapcompile` command line. User mistakes end in one `error:` line and exit code 2."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import click

from snapcompile.config import LOWERINGS, POLICIES, POOLINGS, SCOPES, WEIGHT_FORMATS
from snapcompile.errors import ParityError, SnapcompileError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class _Group(click.Group):
    """Every user error (ours or click's usage errors) is one `error:` line and exit code 2;
    SIGTERM unwinds like Ctrl-C, so staging folders are removed on the way out."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as err:
            click.echo(f"error: {_one_line(err.format_message())}", err=True)
            code = EXIT_USER_ERROR
        except (click.Abort, KeyboardInterrupt):
            click.echo("error: interrupted", err=True)
            code = EXIT_INTERRUPTED
        finally:
            signal.signal(signal.SIGTERM, previous)
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SnapcompileError as err:
            click.echo(f"error: {_one_line(str(err))}", err=True)
            ctx.exit(EXIT_USER_ERROR if not isinstance(err, ParityError) else 1)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _one_line(message: str) -> str:
    return " ".join(message.split())


@click.group(cls=_Group)
@click.version_option(package_name="snapcompile")
def main():
    """SnapStream fixed-budget KV-cache compression for ONNX Runtime and TensorRT.

    Typical flow: `convert` a model to a compressed artifact folder, `inspect` it, `run` prompts
    through it, and `validate` it against PyTorch.
    """


def _export_options(func):
    for option in reversed([
        click.option("--slots", default=4, show_default=True, help="Decode batch slots N (static)."),
        click.option("--max-context", default=2048, show_default=True,
                     help="Longest prompt (+ generation, for dense) in tokens: the dense cache length L."),
        click.option("--chunk", default=256, show_default=True, help="Prefill chunk length in tokens."),
        click.option("--weights", type=click.Choice(WEIGHT_FORMATS), default="fp32", show_default=True,
                     help="How linear layers and the LM head are stored: fp32, or int8 / int4 blocks (weight-only; "
                          "int4 keeps the head 8-bit). From a GGUF with 4/8-bit blocks the file's own values are kept "
                          "where the format holds them exactly."),
        click.option("--block-size", default=32, show_default=True,
                     help="Inputs per int8/int4 quantization block (a power of two >= 16 dividing every layer's "
                          "input size; GGUF blocks are kept only at 32)."),
        click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path),
                     help="Artifact folder to write (atomically)."),
        click.option("--force", is_flag=True, help="Replace the output folder if it exists."),
    ]):
        func = option(func)
    return func


def _policy_options(func):
    for option in reversed([
        click.option("--policy", type=click.Choice(POLICIES),
                     default="snapstream", show_default=True, help="Cache policy."),
        click.option("--budget", default=512, show_default=True, help="KV slots per sequence B."),
        click.option("--sinks", default=4, show_default=True, help="Attention-sink tokens S always kept."),
        click.option("--window", default=32, show_default=True, help="Observation window W (last prompt queries)."),
        click.option("--kernel", default=15, show_default=True, help="Pooling width K (odd)."),
        click.option("--pooling", type=click.Choice(POOLINGS), default="max", show_default=True,
                     help="How window scores are pooled along positions."),
        click.option("--scope", type=click.Choice(SCOPES), default="head", show_default=True,
                     help="Select per KV head, or one position set per layer."),
        click.option("--prompt-share", type=int, default=None,
                     help="Budget rows for the compressed prompt P (default: B minus a ring of >= B/4)."),
        click.option("--lower", "lowering", type=click.Choice(LOWERINGS), default="standard",
                     show_default=True,
                     help="standard: compressed attention and selection in standard ONNX ops (any runtime; "
                          "for TensorRT the selection's TopK needs P <= 3840). plugin: custom op nodes "
                          "SnapKVDecodeAttention / SnapKVSelect for the TensorRT plugin (no budget limit; "
                          "ONNX Runtime runs them through onnxruntime-extensions, float32)."),
    ]):
        func = option(func)
    return func


def _policy(policy, budget, sinks, window, kernel, pooling, scope, prompt_share):
    from snapcompile.config import PolicyConfig
    return PolicyConfig(policy=policy, budget=budget, sinks=sinks, window=window, kernel=kernel,
                        pooling=pooling, scope=scope, prompt_share=prompt_share)


@main.command()
@click.argument("model")
@_export_options
def export(model, slots, max_context, chunk, weights, block_size, output, force):
    """Export MODEL to dense-cache ONNX graphs (the baseline the passes rewrite).

    MODEL is a built-in name (smollm2-135m-instruct, tiny-llama, tiny-mistral, tiny-qwen2), a
    Hugging Face folder (config.json + safetensors) or a .gguf file.
    """
    from snapcompile.config import ExportConfig
    from snapcompile.export import export_model
    from snapcompile.models import load_model
    export_cfg = ExportConfig(slots=slots, max_context=max_context, chunk=chunk, weights=weights,
                              block_size=block_size)
    _refuse_existing(output, force)
    manifest = export_model(load_model(model), export_cfg, output, force=force)
    click.echo(f"wrote {output} ({', '.join(manifest.graphs)} graphs)")


@main.command()
@click.argument("model")
@_export_options
@_policy_options
def convert(model, slots, max_context, chunk, weights, block_size, output, force, lowering, **policy_args):
    """Export MODEL and compress its cache in one go (export + passes).

    The budget bounds the decode cache at B rows per slot whatever the context; prompts up to
    --max-context tokens are compressed to the prompt share P at prefill.
    """
    from snapcompile.config import ExportConfig
    from snapcompile.export import export_model
    from snapcompile.models import load_model
    from snapcompile.passes.pipeline import compress_graphs
    export_cfg = ExportConfig(slots=slots, max_context=max_context, chunk=chunk, weights=weights,
                              block_size=block_size)
    policy = _policy(**policy_args)
    policy.check_against(export_cfg)
    _refuse_existing(output, force)
    manifest = export_model(load_model(model), export_cfg, output, force=force, policy=policy,
                            transform=lambda graphs, m: compress_graphs(graphs, m, policy, lowering))
    click.echo(f"wrote {output}: policy {policy.policy}, {_blocks(manifest)} attention blocks rewritten")


@main.command()
@click.argument("dense_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@_policy_options
def compress(dense_dir, output, force, lowering, **policy_args):
    """Run the compression passes on an existing dense export DENSE_DIR."""
    from snapcompile.passes.pipeline import compress_artifact
    manifest = compress_artifact(dense_dir, output, _policy(**policy_args), force=force, lowering=lowering)
    click.echo(f"wrote {output}: policy {manifest.policy.policy}, {_blocks(manifest)} attention blocks rewritten")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check every file against its sha256 in the manifest (--no-verify: sizes only).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(artifact, verify, as_json):
    """Show an artifact's model, policy, rewritten blocks, KV bytes per slot and memory needed."""
    from snapcompile.artifact.files import check_files
    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.artifact.onnx_io import load_graph
    from snapcompile.runtime.backend import memory_needed
    manifest = read_manifest(artifact)
    check_files(artifact, manifest, checksums=verify)
    for name in manifest.graphs:
        load_graph(artifact, manifest, name)
    info = {"model": manifest.model_name, "policy": manifest.policy.to_dict(),
            "export": manifest.export.to_dict(), "lowering": manifest.lowering,
            "graphs": sorted(manifest.graphs),
            "blocks_rewritten": {p["graph"]: p["blocks_rewritten"] for p in manifest.passes},
            "passes": [p["pass"] for p in manifest.passes],
            "weights": manifest.weights, "weights_file_bytes": manifest.files["weights.bin"]["bytes"],
            "kv_bytes_per_slot": manifest.kv_bytes_per_slot(),
            "dense_kv_bytes_per_slot": manifest.dense_kv_bytes_per_slot(),
            "kv_bytes_total": manifest.kv_bytes_per_slot() * manifest.export.slots,
            "memory_needed_bytes": memory_needed(manifest), "checksums_verified": verify}
    if as_json:
        click.echo(json.dumps(info))
        return
    ratio = info["kv_bytes_per_slot"] / info["dense_kv_bytes_per_slot"]
    click.echo(f"model          {info['model']} ({manifest.spec.architecture}, {manifest.spec.num_layers} layers)")
    click.echo(f"policy         {json.dumps(info['policy'])}")
    click.echo(f"shapes         slots {manifest.export.slots}, max context {manifest.export.max_context}, "
               f"chunk {manifest.export.chunk}")
    click.echo(f"graphs         {', '.join(info['graphs'])}")
    click.echo(f"rewritten      {info['blocks_rewritten'] or 'nothing (dense)'} by {', '.join(info['passes']) or '-'}")
    click.echo(f"weights        {_weights_line(manifest, info['weights_file_bytes'])}")
    click.echo(f"KV per slot    {_mib(info['kv_bytes_per_slot'])} (dense at max context: "
               f"{_mib(info['dense_kv_bytes_per_slot'])}, ratio {ratio:.3f})")
    needed = info["memory_needed_bytes"]
    parts = ", ".join(f"{purpose} {_mib(size)}" for purpose, size in needed.items())
    click.echo(f"memory to run  {_mib(sum(needed.values()))} ({parts})")
    checked = "sha256 verified" if verify else "sizes checked (not sha256)"
    click.echo(f"files          {len(manifest.files)}, {checked}")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Engine folder to write.")
@click.option("--fp16", is_flag=True, help="Let TensorRT run layers in float16 (I/O stays float32).")
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
def build(artifact, output, fp16, force):
    """Build TensorRT engines (prefill, decode, select) from an artifact folder.

    Needs TensorRT 10.8+ and a CUDA GPU (pip install "snapcompile[trt]"). Every graph is first
    checked against TensorRT 10's ONNX-parser support matrix (a violation names its node). All
    graphs have static shapes, so no optimization profiles are needed. Budgets: the standard lowering's selection
    uses TopK with k = prompt share, which TensorRT limits to 3840; the plugin lowering
    (`convert --lower plugin`) has no such limit. Run the engines with `run --backend trt`.
    """
    from snapcompile.runtime.trt_backend import ENGINES, build_engines
    _refuse_existing(output, force, ENGINES)
    info = build_engines(artifact, output, fp16=fp16, force=force)
    click.echo(f"wrote {output}: {', '.join(info['engines'])} engines (TensorRT {info['tensorrt']})")


def _add_commands() -> None:
    """The commands with more options live in modules of their own."""
    from snapcompile.cli.bench import bench
    from snapcompile.cli.eval import eval_command
    from snapcompile.cli.run import run, validate
    from snapcompile.cli.serve import bench_serve, serve
    from snapcompile.cli.triton import triton_repo, triton_serve
    for command in (run, validate, serve, bench_serve, triton_repo, triton_serve, eval_command, bench):
        main.add_command(command)


_add_commands()


def _blocks(manifest) -> int:
    return max((p["blocks_rewritten"] for p in manifest.passes if p["graph"] == "decode"), default=0)


def _weights_line(manifest, file_bytes: int) -> str:
    report, export = manifest.weights, manifest.export
    line = f"{export.weights}"
    if export.quantized:
        line += (f" (blocks of {export.block_size}, LM head {report.get('head_bits')}-bit; GGUF blocks kept "
                 f"{report.get('exact_blocks')}, quantized here {report.get('requantized_blocks')})")
    return line + f", weights.bin {_mib(file_bytes)}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _refuse_existing(output: Path, force: bool, marker: str = "manifest.json") -> None:
    """Fail before loading a model when the output may not be written (the atomic writer checks again)."""
    from snapcompile.artifact.atomic import check_replaceable, resolve_output
    check_replaceable(resolve_output(output), force, marker)

