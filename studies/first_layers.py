"""The first layers of one long prompt prefilled layer by layer (runtime/layer_prefill.py): their peak
RSS beside the artifact's memory figure, and their time, extrapolated to the whole model. A whole
131072-token prompt at the 8B shape takes hours on 2 cores; its first layers show the memory it
holds (one layer's rows and the hidden states) and the pace.

    .venv/bin/python studies/first_layers.py ARTIFACT --tokens 131072 [--layers 2]

Prints one JSON line: the CPU and load, open_s, layer_s (each layer's seconds, the first with the
prompt's embeddings, each to the next layer's first chunk), extrapolated_prefill_s (the median layer
x layers; the head's one row is negligible; with --layers at the model's count, their sum is the
whole prefill), peak_rss_bytes of the process, and the memory figure (`inspect`'s memory_needed, by
part, and their sum). The figure is the worst case of every slot full; one prompt touches one slot's
rows. Each layer's end is also written to stderr as it comes, so a run stopped early keeps its pace.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    import numpy as np

    from snapcompile.artifact.footprint import memory_needed
    from snapcompile.bench.machine import cpu_description, peak_rss_bytes
    from snapcompile.runtime import open_backend
    start = time.perf_counter()
    backend = open_backend(args.artifact)
    open_s = time.perf_counter() - start
    prefills = backend.prefills
    if not hasattr(prefills, "layers_done"):
        raise SystemExit(f"{args.artifact} is not prefilled layer by layer (manifest prefill_order)")
    prompt = np.random.default_rng(0).integers(0, backend.manifest.spec.vocab_size, args.tokens).tolist()
    chunks = backend.prefill_chunks(0, prompt)
    began, ends = time.perf_counter(), []
    layers = min(args.layers, backend.manifest.spec.num_layers)
    while len(ends) < layers:                   # a layer is seen done at the next layer's first chunk
        try:
            next(chunks)
        except StopIteration:                   # or at the prefill's end
            pass
        if prefills.layers_done > len(ends):
            ends.append(time.perf_counter())
            print(f"layer {len(ends)} done at {ends[-1] - began:.1f} s", file=sys.stderr, flush=True)
    chunks.close()
    layer_s = [b - a for a, b in zip([began, *ends[:-1]], ends)]
    needed, all_layers = memory_needed(backend.manifest), backend.manifest.spec.num_layers
    print(json.dumps({"artifact": args.artifact, "tokens": args.tokens, "cpu": cpu_description(), "open_s": open_s,
                      "layer_s": layer_s, "extrapolated_prefill_s": statistics.median(layer_s) * all_layers,
                      "peak_rss_bytes": peak_rss_bytes(), "memory_needed": needed,
                      "memory_needed_bytes": sum(needed.values())}))


if __name__ == "__main__":
    main()
