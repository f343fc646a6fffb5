"""The export front end: a loaded model -> static dense ONNX graphs and an artifact folder.

`dense.py` writes the artifact; `llama_graph.py` builds the prefill and decode graphs of a
Llama-family decoder (with `snapcompile.graphs`' builder and cached-attention subgraph), and
`weights.py` / `quantize.py` store their weights in the chosen format. The names below load
lazily, so importing this package pulls no torch."""

__all__ = ["build_dense_graphs", "check_export_config", "eos_ids", "export_model", "new_manifest"]


def __getattr__(name):
    if name in __all__:
        from snapcompile.export import dense
        return getattr(dense, name)
    raise AttributeError(name)
