"""The `snapcompile` command line. User mistakes end in one `error:` line and exit code 2."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from snapcompile.errors import ParityError, SnapcompileError

EXIT_USER_ERROR = 2


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SnapcompileError as err:
            click.echo(f"error: {err}", err=True)
            ctx.exit(EXIT_USER_ERROR if not isinstance(err, ParityError) else 1)


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
        click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path),
                     help="Artifact folder to write (atomically)."),
        click.option("--force", is_flag=True, help="Replace the output folder if it exists."),
    ]):
        func = option(func)
    return func


def _policy_options(func):
    for option in reversed([
        click.option("--policy", type=click.Choice(["snapstream", "streamingllm", "dense"]),
                     default="snapstream", show_default=True, help="Cache policy."),
        click.option("--budget", default=512, show_default=True, help="KV slots per sequence B."),
        click.option("--sinks", default=4, show_default=True, help="Attention-sink tokens S always kept."),
        click.option("--window", default=32, show_default=True, help="Observation window W (last prompt queries)."),
        click.option("--kernel", default=15, show_default=True, help="Pooling width K (odd)."),
        click.option("--pooling", type=click.Choice(["max", "avg"]), default="max", show_default=True),
        click.option("--scope", type=click.Choice(["head", "layer"]), default="head", show_default=True,
                     help="Select per KV head, or one position set per layer."),
        click.option("--prompt-share", type=int, default=None,
                     help="Budget rows for the compressed prompt P (default: B minus a ring of >= B/4)."),
        click.option("--lower", "lowering", type=click.Choice(["standard", "plugin"]), default="standard",
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
def export(model, slots, max_context, chunk, output, force):
    """Export MODEL to dense-cache ONNX graphs (the baseline the passes rewrite).

    MODEL is a built-in name (smollm2-135m-instruct, tiny-llama, tiny-mistral, tiny-qwen2), a
    Hugging Face folder (config.json + safetensors) or a .gguf file.
    """
    from snapcompile.config import ExportConfig
    from snapcompile.export import export_model
    from snapcompile.models import load_model
    export_cfg = ExportConfig(slots=slots, max_context=max_context, chunk=chunk)
    _refuse_existing(output, force)
    manifest = export_model(load_model(model), export_cfg, output, force=force)
    click.echo(f"wrote {output} ({', '.join(manifest.graphs)} graphs)")


@main.command()
@click.argument("model")
@_export_options
@_policy_options
def convert(model, slots, max_context, chunk, output, force, lowering, **policy_args):
    """Export MODEL and compress its cache in one go (export + passes).

    The budget bounds the decode cache at B rows per slot whatever the context; prompts up to
    --max-context tokens are compressed to the prompt share P at prefill.
    """
    from snapcompile.config import ExportConfig
    from snapcompile.export import export_model
    from snapcompile.models import load_model
    from snapcompile.passes.pipeline import compress_graphs
    export_cfg = ExportConfig(slots=slots, max_context=max_context, chunk=chunk)
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
    from snapcompile.compress import compress_artifact
    manifest = compress_artifact(dense_dir, output, _policy(**policy_args), force=force, lowering=lowering)
    click.echo(f"wrote {output}: policy {manifest.policy.policy}, {_blocks(manifest)} attention blocks rewritten")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(artifact, as_json):
    """Show an artifact's model, policy, rewritten blocks and KV bytes per slot."""
    from snapcompile.artifact import load_graph, read_manifest
    manifest = read_manifest(artifact)
    for name in manifest.graphs:
        load_graph(artifact, manifest, name)
    info = {"model": manifest.model_name, "policy": manifest.policy.to_dict(),
            "export": manifest.export.to_dict(), "lowering": manifest.lowering,
            "graphs": sorted(manifest.graphs),
            "blocks_rewritten": {p["graph"]: p["blocks_rewritten"] for p in manifest.passes},
            "passes": [p["pass"] for p in manifest.passes],
            "kv_bytes_per_slot": manifest.kv_bytes_per_slot(),
            "dense_kv_bytes_per_slot": manifest.dense_kv_bytes_per_slot(),
            "kv_bytes_total": manifest.kv_bytes_per_slot() * manifest.export.slots}
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
    click.echo(f"KV per slot    {_mib(info['kv_bytes_per_slot'])} (dense at max context: "
               f"{_mib(info['dense_kv_bytes_per_slot'])}, ratio {ratio:.3f})")


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Engine folder to write.")
@click.option("--fp16", is_flag=True, help="Let TensorRT run layers in float16 (I/O stays float32).")
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
def build(artifact, output, fp16, force):
    """Build TensorRT engines (prefill, decode, select) from an artifact folder.

    Needs TensorRT 10.8+ and a CUDA GPU (pip install "snapcompile[trt]"). All graphs have static
    shapes, so no optimization profiles are needed. Budgets: the standard lowering's selection
    uses TopK with k = prompt share, which TensorRT limits to 3840; the plugin lowering
    (`convert --lower plugin`) has no such limit. Run the engines with `run --backend trt`.
    """
    from snapcompile.runtime.trt_backend import build_engines
    _refuse_existing(output, force)
    info = build_engines(artifact, output, fp16=fp16, force=force)
    click.echo(f"wrote {output}: {', '.join(info['engines'])} engines (TensorRT {info['tensorrt']})")


from snapcompile.cli_bench import bench  # noqa: E402  (commands with more options)
from snapcompile.cli_eval import eval_command  # noqa: E402
from snapcompile.cli_run import run, validate  # noqa: E402

main.add_command(run)
main.add_command(validate)
main.add_command(eval_command)
main.add_command(bench)


def _blocks(manifest) -> int:
    return max((p["blocks_rewritten"] for p in manifest.passes if p["graph"] == "decode"), default=0)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _refuse_existing(output: Path, force: bool) -> None:
    """Fail before loading a model when the output exists (the atomic writer checks again)."""
    if Path(output).exists() and not force:
        raise SnapcompileError(f"output {output} already exists (use --force to replace it)")


if __name__ == "__main__":
    sys.exit(main())
