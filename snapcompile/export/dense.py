"""`snapcompile export`: a loaded model -> a dense-cache artifact folder: the static prefill and decode
graphs, and the graphs ONNX Runtime opens (one a family, its size symbolic, and the tail)."""
from __future__ import annotations

from functools import partial
from pathlib import Path

from snapcompile.artifact.footprint import check_memory
from snapcompile.artifact.manifest import ORT_WEIGHTS, WEIGHTS, Manifest
from snapcompile.artifact.naming import (
    PREFILL_EMBED,
    PREFILL_HEAD,
    PREFILL_SCORES,
    TAIL_GRAPH,
    graph_name,
    ort_size,
    prefill_layer,
)
from snapcompile.artifact.onnx_io import GraphSet, WeightsFile, WeightStores, save_graphs
from snapcompile.atomic import atomic_directory
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.errors import SnapcompileError
from snapcompile.export.llama_graph import (
    DecodeWriter,
    PrefillEmbedWriter,
    PrefillHeadWriter,
    PrefillLayerWriter,
    PrefillWriter,
)
from snapcompile.export.weights import Quantizer, Weights
from snapcompile.graphs.builder import SymbolicSize
from snapcompile.graphs.checks import check_graph
from snapcompile.graphs.editor import input_dim_params
from snapcompile.models.loader import LoadedModel


def check_export_config(loaded: LoadedModel, export: ExportConfig) -> None:
    spec = loaded.spec
    if export.max_context > spec.max_positions:
        raise SnapcompileError(
            f"--max-context {export.max_context} exceeds the model's {spec.max_positions} positions")
    if spec.sliding_window is not None and spec.sliding_window < export.max_context and not spec.local_layers:
        raise SnapcompileError(
            f"{loaded.name} uses sliding-window attention ({spec.sliding_window} tokens); "
            f"--max-context {export.max_context} must not exceed it")


def build_dense_graphs(loaded: LoadedModel, export: ExportConfig, store: WeightsFile | None = None,
                       progress=None, on_tensor=None, ort_store: WeightsFile | None = None) -> tuple[GraphSet, dict]:
    """The dense graphs (static and ONNX Runtime's), and the quantization report (empty for fp32
    weights). progress(name, total), when given, is called as each of the total graphs is built; on_tensor(name, done,
    total) as each of the model's tensors is read (the weights are read, converted and written one
    tensor at a time, before the graphs).

    store, ort_store: the weights.bin and ort_weights.bin the weights are written to while the graphs
    are built, so the graphs hold references only and memory does not grow with the number of graphs
    (--slots, --max-context buckets); None keeps the weights in each graph (in-memory use, tests)."""
    check_export_config(loaded, export)
    quantizer = None
    if export.quantized:
        gguf = None
        if loaded.gguf is not None:
            from snapcompile.export.gguf_blocks import GGUFBlocks
            gguf = GGUFBlocks(loaded.gguf, loaded.config)
        quantizer = Quantizer(export, gguf, gguf.quantized_types() if gguf is not None else None)
    weights = Weights(loaded.tensors, loaded.spec, loaded.config, quantizer, half=export.weight_format == "fp16",
                      store=store, progress=on_tensor, ort_store=ort_store)
    static = _static_writers(loaded.spec, weights, export, store)
    ort = {ORT_LABEL + name: writer for name, writer in _ort_writers(loaded.spec, weights, export, store,
                                                                      ort_store).items()}
    built = _build({**static, **ort}, progress)
    graphs = GraphSet({name: built[name] for name in static},
                      {name.removeprefix(ORT_LABEL): built[name] for name in ort})
    for name, model in graphs.static.items():
        check_graph(model, name)
    for name, model in graphs.ort.items():
        check_graph(model, ORT_LABEL + name, strict=False, symbolic=input_dim_params(model))
    report = {"format": export.weight_format, "weight_bytes": weights.nbytes(),
              "step_weight_bytes": weights.step_nbytes()}
    return graphs, report | (quantizer.report() if quantizer else {})


ORT_LABEL = "ONNX Runtime's "      # progress and errors name ONNX Runtime's graphs so


def _build(writers: dict, progress) -> dict:
    """name -> model of each writer's graph (ONNX Runtime's, named with ORT_LABEL, keep only the
    weights they read); progress(name, total) after each."""
    graphs = {}
    for name, writer in writers.items():
        graphs[name] = writer().build().model(used_only=name.startswith(ORT_LABEL))
        if progress is not None:
            progress(name, len(writers))
    return graphs


