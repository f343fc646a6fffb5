"""studies/resume_study.py and studies/turn_margins.py: the conversation studies' variants against the
oracle, on tiny-llama."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.study


def _script(name: str):
    """studies/NAME.py as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, f"studies/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resume_study():
    return _script("resume_study")


def test_all_rows_resume_attends_like_a_dense_prefill_of_the_whole_conversation(tiny_llama):
    import torch

    from snapcompile.config import PolicyConfig
    from snapcompile.reference.oracle import ReferenceSequence
    study = _resume_study()
    prompt, more = [5 + i % 200 for i in range(200)], [7 + i % 50 for i in range(40)]
    plain = PolicyConfig(budget=96, kernel=7)
    summed = PolicyConfig(budget=96, kernel=7, summaries=4, summary_segment=64)
    dense = ReferenceSequence(tiny_llama.model, PolicyConfig(policy="dense"), 260).feed(prompt + more)
    for variant, policy, equal in (("all-rows", plain, True), ("resume", plain, False), ("summary", summed, False)):
        sequence = study.study_sequence_type(variant)(tiny_llama.model, policy, policy.slot_rows)
        sequence.feed(prompt)
        resumed = sequence.resume(prompt + more, len(prompt))
        assert torch.allclose(resumed, dense, atol=1e-4) == equal, variant
        assert len(sequence.caches[0].row_positions[0]) == policy.slot_rows
    for cache in sequence.caches:       # summary: every position is kept or summed once
        dropped = [len(prompt + more) - cache.layout.kept] * cache.summary_counts.shape[0]
        assert cache.summary_counts.sum(dim=1).tolist() == dropped


