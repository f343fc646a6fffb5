#!/usr/bin/env python3
"""GPU checks in one command: kernel parity on CUDA and decode-attention timings.

Needs only a CUDA GPU, PyTorch and Triton (no ONNX Runtime, no install of this repo):
    python scripts/gpu_check.py [--quick] [--json OUT.json]
1. the Triton fused decode-attention kernel vs the PyTorch reference on CUDA (fp32, fp16;
   several budgets, GQA ratios, ring wrapped and not), and selection on CUDA (reference and with
   the Triton window-score kernel) vs CPU;
2. timings (CUDA events, median of repeats): the fused kernel vs the standard-op path (the same
   ops as the ONNX subgraph, run as PyTorch ops) over the budget, and vs dense attention over the
   full context; GB/s counts the K/V bytes each step must read;
3. TensorRT plugin registration, if TensorRT is importable.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

MODELS = {"smollm2-135m": (3, 3, 64), "llama-8b": (8, 4, 128)}   # KV heads, group, head dim


def _plugin(name: str):
    """A module of the plugins package: installed as snapcompile.plugins, or this checkout's
    plugins/ folder (a GPU machine gets a copy of the working tree, not an install)."""
    try:
        return importlib.import_module(f"snapcompile.plugins.{name}")
    except ImportError:
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))          # snapcompile/ and plugins/ of the checkout
        return importlib.import_module(f"plugins.{name}")


def _case(slots, kv_heads, group, rows, dim, dtype, wrapped, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)
    cache_len = torch.full((slots,), rows if wrapped else rows // 2, dtype=torch.int64, device="cuda")
    write = (cache_len - 1) if wrapped else cache_len.clone()
    return (rand(slots, kv_heads, group, dim), rand(slots, kv_heads, 1, dim), rand(slots, kv_heads, 1, dim),
            rand(slots, kv_heads, rows, dim), rand(slots, kv_heads, rows, dim), write, cache_len)


def check_parity(quick: bool) -> list[dict]:
    torch_ops, triton_kernels = _plugin("torch_ops"), _plugin("triton_kernels")
    rows = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 5e-3)):
        for budget in ((256,) if quick else (64, 256, 1000, 2048)):
            for group in (1, 3, 4):
                for wrapped in (False, True):
                    args = _case(4, 2, group, budget, 64, dtype, wrapped, seed=budget + group)
                    expected = torch_ops.decode_attention(*args, scale=0.125).float()
                    got = triton_kernels.decode_attention(*args, scale=0.125).float()
                    err = (got - expected).abs().max().item()
                    rows.append({"dtype": str(dtype).split(".")[1], "budget": budget, "group": group,
                                 "wrapped": wrapped, "max_abs_err": err, "ok": err <= tol})
    return rows


def check_selection_on_cuda() -> dict:
    """Selection on CUDA (PyTorch reference, and with the Triton window-score kernel) vs CPU."""
    triton_kernels = _plugin("triton_kernels")

    from snapcompile.config import PolicyConfig
    from snapcompile.reference.policy import snapkv_select, window_scores
    policy = PolicyConfig(budget=256, window=32)
    gen = torch.Generator().manual_seed(0)
    query, keys = torch.randn(9, 32, 64, generator=gen), torch.randn(3, 2000, 64, generator=gen)
    cpu = snapkv_select(query, keys, policy, 0.125).indices
    gpu = snapkv_select(query.cuda(), keys.cuda(), policy, 0.125).indices.cpu()
    kernel = snapkv_select(query.cuda(), keys.cuda(), policy, 0.125, scorer=triton_kernels.window_scores).indices.cpu()
    score_err = (triton_kernels.window_scores(query.cuda(), keys.cuda(), 0.125).cpu()
                 - window_scores(query, keys, 0.125)).abs().max().item()
    return {"selection_equal_cpu_cuda": bool(torch.equal(cpu, gpu)),
            "positions_differing": int((cpu != gpu).sum()),
            "triton_scorer_positions_differing": int((cpu != kernel).sum()),
            "triton_window_score_max_abs_err": score_err}


def _time_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def time_decode(quick: bool) -> list[dict]:
    torch_ops, triton_kernels = _plugin("torch_ops"), _plugin("triton_kernels")
    rows = []
    contexts = (4096, 32768) if quick else (4096, 16384, 65536)
    for model, (kv_heads, group, dim) in MODELS.items():
        for slots in ((8,) if quick else (1, 8, 32)):
            for context in contexts:
                budget = 512 if context <= 8192 else 2048
                for path, rows_read in (("fused-kernel", budget), ("standard-ops", budget), ("dense-ops", context)):
                    args = _case(slots, kv_heads, group, rows_read, dim, torch.float16, wrapped=True)
                    attend = triton_kernels.decode_attention if path == "fused-kernel" else torch_ops.decode_attention
                    micros = _time_us(functools.partial(attend, *args, scale=dim ** -0.5), 20 if quick else 50)
                    kv_bytes = 2 * slots * kv_heads * rows_read * dim * 2
                    rows.append({"model": model, "path": path, "budget": budget, "context": context,
                                 "slots": slots, "us": micros, "GB/s": kv_bytes / micros / 1e3})
    return rows


def check_tensorrt() -> str:
    try:
        import tensorrt
    except ImportError:
        return "TensorRT not importable here: plugin registration and engine builds skipped"
    register = _plugin("trt_plugin").register
    register()
    return f"TensorRT {tensorrt.__version__}: plugins snapcompile::SnapKVDecodeAttention and SnapKVSelect registered"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases (under a minute)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU tests cover the interpreter path)")
        return 2
    began = time.time()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    parity = check_parity(args.quick)
    bad = [r for r in parity if not r["ok"]]
    print(f"\n[parity] {len(parity) - len(bad)}/{len(parity)} kernel cases within tolerance; worst "
          f"{max(r['max_abs_err'] for r in parity):.2e}")
    for r in bad:
        print(f"  FAIL {r}")
    selection = check_selection_on_cuda()
    print(f"[selection] CUDA vs CPU reference equal: {selection['selection_equal_cpu_cuda']} "
          f"({selection['positions_differing']} positions differ); Triton scorer: "
          f"{selection['triton_scorer_positions_differing']} positions differ, window-score error "
          f"{selection['triton_window_score_max_abs_err']:.2e}")
    timings = time_decode(args.quick)
    print(f"\n{'model':<14}{'path':<14}{'budget':>7}{'context':>9}{'slots':>6}{'us':>10}{'GB/s':>9}")
    for r in timings:
        print(f"{r['model']:<14}{r['path']:<14}{r['budget']:>7}{r['context']:>9}{r['slots']:>6}"
              f"{r['us']:>10.1f}{r['GB/s']:>9.1f}")
    trt_status = check_tensorrt()
    print(f"\n[tensorrt] {trt_status}\n[done] {time.time() - began:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"parity": parity, "selection": selection, "timings": timings,
                                         "tensorrt": trt_status}, indent=2))
    return 1 if bad or not selection["selection_equal_cpu_cuda"] else 0


if __name__ == "__main__":
    sys.exit(main())
