"""`eval-turns` and `bench-turns` on tiny-llama; the token-level conversation against SmolLM2's chat template."""
import json

import pytest
from transformers import AutoTokenizer

from snapcompile.errors import SnapcompileError
from snapcompile.evaluation.conversation_eval import TurnsConfig, TurnsStore, next_turn_tokens, retention
from snapcompile.prompts import encode_messages, encode_text
from tests.cli_helpers import invoke


@pytest.fixture(scope="module")
def smol_tokenizer():
    from snapcompile.models.loader import _smollm2_folder
    return AutoTokenizer.from_pretrained(str(_smollm2_folder()))


def test_next_turn_tokens_continue_the_chat_template(smol_tokenizer):
    tok = smol_tokenizer
    first, answer, question = "Where is the key?", "The key is under the mat.", "And the door?"
    whole = encode_messages(tok, [{"role": "user", "content": first}, {"role": "assistant", "content": answer},
                                  {"role": "user", "content": question}])
    start, reply = encode_messages(tok, [{"role": "user", "content": first}]), encode_text(tok, answer)
    assert start + reply + [tok.eos_token_id] + next_turn_tokens(tok, question, True, True) == whole
    assert start + reply + next_turn_tokens(tok, question, True, False) == whole        # cut before its EOS
    assert next_turn_tokens(tok, question, False, True) == encode_text(tok, "\n\n" + question)


def test_retention_per_turn_against_dense():
    def record(mode, case, correct):
        return {"mode": mode, "case": case, "turns": [{"turn": t + 1, "correct": c} for t, c in enumerate(correct)]}
    records = [record("dense", "a", [True, True]), record("dense", "b", [True, False]),
               record("resume", "a", [True, False]), record("resume", "b", [True, True])]
    rows = {(r["mode"], r["turn"]): r for r in retention(records)}
    assert rows[("resume", 1)]["share_of_dense"] == 1.0 and rows[("resume", 2)]["accuracy"] == 0.5
    assert rows[("resume", 2)]["share_of_dense"] == 1.0 and rows[("resume", 2)]["dense_sure_kept"] == 0.0


def test_rows_kept_of_counts_heads_holding_the_whole_span():
    import numpy as np

    from snapcompile.evaluation.conversation_eval import rows_kept_of
    from snapcompile.sessions.kept import KeptCache
    rows = np.zeros((2, 3, 1), np.float32)
    heads = [np.array([[0, 2, 3], [0, 1, 2]]), np.array([[2, 3, 4], [0, 1, 4]])]   # per layer [Hkv=2, 3]
    kept = KeptCache(np.arange(5), (rows, rows), (rows, rows), tuple(heads))
    ids = [7, 9, 5, 6, 9]
    assert rows_kept_of(kept, ids, [5, 6]) == 0.5, "span at positions 2-3: 1 head of 2 in each layer"
    assert rows_kept_of(kept, ids, [9]) == 0.5, "the first occurrence (position 1) counts"
    assert rows_kept_of(kept, ids, [4]) is None


def test_turns_store_resumes_and_refuses_another_configuration(tmp_path):
    output = tmp_path / "turns.json"
    store = TurnsStore(output, TurnsConfig("tiny-llama", samples=2))
    store.add({"id": "dense/L3000/s0", "mode": "dense", "case": "L3000/s0", "turns": []})
    assert list(TurnsStore(output, TurnsConfig("tiny-llama", samples=2)).records) == ["dense/L3000/s0"]
    with pytest.raises(SnapcompileError, match="another eval-turns configuration"):
        TurnsStore(output, TurnsConfig("tiny-llama", samples=3))