def test_resume_study_refuses_unknown_variants():
    bad = subprocess.run([sys.executable, "studies/resume_study.py", "--variants", "dense,colour"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "colour" in bad.stderr and "Traceback" not in bad.stderr
    empty = subprocess.run([sys.executable, "studies/resume_study.py", "--first", "4", "--samples", "4"],
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "--first in 0 .. --samples - 1" in empty.stderr


def test_resume_study_takes_dense_only_from_a_run_of_the_same_conversations(tmp_path):
    common = [sys.executable, "studies/resume_study.py", "--model", "tiny-llama", "--length", "700", "--kernel", "7"]
    dense = tmp_path / "dense.json"
    done = subprocess.run([*common, "--samples", "1", "--variants", "dense", "--json", str(dense)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    again = subprocess.run([*common, "--samples", "1", "--variants", "summary-decode", "--reference", str(dense),
                            "--json", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    payload = json.loads((tmp_path / "s.json").read_text())
    assert {r["variant"] for r in payload["records"]} == {"dense", "summary-decode"}
    assert payload["summary"]["dense"] == json.loads(dense.read_text())["summary"]["dense"]
    margins = subprocess.run([sys.executable, "studies/turn_margins.py", str(tmp_path / "s.json")],
                             capture_output=True, text=True, timeout=300)
    assert margins.returncode == 0, margins.stderr
    assert "summary-decode  kept" in margins.stdout and "tune/numbers/L700/s0:" in margins.stderr
    other = subprocess.run([*common, "--samples", "2", "--variants", "summary", "--reference", str(dense)],
                           capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "samples differ" in other.stderr and "Traceback" not in other.stderr


def test_summary_decode_without_dropped_rows_decodes_as_the_oracle(tiny_llama):
    import torch

    from snapcompile.config import PolicyConfig
    study = _resume_study()
    prompt = [5 + i % 200 for i in range(120)]
    policy = PolicyConfig(budget=160, kernel=7, prompt_share=124, summaries=2, summary_segment=64)
    plain, summed = (study.study_sequence_type(v)(tiny_llama.model, policy, policy.slot_rows)
                     for v in ("resume", "summary-decode"))
    logits = [plain.feed(prompt), summed.feed(prompt)]
    assert summed.caches[0].summary_counts.sum() == 0, "the prompt fits: nothing dropped, every summary empty"
    for _ in range(6):
        token = int(logits[0].argmax())
        logits = [plain.feed([token]), summed.feed([token])]
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def test_turn_margins_teacher_forced_top2_equals_the_greedy_steps(tiny_llama):
    import torch

    from snapcompile.config import PolicyConfig
    from snapcompile.reference.oracle import ReferenceSequence
    margins = _script("turn_margins")
    prompt, answer, steps = [5 + i % 200 for i in range(150)], [], []
    sequence = ReferenceSequence(tiny_llama.model, PolicyConfig(policy="dense"), 170)
    logits = sequence.feed(prompt)
    for _ in range(6):
        steps.append(torch.log_softmax(logits, dim=-1).topk(2))
        answer.append(int(steps[-1].indices[0]))
        logits = sequence.feed([answer[-1]])
    ids = prompt + answer + [9, 10, 11]
    top, = margins.teacher_forced_top2(tiny_llama.model, ids, [(len(prompt), len(prompt) + len(answer))])
    assert top.indices.tolist() == [s.indices.tolist() for s in steps]
    torch.testing.assert_close(top.values, torch.stack([s.values for s in steps]), atol=1e-4, rtol=1e-4)


def test_segment_scores_find_the_segment_of_the_largest_logit():
    import torch

    study = _resume_study()
    torch.manual_seed(0)
    rows = torch.randn(1, 12, 4) * 0.1
    rows[0, 9] = torch.tensor([5.0, 0.0, 0.0, 0.0])      # segment 2 holds the key the window matches
    window = torch.zeros(1, 4, 4)
    window[..., 0] = 1.0
    segment, dropped = torch.arange(12) // 4, torch.ones(1, 12, dtype=torch.bool)
    for by in ("max", "quest"):
        assert study.segment_scores(by, window, rows, dropped, segment, 3).argmax().item() == 2, by
        dropped[0, 9] = False                             # kept: no longer a candidate to recompute
        assert study.segment_scores(by, window, rows, dropped, segment, 3).argmax().item() != 2, by
        dropped[0, 9] = True
    dropped[0, 4:8] = False
    assert study.segment_scores("max", window, rows, dropped, segment, 3)[0, 1] == float("-inf"), "nothing dropped"


def test_recompute_of_no_summary_is_summary_and_of_the_first_segment_is_exact(tiny_llama):
    import torch

    from snapcompile.config import PolicyConfig
    from snapcompile.reference.oracle import ReferenceSequence
    study = _resume_study()
    prompt, more = [5 + i % 200 for i in range(200)], [7 + i % 50 for i in range(40)]
    summed = PolicyConfig(budget=96, kernel=7, summaries=4, summary_segment=64)

    def conversation(variant, recall):
        sequence = study.study_sequence_type(variant, recall)(tiny_llama.model, summed, summed.slot_rows)
        sequence.feed(prompt)
        logits = [sequence.resume(prompt + more, len(prompt))]
        for _ in range(4):
            logits.append(sequence.feed([int(logits[-1].argmax())]))
        return sequence, torch.stack(logits)
    _, summary = conversation("summary", 2)
    _, unchanged = conversation("recompute", 0)
    torch.testing.assert_close(unchanged, summary, atol=1e-4, rtol=1e-4)
    recomputed, every = conversation("recompute", 4)
    assert not torch.allclose(every, summary, atol=1e-4)
    dense = ReferenceSequence(tiny_llama.model, PolicyConfig(policy="dense"), 260, record_window=1)
    dense.feed(prompt)
    for cache, layer in zip(recomputed.caches, dense.recorded_prefill()):
        key, value, positions = cache.recomputed[0]          # positions 0..63: nothing earlier to miss
        assert positions.tolist() == list(range(64))
        torch.testing.assert_close(key, layer.keys[:, :64], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(value, layer.values[:, :64], atol=1e-4, rtol=1e-4)
        assert len(cache.row_positions[0]) == summed.slot_rows
    first = len(prompt)
    for cache in recomputed.caches:      # every position before the new tokens is seen once, exactly
        width = summed.window
        earlier = [rows[:, : rows.shape[1] - width] for rows in cache.new_rows]
        _, _, bias, positions = cache.window_rows(*earlier)
        for head_bias, head_positions in zip(bias, positions):
            seen = head_positions[torch.isfinite(head_bias) & (head_positions >= 0)].tolist()
            assert sorted(seen) == list(range(first + earlier[0].shape[1]))


def test_all_rows_in_half_the_layers_and_resume_in_the_others(tiny_llama):
    import torch

    from snapcompile.config import PolicyConfig
    study = _resume_study()
    prompt, more = [5 + i % 200 for i in range(200)], [7 + i % 50 for i in range(40)]
    plain = PolicyConfig(budget=96, kernel=7)
    resumed = {}
    for variant in ("all-rows", "all-rows-early", "all-rows-late", "resume"):
        sequence = study.study_sequence_type(variant)(tiny_llama.model, plain, plain.slot_rows)
        sequence.feed(prompt)
        resumed[variant] = sequence.resume(prompt + more, len(prompt))
        every = [hasattr(cache, "all_keys") for cache in sequence.caches]
        half = len(every) // 2
        expected = {"all-rows": [True] * len(every), "resume": [False] * len(every),
                    "all-rows-early": [i < half for i in range(len(every))],
                    "all-rows-late": [i >= half for i in range(len(every))]}[variant]
        assert every == expected, variant
    assert not torch.allclose(resumed["all-rows-early"], resumed["all-rows-late"], atol=1e-4)


def test_reconstruct_keeps_the_rows_the_reconstruction_attends_to_and_nothing_of_it(tiny_llama):
    """KVzip's scoring in the study: a prompt row the reconstruction queries attend to is kept,
    though the window does not attend to it; the reconstruction's own rows are dropped, and the
    sequence then decodes as one forced to the same selection."""
    import torch

    from snapcompile.config import PolicyConfig
    from snapcompile.reference.oracle import ReferenceSequence
    study = _resume_study()
    policy = PolicyConfig(budget=64, kernel=1, sinks=2, window=4)
    torch.manual_seed(0)
    hkv, heads, length, dim, planted = 2, 4, 120, 8, 50
    cache = study.study_sequence_type("reconstruct").cache_type(policy, policy.slot_rows, None)
    keys, values = torch.randn(hkv, length, dim), torch.randn(hkv, length, dim)
    window = torch.zeros(heads, policy.window, dim)          # the window attends evenly
    cache.waiting = (window, keys, values)
    query = torch.zeros(1, heads, 6, dim)
    query[0, :, 3] = 40 * keys[:, planted].repeat_interleave(heads // hkv, 0)
    cache.reconstruct(query, torch.randn(hkv, 6, dim), torch.randn(hkv, 6, dim), dim ** -0.5)
    assert (cache.row_positions == planted).any(dim=1).all() and cache.row_positions.max() < length

    prompt = [5 + i % 200 for i in range(200)]
    plain = PolicyConfig(budget=96, kernel=7)
    sequence = study.study_sequence_type("reconstruct")(tiny_llama.model, plain, plain.slot_rows)
    sequence.repeat = [11, 12, 13]
    logits = sequence.feed(prompt)
    snapkv = ReferenceSequence(tiny_llama.model, plain, plain.slot_rows)
    torch.testing.assert_close(logits, snapkv.feed(prompt))         # the prompt's prefill is dense either way
    chosen = [c.selection.indices for c in sequence.caches]
    assert sequence.position == len(prompt) and all(int(k.max()) < len(prompt) for k in chosen)
    assert any(not torch.equal(k, c.selection.indices) for k, c in zip(chosen, snapkv.caches))
    forced = ReferenceSequence(tiny_llama.model, plain, plain.slot_rows, forced_selection=chosen)
    forced.feed(prompt)
    token = [int(logits.argmax())]
    torch.testing.assert_close(sequence.feed(token), forced.feed(token))


def test_all_rows_quantized_sees_the_dropped_rows_as_the_store_holds_them(tiny_llama):
    """all-rows-q8 resumes close to all-rows, all-rows-q4 less close, both closer than resume."""
    import torch

    from snapcompile.config import PolicyConfig
    study = _resume_study()
    prompt, more = [5 + i % 200 for i in range(200)], [7 + i % 50 for i in range(40)]
    plain = PolicyConfig(budget=96, kernel=7)
    resumed = {}
    for variant in ("all-rows", "all-rows-q8", "all-rows-q4", "all-rows-q4-kept8", "resume"):
        sequence = study.study_sequence_type(variant)(tiny_llama.model, plain, plain.slot_rows)
        sequence.feed(prompt)
        if variant == "all-rows-q4-kept8":
            cache = sequence.caches[0]
            before = {int(p): row.clone() for p, row in zip(cache.row_positions[0], cache.keys[0]) if p >= 0}
        resumed[variant] = sequence.resume(prompt + more, len(prompt))
    error = {v: float((resumed[v] - resumed["all-rows"]).abs().max())
             for v in ("all-rows-q8", "all-rows-q4", "all-rows-q4-kept8", "resume")}
    assert 0 < error["all-rows-q8"] < error["all-rows-q4"] < error["resume"], error
    assert error["all-rows-q4-kept8"] not in (0, error["all-rows-q4"]) and error["all-rows-q4-kept8"] < error["resume"]
    # kept8: the rows kept again hold their 8-bit copies
    again = [(row, before[int(p)]) for p, row in zip(cache.row_positions[0], cache.keys[0]) if 0 <= p < len(prompt)]
    exact = torch.stack([b for _, b in again])
    step = (exact.amax(0) - exact.amin(0)) / 255
    assert again and 0 < float(max((held - b).abs().max() for held, b in again)) <= float(step.max())
