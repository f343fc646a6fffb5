"""How much a linear layer's values move when its weights are block-quantized again, per block size.

SmolLM2's only weights here are the GGUF file's 4-bit blocks of 32 (Q4_1 / Q4_0 / Q8_0); `convert
--weights int4` keeps them exactly at --block-size 32 and quantizes the file's dequantized values
again (symmetric round to nearest, ONNX Runtime's quantizer) at any other size. This prints, per
layer role, the relative error ||W - Q(W)||_F / ||W||_F of that requantization at each block size
that divides the role's inputs, over every layer (docs/results/weights.md, "Blocks coarser than 32").

    .venv/bin/python studies/block_error.py smollm2-135m-instruct --block-sizes 32,64,128
"""
from __future__ import annotations

import argparse
import json

import numpy as np

ROLES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")


def role_errors(tensors, layers: int, role: str, block_sizes: list[int]) -> dict[int, float | None]:
    """block size -> relative Frobenius error over every layer's `role` weight (None: it does not
    divide the inputs)."""
    from snapcompile.export.quantize import quantize
    squared = dict.fromkeys(block_sizes, 0.0)
    total = 0.0
    for layer in range(layers):
        name = f"model.layers.{layer}.{role}.weight"
        weight = tensors.read(name)
        total += float(np.square(weight, dtype=np.float64).sum())
        for size in block_sizes:
            if weight.shape[1] % size == 0:
                moved = weight - quantize(weight, 4, size, name).dequantize()
                squared[size] += float(np.square(moved, dtype=np.float64).sum())
            else:
                squared[size] = None
    return {size: None if s is None else round((s / total) ** 0.5, 4) for size, s in squared.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model snapcompile loads (built-in name, GGUF, HF folder)")
    parser.add_argument("--block-sizes", default="32,64,128")
    args = parser.parse_args()
    from snapcompile.models import load_model
    loaded = load_model(args.model)
    sizes = [int(s) for s in args.block_sizes.split(",")]
    rows = {role: role_errors(loaded.tensors, loaded.spec.num_layers, role, sizes) for role in ROLES}
    print(json.dumps({"model": args.model, "bits": 4, "relative_error": rows}))
    print("| layer | " + " | ".join(f"blocks of {s}" for s in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for role, errors in rows.items():
        print(f"| {role} | " + " | ".join("—" if errors[s] is None else f"{errors[s]:.4f}" for s in sizes) + " |")


if __name__ == "__main__":
    main()