def test_eval_turns_runs_every_mode(tmp_path):
    result = invoke("eval-turns", "tiny-llama", "--lengths", 700, "--samples", 2, "--kinds", "dates,two-documents",
                    "--cache-dir", tmp_path / "cache", "-o", tmp_path / "turns.json", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "turns.json").read_text())
    records = {(r["mode"], r["kind"]): r["turns"] for r in payload["records"]}
    assert sorted({mode for mode, _ in records}) == ["dense", "reprefill", "resume", "resume-full", "ring"]
    assert {kind for _, kind in records} == {"dates", "two-documents"}
    by_mode = {mode: turns for (mode, kind), turns in records.items() if kind == "dates"}
    assert all(len(t) == 5 for t in by_mode.values())
    assert by_mode["reprefill"][0]["text"] == by_mode["resume"][0]["text"] == by_mode["ring"][0]["text"]
    assert all(t["cached_tokens"] == 0 for mode in ("dense", "reprefill") for t in by_mode[mode])
    resumed = [t["cached_tokens"] for t in by_mode["resume"]]
    assert resumed[0] == 0 and all(later > earlier for earlier, later in zip(resumed[1:], resumed[2:]))
    prompts = [t["prompt_tokens"] for t in by_mode["resume"]]
    assert all(cached < tokens for cached, tokens in zip(resumed, prompts))
    assert {(r["mode"], r["turn"]) for r in payload["retention"]} == {(m, t) for m in by_mode for t in range(1, 6)}
    assert all(0.0 <= t["asked_kept"] <= 1.0 for t in by_mode["resume"]), "the asked answer's rows, per turn"
    assert all(t["asked_kept"] is None for mode in ("dense", "reprefill", "ring", "resume-full") for t in by_mode[mode])
    full = [t["cached_tokens"] for t in by_mode["resume-full"]]
    assert full[0] == 0 and all(c > 0 for c in full[1:]), "every later turn resumed from the full entry"
    assert [t["text"] for t in by_mode["resume-full"]] == [t["text"] for t in by_mode["reprefill"]], \
        "the default mode answers every turn as prefilling it whole does"
    later = {r["mode"]: r for r in payload["later_turns"]}
    assert later["resume-full"]["answers"] == 2 * 4
    assert later["resume-full"]["of_reprefill_kept"] == later["reprefill"]["reprefill_right"]
    assert "Later turns (2..5) together" in (tmp_path / "turns.md").read_text()
    assert not (tmp_path / "turns.json.partial.jsonl").exists()


def test_bench_turns_reports_ttft_per_turn_and_kept_bytes(tmp_path):
    result = invoke("bench-turns", "tiny-llama", "--turns", 3, "--turn-tokens", 300, "--answer-tokens", 8,
                    "--repeats", 1, "--chunk", 64, "--cache-dir", tmp_path / "cache", "-o", tmp_path / "b.json",
                    "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "b.json").read_text())
    rows = {(r["mode"], r["turn"]): r for r in payload["medians"]}
    assert len(rows) == 5 * 3 and all(r["ttft_median_s"] > 0 for r in rows.values())
    for mode in ("dense", "reprefill"):
        assert all(rows[(mode, t)]["cached_tokens"] == 0 for t in (1, 2, 3))
    for mode in ("dense-resume", "resume", "resume-full"):
        cached = [rows[(mode, t)]["cached_tokens"] for t in (1, 2, 3)]
        assert cached[0] == 0 and cached[2] > cached[1] > 0
    kept = {r["mode"]: r["kept_bytes"] for r in payload["runs"]}
    assert kept["resume"] < kept["dense-resume"] and kept["dense"] is None
    assert kept["resume-full"] > kept["resume"], "every prompt row, not B"
    assert "TTFT of turn 3 / turn 1" in (tmp_path / "b.md").read_text()


def test_bench_turns_times_the_modes_asked_with_summaries(tmp_path):
    from tests.cli_helpers import assert_one_line_error
    common = ["--turns", 3, "--turn-tokens", 300, "--answer-tokens", 8, "--repeats", 1, "--chunk", 64,
              "--cache-dir", tmp_path / "cache"]
    result = invoke("bench-turns", "tiny-llama", *common, "--modes", "resume,reprefill", "--kernel", 7,
                    "--summaries", 4, "-o", tmp_path / "b.json", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "b.json").read_text())
    assert {r["mode"] for r in payload["medians"]} == {"resume", "reprefill"}
    kept = {r["mode"]: r["kept_bytes"] for r in payload["runs"]}
    assert kept["reprefill"] is None and kept["resume"] > 0
    assert "4 summary rows" in (tmp_path / "b.md").read_text()
    assert_one_line_error(invoke("bench-turns", "tiny-llama", *common, "--modes", "resume,colour",
                                 "-o", tmp_path / "x.json"), "--modes must be among")


def test_bench_turns_times_the_quantized_store(tmp_path):
    """--modes resume-quantized (not a default mode): its later turns resume, its entry holds the
    dropped rows in 4 bits beside the B rows in 8."""
    result = invoke("bench-turns", "tiny-llama", "--turns", 3, "--turn-tokens", 300, "--answer-tokens", 8,
                    "--repeats", 1, "--chunk", 64, "--kernel", 7, "--modes", "resume,resume-quantized",
                    "--cache-dir", tmp_path / "cache", "-o", tmp_path / "b.json", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "b.json").read_text())
    rows = {(r["mode"], r["turn"]): r for r in payload["medians"]}
    assert [rows[("resume-quantized", t)]["cached_tokens"] for t in (1, 2, 3)] == \
        [rows[("resume", t)]["cached_tokens"] for t in (1, 2, 3)]
    assert rows[("resume-quantized", 3)]["cached_tokens"] > 0
    kept = {r["mode"]: r["kept_bytes"] for r in payload["runs"]}
    assert 0 < kept["resume-quantized"] != kept["resume"]


