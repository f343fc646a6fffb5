"""`compile_artifact`: a model and a configuration -> an artifact folder. `export`, `convert` and every
measuring tool (eval, eval-ruler, eval-turns, bench, bench-turns, through ArtifactCache) build
artifacts here, so the artifacts a table measures are the ones users convert."""
from __future__ import annotations

from pathlib import Path

from snapcompile.artifact.manifest import Manifest
from snapcompile.config import ExportConfig, PolicyConfig


def compile_artifact(model, export: ExportConfig, policy: PolicyConfig, output: Path, lowering: str = "standard",
                     force: bool = False, progress=None, on_tensor=None) -> Manifest:
    """Write the artifact of `export` shapes and `policy` for `model` to `output` atomically: the dense
    graphs, rewritten by the passes before they are saved when the policy compresses, and their cache
    inputs and outputs in `export.kv_dtype`.

    model: a loaded model (snapcompile.models.LoadedModel) or what `load_model` takes (a built-in
    name, a Hugging Face folder, a .gguf file). progress(name, graphs), on_tensor(name, done, total): called as
    each dense graph is built and as each of the model's tensors is read."""
    from snapcompile.export import export_model
    from snapcompile.models import load_model
    from snapcompile.models.loader import LoadedModel
    from snapcompile.passes.pipeline import check_kv_lowering, compress_graphs, store_kv
    policy.check_against(export)
    check_kv_lowering(export, lowering)
    loaded = model if isinstance(model, LoadedModel) else load_model(model)

    def transform(graphs, manifest):
        return store_kv(compress_graphs(graphs, manifest, policy, lowering), manifest)
    return export_model(loaded, export, Path(output), force=force, policy=policy, transform=transform,
                        progress=progress, on_tensor=on_tensor)
