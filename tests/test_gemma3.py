"""Integration on the second real model: Gemma 3 270M (base), the Q4_K_M GGUF assembled from its PyPI
packages. Its 15 local layers (a 512-token sliding window) hold window rings; its 3 global layers
the policy's rows."""
import pytest

from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.models import load_model
from snapcompile.passkeys import passkey_text
from snapcompile.prompts import encode
from snapcompile.validate.parity import Validator, oracle_model, summarize
from tests.conftest import build_artifact

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma-3-270m")


def test_the_built_in_is_the_gguf_and_its_layers_are_local_and_global(gemma3):
    from snapcompile.models.loader import _gemma3_gguf, _load_gguf
    spec = gemma3.spec
    assert (spec.architecture, spec.num_layers, spec.num_kv_heads, spec.head_dim) == ("Gemma3ForCausalLM", 18, 1, 256)
    assert spec.sliding_window == 512 and spec.global_layers == [5, 11, 17] and not gemma3.chat
    assert _load_gguf(_gemma3_gguf(), "gguf").spec == spec
    assert encode(gemma3.tokenizer, "The capital of France is", chat=False)[0] == gemma3.tokenizer.bos_token_id


def test_dense_past_the_window_equals_transformers_and_continues_text(gemma3, tmp_path):
    from snapcompile.engine.engine import Engine
    from snapcompile.engine.request import Request
    folder = build_artifact(gemma3, tmp_path / "dense", export=ExportConfig(slots=2, max_context=1536, chunk=64))
    prompts = [encode(gemma3.tokenizer, text, chat=False) for text in
               ("The capital of France is", passkey_text(71234, 45, 0.3))]
    assert len(prompts[1]) > 1024          # twice the window: every local ring has wrapped
    summary = summarize(Validator(folder, gemma3.model).run(prompts, 24), 24)
    assert summary["greedy_agreement"] == 1.0 and summary["max_abs_logit_diff"] <= 1e-3
    engine = Engine.from_artifact(folder)
    result = engine.generate([Request(prompts[0], max_new_tokens=8)])[0]
    assert result.text.startswith(" the capital of the country of France")


def test_snapstream_int8_selects_in_its_global_layers_only_and_resumes_a_turn(gemma3, tmp_path):
    from snapcompile.artifact.manifest import read_manifest
    policy = PolicyConfig(policy="snapstream", budget=512)
    folder = build_artifact(gemma3, tmp_path / "snap", policy=policy,
                            export=ExportConfig(slots=2, max_context=4096, chunk=64, weight_format="int8"))
    manifest = read_manifest(folder)
    assert manifest.kv_bytes_by_layer_kind() == {"global": 3 * 512 * 2 * 256 * 4, "local": 15 * 576 * 2 * 256 * 4}
    prompt = encode(gemma3.tokenizer, passkey_text(40963, 120, 0.5), chat=False)
    assert len(prompt) > 2500                 # five times the budget
    summary = summarize(Validator(folder, oracle_model(folder, manifest)).run([prompt], 16), 16)
    assert summary["compressed_prompts"] == 1 and not summary["selection_mismatches"]
    assert summary["greedy_agreement"] == 1.0 and summary["max_abs_logit_diff"] <= 5e-3
    follow_up = encode(gemma3.tokenizer, "\n\nWhat is the pass key? Answer with the number only, and then say "
                       "where in the text it was found.", chat=False)[1:]          # no second <bos>
    validator = Validator(folder, oracle_model(folder, manifest))
    turns = summarize(validator.run_turns([prompt], 16, 2, follow_up), 16)         # turn 2 resumes, rings too
    window = manifest.policy.selection_window
    assert turns["resumed_tokens"][1] == min(len(prompt) + 16, len(prompt) + 17 + len(follow_up) - window)
    assert not turns["selection_mismatches"]
    assert turns["greedy_agreement"] == 1.0 and turns["max_abs_logit_diff"] <= 5e-3