def test_eval_turns_takes_dense_from_a_reference_run(tmp_path):
    from tests.cli_helpers import assert_one_line_error
    common = ["--lengths", 700, "--samples", 1, "--cache-dir", tmp_path / "cache"]
    first = invoke("eval-turns", "tiny-llama", *common, "--modes", "dense", "-o", tmp_path / "dense.json")
    assert first.exit_code == 0, first.output
    variant = invoke("eval-turns", "tiny-llama", *common, "--modes", "resume", "--kernel", 7, "--summaries", 4,
                     "--reference", tmp_path / "dense.json", "-o", tmp_path / "k7.json", "--json")
    assert variant.exit_code == 0, variant.output
    payload = json.loads((tmp_path / "k7.json").read_text())
    assert {r["mode"] for r in payload["records"]} == {"resume"}
    assert {r["mode"] for r in payload["retention"]} == {"dense", "resume"}
    assert payload["config"]["summaries"] == 4 and "4 summary rows" in (tmp_path / "k7.md").read_text()
    other = invoke("eval-turns", "tiny-llama", "--lengths", 700, "--samples", 2, "--cache-dir", tmp_path / "cache",
                   "--modes", "resume", "--reference", tmp_path / "dense.json", "-o", tmp_path / "x.json")
    assert_one_line_error(other, "ran other conversations (samples differ)")


def test_eval_turns_on_an_int8_cache(tmp_path):
    from tests.cli_helpers import assert_one_line_error
    common = ["--lengths", 700, "--samples", 1, "--kinds", "dates", "--kv-dtype", "int8",
              "--cache-dir", tmp_path / "cache"]
    result = invoke("eval-turns", "tiny-llama", *common, "--modes", "reprefill,resume-full", "-o",
                    tmp_path / "int8.json", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "int8.json").read_text())
    assert payload["config"]["kv_dtype"] == "int8" and "int8 KV cache" in (tmp_path / "int8.md").read_text()
    turns = {r["mode"]: r["turns"] for r in payload["records"]}
    assert all(t["cached_tokens"] > 0 for t in turns["resume-full"][1:])
    assert [t["text"] for t in turns["resume-full"]] == [t["text"] for t in turns["reprefill"]], \
        "a full keep of int8 rows answers as prefilling each turn whole"
    artifacts = [m.parent for m in (tmp_path / "cache").rglob("manifest.json")]
    assert artifacts and all(json.loads((a / "manifest.json").read_text())["export"]["kv_dtype"] == "int8"
                             for a in artifacts)
    quantized = invoke("eval-turns", "tiny-llama", *common, "--modes", "resume-quantized", "-o", tmp_path / "q.json")
    assert_one_line_error(quantized, "stores them so already")
    summaries = invoke("eval-turns", "tiny-llama", *common, "--summaries", 4, "-o", tmp_path / "s.json")
    assert_one_line_error(summaries, "int8")


def _exact_attention(query, keys, values, visible):
    from snapcompile.reference.oracle import _attend
    return _attend(query, keys[None], values[None], query.shape[-1] ** -0.5, visible)


def test_a_summary_row_weighs_as_the_rows_it_stands_for_when_they_share_a_key():
    import torch

    from snapcompile.reference import oracle
    torch.manual_seed(0)
    hkv, group, dim, kept, new, copies = 2, 3, 8, 5, 4, 6
    query = torch.randn(1, hkv * group, new, dim)
    keys, values = torch.randn(hkv, kept + new, dim), torch.randn(hkv, kept + new, dim)
    dropped_k = torch.randn(hkv, 1, dim).expand(-1, copies, -1)         # one key, `copies` rows
    dropped_v = torch.randn(hkv, copies, dim)
    visible = torch.cat([torch.ones(new, copies + kept, dtype=torch.bool), torch.ones(new, new).tril().bool()], 1)
    exact = _exact_attention(query, torch.cat([dropped_k, keys], 1), torch.cat([dropped_v, values], 1), visible)
    bias = torch.full((hkv, 1), float(copies)).log()
    summary = oracle.summary_attention(query, keys, values, kept, dim ** -0.5, dropped_k[:, :1],
                                      dropped_v.mean(1, keepdim=True), bias)
    torch.testing.assert_close(summary, exact)
    unweighted = oracle.summary_attention(query, keys, values, kept, dim ** -0.5, dropped_k[:, :1],
                                         dropped_v.mean(1, keepdim=True), torch.zeros(hkv, 1))
    assert not torch.allclose(unweighted, exact)
    empty = oracle.summary_attention(query, keys, values, kept, dim ** -0.5, dropped_k[:, :1],
                                    dropped_v.mean(1, keepdim=True), torch.full((hkv, 1), float("-inf")))
    torch.testing.assert_close(empty, _exact_attention(query, keys, values, visible[:, copies:]))


