"""Write a built-in random shape (`random:llama-3.2-1b`, ...) as a Hugging Face folder, so a peer
(OpenVINO GenAI through optimum-cli, llama.cpp's converter) reads the very weights snapcompile
converts: config.json, bf16 safetensors written one shard per layer (memory: one layer), and the
tokenizer files of TOKENIZER_FOLDER (any tokenizer whose ids fit the vocabulary: the peers' random
prompts are token ids).

    .venv/bin/python studies/random_folder.py random:llama-3.2-1b OUT --tokenizer TOKENIZER_FOLDER

Any other model snapcompile loads is written the same way; `--dtype float32` keeps its values exactly
and, without --tokenizer, the model's own tokenizer is saved (SmolLM2's GGUF values as float
weights, which `convert --weights int4` quantizes at every block size, 32 included:
docs/results/weights.md, "Blocks coarser than 32"):

    .venv/bin/python studies/random_folder.py smollm2-135m-instruct OUT --dtype float32

`--positions N` writes the config with N max_position_embeddings (a tiny model that can generate
16000 tokens for `studies/engine_overhead.py`):

    .venv/bin/python studies/random_folder.py tiny-llama OUT --dtype float32 --positions 32768
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def write_folder(name: str, out: Path, tokenizer: Path | None, dtype: str = "bfloat16",
                 positions: int | None = None) -> None:
    import torch
    from safetensors.torch import save_file

    from snapcompile.models import load_model
    loaded = load_model(name)
    out.mkdir(parents=True)
    config = loaded.config.to_dict() | {"architectures": [loaded.spec.architecture], "torch_dtype": dtype}
    if positions is not None:
        config["max_position_embeddings"] = positions
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shards: dict[str, list[str]] = {}
    for tensor in loaded.tensors.shapes:
        key = tensor.split(".")[2] if tensor.startswith("model.layers.") else "top"
        shards.setdefault(key, []).append(tensor)
    weight_map = {}
    for index, names in enumerate(shards.values()):
        file = f"model-{index:05d}.safetensors"
        save_file({n: torch.from_numpy(loaded.tensors.read(n)).to(getattr(torch, dtype)) for n in names},
                  str(out / file))
        weight_map.update(dict.fromkeys(names, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if tokenizer is None:
        loaded.tokenizer.save_pretrained(out)
        return
    for file in TOKENIZER_FILES:
        if (tokenizer / file).is_file():
            shutil.copy(tokenizer / file, out / file)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", type=Path, help="a folder whose tokenizer files are copied (default: the "
                        "model's own tokenizer, saved)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--positions", type=int, help="max_position_embeddings of the written config")
    args = parser.parse_args()
    write_folder(args.name, args.out, args.tokenizer, args.dtype, args.positions)


if __name__ == "__main__":
    main()