def _static_writers(spec, weights: Weights, export: ExportConfig, store) -> dict:
    """Graph name -> writer of every static graph: prefill, its buckets, the decode slot buckets, the tail."""
    writers = {"prefill": lambda: PrefillWriter(spec, weights, export, store=store)}
    for slots in export.decode_sizes():
        writers[graph_name("decode", slots, export.slots)] = partial(DecodeWriter, spec, weights, export, store, slots)
    for rows in export.prefill_buckets():
        writers[graph_name("prefill", rows, export.max_context)] = partial(PrefillWriter, spec, weights, export,
                                                                           rows, store)
    if export.tail:
        writers[TAIL_GRAPH] = partial(PrefillWriter, spec, weights, export, store=store, chunk=export.tail,
                                      name=TAIL_GRAPH)
    return writers


def _ort_writers(spec, weights: Weights, export: ExportConfig, store, ort_store) -> dict:
    """Graph name -> writer of ONNX Runtime's graphs: the prefill and decode families (their size
    symbolic), the tail, and the layer-by-layer prefill's embeddings, layers (each a family over the
    prefill buckets' rows) and head (naming.ort_graphs). The passes add the select graphs."""
    stores = None if store is None else WeightStores(store, *(() if ort_store is None else (ort_store,)))
    rows = family_size("prefill", export.max_context, spec.local_layers)
    writers = {"prefill": partial(PrefillWriter, spec, weights, export, rows, stores, target="ort"),
               "decode": partial(DecodeWriter, spec, weights, export, stores, family_size("decode", export.slots),
                                 target="ort")}
    if export.tail:
        writers[TAIL_GRAPH] = partial(PrefillWriter, spec, weights, export, store=stores, chunk=export.tail,
                                      name=TAIL_GRAPH, target="ort")
    writers[PREFILL_EMBED] = partial(PrefillEmbedWriter, spec, weights, export, stores, target="ort")
    layer_rows = family_size(prefill_layer(0), export.max_context)      # a local layer's graph ignores it
    for layer in range(spec.num_layers):
        writers[prefill_layer(layer)] = partial(PrefillLayerWriter, spec, weights, export, layer, layer_rows, stores)
    writers[PREFILL_HEAD] = partial(PrefillHeadWriter, spec, weights, export, stores, target="ort")
    writers[PREFILL_SCORES] = partial(PrefillHeadWriter, spec, weights, export, stores, target="ort", rows=export.chunk)
    return writers


def family_size(family: str, largest: int, local_layers=()) -> SymbolicSize:
    """The symbolic size of `family`'s ONNX Runtime graph (naming.ort_size), at most `largest`."""
    size = ort_size(family, local_layers)
    return SymbolicSize(size.name, size.source, size.axis, largest)


def eos_ids(tokenizer) -> list[int]:
    """Token ids that end a generation: the tokenizer's EOS plus <|im_end|> where it exists."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(ids)


def new_manifest(loaded: LoadedModel, export: ExportConfig, policy: PolicyConfig) -> Manifest:
    return Manifest(model_name=loaded.name, spec=loaded.spec, export=export, policy=policy,
                    chat=loaded.chat, eos_token_ids=eos_ids(loaded.tokenizer), source=loaded.source)


def export_model(loaded: LoadedModel, export: ExportConfig, out_dir: Path, force: bool = False,
                 policy: PolicyConfig | None = None, transform=None, progress=None, on_tensor=None) -> Manifest:
    """Write a dense artifact to out_dir atomically.

    transform(graphs, manifest), when given, rewrites the graphs before they are saved (the
    passes use it so `convert` writes one artifact instead of a dense one then a compressed one).
    progress(name, graphs), on_tensor(name, done, total): called as each dense graph is built and each of the
    model's tensors is read (`build_dense_graphs`).
    """
    policy = policy or PolicyConfig(policy="dense")
    policy.check_against(export)
    check_memory(new_manifest(loaded, export, policy))
    with atomic_directory(Path(out_dir), force=force) as staging:
        with WeightsFile(staging / WEIGHTS) as store, WeightsFile(staging / ORT_WEIGHTS) as ort_store:
            graphs, weights_report = build_dense_graphs(loaded, export, store, progress, on_tensor, ort_store)
        manifest = new_manifest(loaded, export, PolicyConfig(policy="dense"))
        manifest.weights_report = weights_report
        if transform is not None:
            graphs = transform(graphs, manifest)
        loaded.tokenizer.save_pretrained(staging)
        save_graphs(staging, graphs, manifest, weights_source=staging / WEIGHTS,
                    ort_weights_source=staging / ORT_WEIGHTS)
    return manifest
