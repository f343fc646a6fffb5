"""`snapcompile inspect`: what an artifact holds and what it needs to run."""
from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="Check every file against its sha256 in the manifest (--no-verify: sizes only).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(artifact, verify, as_json):
    """Show an artifact's model, policy, rewritten blocks, KV bytes per slot and memory needed."""
    from snapcompile.artifact.files import check_files
    from snapcompile.artifact.footprint import memory_needed
    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.artifact.onnx_io import load_graph, load_ort_graph
    manifest = read_manifest(artifact)
    check_files(artifact, manifest, checksums=verify, remembered=False)
    for name in manifest.graphs:
        load_graph(artifact, manifest, name)
    for name in manifest.ort_graphs:
        load_ort_graph(artifact, manifest, name)
    info = {"model": manifest.model_name, "policy": manifest.policy.to_dict(),
            "export": manifest.export.to_dict(), "lowering": manifest.lowering,
            "graphs": sorted(manifest.graphs),
            "blocks_rewritten": {p["graph"]: p["blocks_rewritten"] for p in manifest.passes},
            "passes": [p["pass"] for p in manifest.passes],
            "weights_report": manifest.weights_report, "weights_file_bytes": manifest.files["weights.bin"]["bytes"],
            "kv_dtype": manifest.export.kv_dtype, "kv_bytes_per_slot": manifest.kv_bytes_per_slot(),
            "dense_kv_bytes_per_slot": manifest.dense_kv_bytes_per_slot(),
            "kv_bytes_total": manifest.kv_bytes_per_slot() * manifest.export.slots,
            "kv_bytes_per_slot_by_layer_kind": manifest.kv_bytes_by_layer_kind(),
            "memory_needed_bytes": memory_needed(manifest), "checksums_verified": verify}
    if as_json:
        click.echo(json.dumps(info))
        return
    ratio = info["kv_bytes_per_slot"] / info["dense_kv_bytes_per_slot"]
    click.echo(f"model          {info['model']} ({manifest.spec.architecture}, {manifest.spec.num_layers} layers)")
    click.echo(f"policy         {json.dumps(info['policy'])}")
    click.echo(f"shapes         slots {manifest.export.slots}, max context {manifest.export.max_context}, "
               f"chunk {manifest.export.chunk}, tail {manifest.export.tail or 'none'}")
    click.echo(f"graphs         {', '.join(info['graphs'])}")
    click.echo(f"rewritten      {info['blocks_rewritten'] or 'nothing (dense)'} by {', '.join(info['passes']) or '-'}")
    click.echo(f"weights        {_weights_line(manifest, info['weights_file_bytes'])}")
    click.echo(f"KV per slot    {_mib(info['kv_bytes_per_slot'])} in {manifest.export.kv_dtype} (dense at max context: "
               f"{_mib(info['dense_kv_bytes_per_slot'])}, ratio {ratio:.3f})")
    ring = manifest.window_ring
    if ring is not None:
        kinds = info["kv_bytes_per_slot_by_layer_kind"]
        local = len(manifest.spec.local_layers)
        click.echo(f"  by layer     {manifest.spec.num_layers - local} global layers {_mib(kinds['global'])} "
                   f"({manifest.rows_per_slot} rows each), {local} local layers {_mib(kinds['local'])} (a ring of "
                   f"{ring.rows} rows each: the {ring.window}-token window and a chunk)")
    needed = info["memory_needed_bytes"]
    parts = ", ".join(f"{purpose} {_mib(size)}" for purpose, size in needed.items())
    click.echo(f"memory to run  {_mib(sum(needed.values()))} ({parts})")
    checked = "sha256 verified" if verify else "sizes checked (not sha256)"
    click.echo(f"files          {len(manifest.files)}, {checked}")


def _weights_line(manifest, file_bytes: int) -> str:
    report, export = manifest.weights_report, manifest.export
    line = f"{export.weight_format}"
    if export.quantized:
        line += (f" (blocks of {export.block_size}, LM head {report.get('head_bits')}-bit; GGUF blocks kept "
                 f"{report.get('exact_blocks')}, quantized here {report.get('requantized_blocks')})")
        error = report.get("gguf_requantized_error")
        if error:
            line += (f"; {report['gguf_tensors_requantized']} GGUF tensors quantized again, relative error median "
                     f"{error['median']:.3g}, worst {error['max']:.3g}")
    return line + f", weights.bin {_mib(file_bytes)}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
