"""`snapcompile build`: TensorRT engines from an artifact folder."""
from __future__ import annotations

from pathlib import Path

import click

from snapcompile.cli.convert import refuse_existing


@click.command()
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
    refuse_existing(output, force, ENGINES)
    info = build_engines(artifact, output, fp16=fp16, force=force)
    click.echo(f"wrote {output}: {', '.join(info['engines'])} engines (TensorRT {info['tensorrt']})")
