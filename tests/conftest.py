"""Shared fixtures: tiny random-weight models and their artifacts (built once per session)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from snapcompile.compiler.route import compile_artifact
from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.export import export_model
from snapcompile.models import load_model

TINY_EXPORT = ExportConfig(slots=3, max_context=512, chunk=64)
TINY_SNAPSTREAM = PolicyConfig(policy="snapstream", budget=64, sinks=4, window=8, kernel=5)
TINY_SUMMARIES = PolicyConfig(policy="snapstream", budget=64, sinks=4, window=8, kernel=5, summaries=4,
                              summary_segment=64)


@pytest.fixture(scope="session")
def tiny_llama():
    return load_model("tiny-llama")


def random_prompts(lengths, seed=0, vocab=250):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


def build_artifact(loaded, folder, export=TINY_EXPORT, policy: PolicyConfig | None = None):
    """The artifact of `loaded` for `export` shapes and `policy` (dense by default) in folder, built as
    `convert` builds it."""
    compile_artifact(loaded, export, policy or PolicyConfig(policy="dense"), folder)
    return folder


@pytest.fixture(scope="session")
def tiny_dense_dir(tiny_llama, tmp_path_factory):
    return build_artifact(tiny_llama, tmp_path_factory.mktemp("art") / "dense")


@pytest.fixture(scope="session")
def tiny_snap_dir(tiny_llama, tmp_path_factory):
    return build_artifact(tiny_llama, tmp_path_factory.mktemp("art") / "snap", policy=TINY_SNAPSTREAM)


@pytest.fixture(scope="session")
def tiny_summary_dir(tiny_llama, tmp_path_factory):
    """tiny_snap_dir's policy with 4 summary rows of 64 positions (passes/cache_bias.py)."""
    return build_artifact(tiny_llama, tmp_path_factory.mktemp("art") / "summaries", policy=TINY_SUMMARIES)


def write_hf_folder(loaded, folder):
    """A Hugging Face model folder of `loaded`: config.json, model.safetensors, tokenizer files."""
    import json

    from safetensors.torch import save_model
    folder.mkdir(parents=True)
    config = loaded.model.config.to_dict()
    config["architectures"] = [loaded.spec.architecture]
    (folder / "config.json").write_text(json.dumps(config))
    save_model(loaded.model, str(folder / "model.safetensors"))
    loaded.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_hf_dir(tiny_llama, tmp_path_factory):
    return write_hf_folder(tiny_llama, tmp_path_factory.mktemp("hf") / "tiny-hf")


@pytest.fixture(scope="session")
def smollm2():
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smol_dense(smollm2, tmp_path_factory):
    """SmolLM2-135M-Instruct, dense, 3 slots, 2304 positions (the slow tests' artifact)."""
    folder = tmp_path_factory.mktemp("smol") / "dense"
    export_model(smollm2, ExportConfig(slots=3, max_context=2304, chunk=256), folder)
    return folder


@pytest.fixture(scope="session")
def smol_snap(smol_dense):
    """The same compressed to B = 256 (snapstream)."""
    from snapcompile.passes.pipeline import compress_artifact
    folder = smol_dense.parent / "snap256"
    compress_artifact(smol_dense, folder, PolicyConfig(policy="snapstream", budget=256))
    return folder


FAULT_SEED = 666


@pytest.fixture
def faulty_sampling(monkeypatch):
    """The engine's sampling raises for requests whose seed is FAULT_SEED: a fault inside one request."""
    from snapcompile.engine import core as engine_module
    real = engine_module.sample

    def sample(logits, params, rng, *tokens):
        if params.seed == FAULT_SEED:
            raise RuntimeError("injected fault")
        return real(logits, params, rng, *tokens)
    monkeypatch.setattr(engine_module, "sample", sample)


def run_results(artifact, prompts, max_new_tokens: int) -> list[dict]:
    """`snapcompile run --json` on `prompts` (greedy): its result rows."""
    import json

    from click.testing import CliRunner

    from snapcompile.cli import main
    args = ["run", str(artifact), "--max-new-tokens", str(max_new_tokens), "--json"]
    for prompt in prompts:
        args += ["--prompt", prompt]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])["results"]


@pytest.fixture
def hf_copy(tiny_hf_dir, tmp_path):
    """A copy of the tiny HF folder, free to damage."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_hf_dir, folder)
    return folder


@pytest.fixture
def artifact(tiny_dense_dir, tmp_path):
    """A copy of the tiny dense artifact, free to damage."""
    copy = tmp_path / "artifact"
    shutil.copytree(tiny_dense_dir, copy)
    return copy


@pytest.fixture
def snap_artifact(tiny_snap_dir, tmp_path):
    """A copy of the tiny snapstream artifact, free to damage."""
    copy = tmp_path / "snap"
    shutil.copytree(tiny_snap_dir, copy)
    return copy
