"""Peer systems for `bench --peers`: ONNX Runtime GenAI builds of the same model.

A peer model is built once with ONNX Runtime GenAI's own builder (`python -m
onnxruntime_genai.models.builder -i <HF folder> -o <dir> -p <precision> -e cpu --extra_options
prune_lm_head=true`) from the safetensors folder of the model being measured, and cached. Each
point runs in a subprocess (`python -m snapcompile.bench.peers`), so the peer's runtime and
memory never mix with snapcompile's: it appends `slots` random prompts of `context` tokens,
then times `steps` decode steps of the whole batch (greedy, no early stop).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from snapcompile.errors import SnapcompileError, first_line

PEER_PRECISIONS = ("fp32", "int4")
BUILDER = "onnxruntime_genai.models.builder"


def require_genai() -> None:
    import importlib.util
    if importlib.util.find_spec("onnxruntime_genai") is None or importlib.util.find_spec("onnx_ir") is None:
        raise SnapcompileError('--peers needs ONNX Runtime GenAI: pip install "snapcompile[peers]" '
                               "(onnxruntime-genai and onnx-ir)")


def build_peer(hf_folder: Path, precision: str, cache_dir: Path, log=print) -> Path:
    """The ONNX Runtime GenAI model of `hf_folder` at `precision`, built once into cache_dir."""
    require_genai()
    stamp = hashlib.sha1(f"{Path(hf_folder).resolve()}|{precision}".encode()).hexdigest()[:12]
    target = Path(cache_dir) / f"ortgenai-{precision}-{stamp}"
    if (target / "genai_config.json").is_file():
        return target
    log(f"building the ONNX Runtime GenAI {precision} peer of {hf_folder} (once)")
    staging = target.with_name(target.name + ".partial")
    command = [sys.executable, "-m", BUILDER, "-i", str(hf_folder), "-o", str(staging), "-p", precision,
               "-e", "cpu", "-c", str(staging / "cache"), "--extra_options", "prune_lm_head=true"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not (staging / "genai_config.json").is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SnapcompileError(f"the ONNX Runtime GenAI builder failed for {precision}: {tail[0]}")
    staging.rename(target)
    return target


class PeerModel:
    """A built peer model folder, measured point by point in subprocesses."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        config = json.loads((self.folder / "genai_config.json").read_text())["model"]["decoder"]
        rows = config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_size"]
        self.kv_bytes_per_token = 2 * rows * 4          # K and V, float32

    def decode_seconds(self, context: int, slots: int, steps: int, seed: int = 0) -> tuple[list[float], int]:
        """(seconds of each decode step, peak RSS of the subprocess in bytes) at one point."""
        command = [sys.executable, "-m", "snapcompile.bench.peers", str(self.folder), str(context), str(slots),
                   str(steps), str(seed)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SnapcompileError(f"the ONNX Runtime GenAI peer failed at context {context}, {slots} slots: "
                                   f"{first_line((done.stderr or 'no output').strip().splitlines()[-1])}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        return result["step_seconds"], result["peak_rss_bytes"]


def _measure(model_dir: str, context: int, slots: int, steps: int, seed: int) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    from snapcompile.bench.machine import peak_rss_bytes
    model = og.Model(model_dir)
    vocab = json.loads((Path(model_dir) / "genai_config.json").read_text())["model"]["vocab_size"]
    prompts = np.random.default_rng(seed).integers(0, vocab, size=(slots, context), dtype=np.int32)
    params = og.GeneratorParams(model)
    total = context + steps + 1
    params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=slots)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompts)
    prefill = time.perf_counter() - start
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        generator.generate_next_token()
        seconds.append(time.perf_counter() - start)
    return {"step_seconds": seconds, "prefill_seconds": prefill, "peak_rss_bytes": peak_rss_bytes()}


if __name__ == "__main__":
    folder, context, slots, steps, seed = sys.argv[1], *map(int, sys.argv[2:6])
    print(json.dumps(_measure(folder, context, slots, steps, seed)))
