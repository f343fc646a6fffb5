"""Continuous batching: scheduling without a model, and output equality on tiny-llama."""
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from snapcompile.engine.engine import Engine
from snapcompile.engine.request import Request, SamplingParams, Sequence, Status
from snapcompile.engine.sampling import prompt_logprobs, sample, top_logprobs
from snapcompile.engine.scheduler import Scheduler
from snapcompile.engine.slots import SlotPool
from snapcompile.errors import SnapcompileError
from snapcompile.runtime.backend import chunk_starts
from snapcompile.runtime.ort_backend import OrtBackend
from tests.conftest import FAULT_SEED, random_prompts


def test_slot_pool_hands_out_lowest_free_slot():
    pool = SlotPool(3)
    assert [pool.acquire(), pool.acquire()] == [0, 1]
    pool.release(0)
    assert pool.acquire() == 0 and pool.acquire() == 2 and pool.acquire() is None
    with pytest.raises(ValueError):
        pool.release(5)


def test_scheduler_admits_fifo_into_free_slots():
    scheduler = Scheduler(slots=2, prefill_tokens_per_step=8)
    seqs = [Sequence(Request([1, 2, 3], request_id=f"r{i}")) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.admit() == seqs[:2]
    assert [s.slot for s in seqs[:2]] == [0, 1] and seqs[2].status is Status.WAITING
    assert scheduler.prefill_turn() is seqs[0]
    scheduler.prefill_done(seqs[0])
    assert scheduler.prefill_turn() is seqs[1] and scheduler.decoding == {0: seqs[0]}
    scheduler.release(seqs[0])
    assert scheduler.admit() == [seqs[2]] and seqs[2].slot == 0
    assert not scheduler.idle


def test_a_leader_and_its_followers_are_admitted_together_and_wait_for_its_prefill():
    scheduler = Scheduler(slots=3, prefill_tokens_per_step=8)
    first = Sequence(Request([1, 2], request_id="first"))
    leader = Sequence(Request([5, 6], request_id="lead"))
    followers = [Sequence(Request([5, 6], request_id=f"f{i}", shares_prefill_of="lead")) for i in range(2)]
    for seq in (first, leader, *followers):
        scheduler.add(seq)
    assert scheduler.admit() == [first]                  # the group of 3 waits for 3 free slots
    scheduler.prefill_done(first)
    scheduler.release(first)
    assert scheduler.admit() == [leader] and [s.slot for s in (leader, *followers)] == [0, 1, 2]
    assert scheduler.prefill_turn() is leader and not scheduler.waiting and not scheduler.idle
    scheduler.release(followers[1])                      # a follower that leaves frees its slot at once
    assert scheduler.pool.free == 1
    assert scheduler.take_followers(leader) == followers[:1] and scheduler.take_followers(leader) == []
    orphan = Sequence(Request([7], request_id="o", shares_prefill_of="gone"))
    scheduler.add(orphan)
    assert scheduler.admit() == [orphan]                 # its leader is gone: it prefills on its own


def test_compaction_moves_the_highest_decoding_sequence_down_when_the_graph_shrinks():
    scheduler = Scheduler(slots=8, prefill_tokens_per_step=8, decode_sizes=[1, 2, 4, 8])
    seqs = [Sequence(Request([1], request_id=f"r{i}")) for i in range(6)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.admit()
    for seq in seqs:
        scheduler.prefill_done(seq)
    for seq in seqs[:5]:
        scheduler.release(seq)                   # slot 5 alone: an 8-slot step
    assert scheduler.graph_size(5) == 8
    assert scheduler.compact() == [(seqs[5], 5)] and seqs[5].slot == 0 and scheduler.decoding == {0: seqs[5]}
    assert scheduler.compact() == []
    more = [Sequence(Request([1], request_id=f"m{i}")) for i in range(2)]
    for seq in more:
        scheduler.add(seq)
    scheduler.admit()                            # slots 1 and 2, still prefilling: never moved
    scheduler.prefill_done(more[1])
    scheduler.release(seqs[5])                   # decoding: slot 2 only; slot 0 is free
    assert scheduler.compact() == [(more[1], 2)] and more[1].slot == 0 and more[0].slot == 1


@given(st.lists(st.tuples(st.sampled_from(["add", "done", "release", "compact"]), st.integers(0, 7)),
                max_size=60))
def test_compaction_keeps_slots_unique_and_leaves_no_useful_move(ops):
    scheduler = Scheduler(slots=6, prefill_tokens_per_step=8, decode_sizes=[1, 2, 4, 6])
    live = []
    for n, (op, pick) in enumerate(ops):
        if op == "add":
            scheduler.add(seq := Sequence(Request([1], request_id=f"r{n}")))
            live.append(seq)
            scheduler.admit()
        elif op == "done" and scheduler.prefilling:
            scheduler.prefill_done(scheduler.prefilling[pick % len(scheduler.prefilling)])
        elif op == "release" and live:
            scheduler.release(live.pop(pick % len(live)))
        elif op == "compact":
            for seq, left in scheduler.compact():
                assert seq.slot < left
        slots = [seq.slot for seq in live if seq.slot is not None]
        assert len(slots) == len(set(slots)) and scheduler.pool.free == 6 - len(slots)
        assert all(scheduler.decoding[seq.slot] is seq for seq in live if seq.status is Status.DECODING)
    scheduler.compact()
    if scheduler.decoding and scheduler.pool.lowest() is not None:
        highest = max(scheduler.decoding)
        rest = [slot for slot in scheduler.decoding if slot != highest]
        assert scheduler.graph_size(max([*rest, scheduler.pool.lowest()])) >= scheduler.graph_size(highest)


def test_chunk_starts_end_at_the_prompt_end():
    assert chunk_starts(10, 4) == [0, 4, 6]
    assert chunk_starts(8, 4) == [0, 4]
    assert chunk_starts(3, 4) == [0]


def test_sampling_greedy_and_seeded():
    logits = np.array([0.1, 2.0, 1.9, -1.0], np.float32)
    assert sample(logits, SamplingParams(), np.random.default_rng(0)) == 1
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=3)
    def draws():
        rng = np.random.default_rng(3)
        return [sample(logits, params, rng) for _ in range(20)]
    assert draws() == draws()
    assert set(draws()) <= {0, 1, 2}
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1), np.random.default_rng(0)) == 1


def test_penalties_and_bias_follow_the_reference_semantics():
    """The repetition penalty equals transformers' RepetitionPenaltyLogitsProcessor over prompt and
    output tokens; frequency and presence penalties are OpenAI's formula over the output tokens;
    the bias is added first; greedy follows the adjusted logits."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    from snapcompile.engine.sampling import penalized_logits
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50).astype(np.float32)
    prompt, output = [3, 7, 7, 11], [7, 20, 20, 20, 31]
    reference = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), torch.tensor([logits]))[0]
    ours = penalized_logits(logits, SamplingParams(repetition_penalty=1.7), prompt, output)
    np.testing.assert_allclose(ours, reference.numpy(), rtol=1e-6)
    counts = np.bincount(output, minlength=50)
    expected = logits.astype(np.float64) - 0.5 * counts - 0.25 * (counts > 0)
    ours = penalized_logits(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt, output)
    np.testing.assert_allclose(ours, expected)
    biased = SamplingParams(logit_bias=((42, 100.0), (int(np.argmax(logits)), -100.0)))
    assert sample(logits, biased, np.random.default_rng(0), prompt, output) == 42
    greedy = int(np.argmax(logits))
    assert sample(logits, SamplingParams(repetition_penalty=100.0), np.random.default_rng(0), [greedy]) != greedy


def test_min_p_keeps_the_tokens_transformers_keeps():
    import torch
    from transformers import MinPLogitsWarper
    logits = np.array([2.0, 1.9, 0.5, -1.0, 1.2, -3.0], np.float32)
    kept = MinPLogitsWarper(0.3)(None, torch.tensor([logits]))[0]
    allowed = set(np.flatnonzero(np.isfinite(kept.numpy())).tolist())
    params = SamplingParams(temperature=1.0, min_p=0.3)
    rng = np.random.default_rng(1)
    drawn = {sample(logits, params, rng) for _ in range(300)}
    assert drawn == allowed
    assert {sample(logits, SamplingParams(temperature=1.5, min_p=1.0), rng) for _ in range(50)} == {0}


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(min_p=1.5),
                                    dict(repetition_penalty=0.0), dict(presence_penalty=2.5),
                                    dict(frequency_penalty=float("nan")), dict(logit_bias=((1, 101.0),)),
                                    dict(logit_bias=((-1, 1.0),)), dict(logit_bias=((1, 1.0), (1, 2.0)))])
def test_invalid_sampling_params(kwargs):
    with pytest.raises(SnapcompileError):
        SamplingParams(**kwargs)


def test_top_logprobs_are_the_likeliest_tokens_in_order():
    logits = np.array([0.5, 3.0, 3.0, -2.0, 1.0], np.float32)
    expected = np.log(np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum())
    top = top_logprobs(logits, 3)
    assert [i for i, _ in top] == [1, 2, 4], "ties go to the lower id, as greedy sampling's"
    assert [lp for _, lp in top] == pytest.approx(expected[[1, 2, 4]])
    assert len(top_logprobs(logits, 99)) == 5
    assert [i for i, _ in top_logprobs(np.zeros(10, np.float32), 3)] == [0, 1, 2], "more tied than asked for"
    with pytest.raises(SnapcompileError, match="top_logprobs"):
        Request([1, 2], top_logprobs=-1)


def test_results_carry_top_logprobs_of_every_token_only_when_asked(tiny_snap_dir):
    prompt = random_prompts([60], seed=5)[0]
    asked, plain = _engine(tiny_snap_dir).generate([Request(prompt, max_new_tokens=6, top_logprobs=3),
                                                    Request(prompt, max_new_tokens=6)])
    assert asked.output_ids == plain.output_ids and plain.top_logprobs == []
    assert len(asked.top_logprobs) == len(asked.output_ids)
    for token, top in zip(asked.output_ids, asked.top_logprobs):
        assert top[0][0] == token and len(top) == 3, "greedy picks the likeliest token"
        assert top[0][1] >= top[1][1] >= top[2][1] and top[0][1] <= 0.0


def _engine(folder, session_cache_bytes=0, **kwargs):
    """An engine on folder, with no session store unless asked."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    backend = OrtBackend(folder)
    return Engine(backend, tokenizer, backend.manifest.eos_token_ids, session_cache_bytes=session_cache_bytes,
                  **kwargs)


@pytest.mark.parametrize("artifact", ["tiny_dense_dir", "tiny_snap_dir"])
def test_continuous_batching_equals_running_alone(artifact, request):
    folder = request.getfixturevalue(artifact)
    lengths = [150, 12, 300, 40, 220, 5, 90]            # more requests than the 3 slots
    new_tokens = [20, 5, 30, 8, 25, 3, 12]             # some finish early
    prompts = random_prompts(lengths, seed=21)
    def make():
        return [Request(p, max_new_tokens=n, request_id=f"r{i}") for i, (p, n) in enumerate(zip(prompts, new_tokens))]
    batched = _engine(folder, prefill_tokens_per_step=64).generate(make())
    for request_alone, together in zip(make(), batched):
        alone = _engine(folder).generate([request_alone])[0]
        assert together.output_ids == alone.output_ids, request_alone.request_id
        assert together.finish_reason == alone.finish_reason


@pytest.mark.parametrize("artifact", ["tiny_dense_dir", "tiny_snap_dir"])
def test_a_lone_request_moves_down_and_runs_on_the_one_slot_graph(artifact, request):
    """r0 finishes first in slot 0; r1 moves from slot 1 to slot 0 and its steps run on the
    1-slot decode graph, with the output it has alone."""
    folder = request.getfixturevalue(artifact)
    prompts = random_prompts([40, 100], seed=5)
    engine = _engine(folder)
    assert engine.backend.decode_sizes == [1, 2, 3]
    ran, choose = [], engine.backend.decode_size
    engine.backend.decode_size = lambda slots: ran.append(choose(slots)) or ran[-1]     # graph sizes run
    results = engine.generate([Request(prompts[0], max_new_tokens=8, request_id="r0"),
                               Request(prompts[1], max_new_tokens=20, request_id="r1")])
    assert 2 in ran and ran[-1] == 1 and ran.count(1) >= 12
    alone = _engine(folder).generate([Request(prompts[1], max_new_tokens=20)])[0]
    assert results[1].output_ids == alone.output_ids


def test_error_requests_are_isolated(tiny_dense_dir):
    engine = _engine(tiny_dense_dir)
    good = Request(random_prompts([20])[0], max_new_tokens=4, request_id="good")
    results = engine.generate([Request([], request_id="empty"), Request([1] * 600, request_id="long"), good])
    assert [r.finish_reason for r in results] == ["error", "error", "length"]
    assert "does not fit" in results[1].error and "0 tokens" in results[0].error
    alone = _engine(tiny_dense_dir).generate([Request(good.prompt_ids, max_new_tokens=4)])[0]
    assert results[2].output_ids == alone.output_ids


def test_stop_strings_and_eos(tiny_dense_dir):
    engine = _engine(tiny_dense_dir)
    probe = engine.generate([Request(random_prompts([30], seed=2)[0], max_new_tokens=12, request_id="probe")])[0]
    stop = probe.text[3:5]
    assert stop, "the probe generated text"
    engine = _engine(tiny_dense_dir)
    stopped = engine.generate([Request(random_prompts([30], seed=2)[0], max_new_tokens=12, stop=(stop,))])[0]
    assert stopped.finish_reason == "stop" and stopped.text == probe.text[: probe.text.find(stop)]
    eos_engine = _engine(tiny_dense_dir)
    eos_engine.core.eos_ids = {probe.output_ids[2]}
    ended = eos_engine.generate([Request(random_prompts([30], seed=2)[0], max_new_tokens=12)])[0]
    assert ended.finish_reason == "eos" and ended.output_ids == probe.output_ids[:3]


def test_seeded_sampling_is_reproducible(tiny_snap_dir):
    def run(seed):
        engine = _engine(tiny_snap_dir)
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        return engine.generate([Request(random_prompts([100])[0], max_new_tokens=16, sampling=params)])[0].output_ids
    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize("folder", ["tiny_snap_dir", "tiny_dense_dir"])
def test_samples_that_share_one_prefill_equal_separate_requests(folder, request):
    """A leader and three followers (seeds 1..4) give the texts four separate requests with those
    seeds give; on three slots the leader and two followers share one prefill and the fourth,
    which does not fit beside them, prefills on its own: two prefills instead of four."""
    artifact = request.getfixturevalue(folder)
    prompt = random_prompts([150])[0]

    def requests(shared):
        made = [Request(prompt, max_new_tokens=12, request_id=f"s{seed}",
                        sampling=SamplingParams(temperature=1.0, seed=seed)) for seed in range(1, 5)]
        if shared:
            made[1:] = [replace(r, shares_prefill_of="s1", cache_partition=None) for r in made[1:]]
        return made
    separate = _engine(artifact).generate(requests(False))
    engine = _engine(artifact)
    prefills = []
    real = engine.backend.prefill_chunks
    engine.backend.prefill_chunks = lambda slot, ids, **rows_to: prefills.append(slot) or real(slot, ids, **rows_to)
    shared = engine.generate(requests(True))
    assert [r.output_ids for r in shared] == [r.output_ids for r in separate]
    assert engine.scheduler.pool.num_slots == 3
    assert prefills == [0, 0] and len({tuple(r.output_ids) for r in shared}) > 1


def test_a_leader_that_ends_before_its_prefill_ends_its_followers(tiny_snap_dir):
    engine = _engine(tiny_snap_dir)
    prompt = random_prompts([150])[0]                     # three chunks: the first step prefills one
    engine.submit(Request(prompt, request_id="lead"))
    engine.submit(Request(prompt, request_id="f", shares_prefill_of="lead", cache_partition=None))
    engine.step()
    assert engine.abort("lead")
    assert engine.result("f").finish_reason == "abort" and engine.scheduler.idle
    assert engine.scheduler.pool.free == engine.scheduler.pool.num_slots


def test_dense_sequence_stops_at_context_end(tiny_llama, tmp_path):
    from snapcompile.config import ExportConfig
    from tests.conftest import build_artifact
    folder = build_artifact(tiny_llama, tmp_path / "small", export=ExportConfig(slots=2, max_context=64, chunk=16))
    result = _engine(folder).generate([Request(random_prompts([60])[0], max_new_tokens=50)])[0]
    # positions 60..63 can still be fed: the prefill token plus 4 decode tokens
    assert result.finish_reason == "context" and len(result.output_ids) == 5


def test_kv_memory_is_slots_times_budget(tiny_snap_dir):
    engine = _engine(tiny_snap_dir)
    spec, manifest, backend = engine.backend.manifest.spec, engine.backend.manifest, engine.backend
    expected = manifest.export.slots * manifest.policy.budget * spec.kv_bytes_per_token
    slot_arrays = [*backend.keys, *backend.values]       # what the backend really allocated for its slots
    assert all(a.shape == (manifest.export.slots, spec.num_kv_heads, manifest.policy.budget, spec.head_dim)
               for a in slot_arrays)
    assert sum(a.nbytes for a in slot_arrays) == engine.kv_bytes_allocated() == expected


def test_fewer_slots_than_the_artifact_has(tiny_snap_dir):
    engine = _engine(tiny_snap_dir, max_slots=1)
    requests = [Request(p, max_new_tokens=4) for p in random_prompts([50, 60, 70], seed=3)]
    busy = []
    for _ in engine.stream(requests):
        busy.append(len(engine.scheduler.decoding) + len(engine.scheduler.prefilling))
    assert max(busy) == 1
    assert all(engine.result(r.request_id).finish_reason in ("length", "eos") for r in requests)
    with pytest.raises(SnapcompileError, match="--slots must be in 1..3"):
        _engine(tiny_snap_dir, max_slots=4)


def test_compressed_sequence_stops_at_the_models_last_position(tiny_snap_dir):
    engine = _engine(tiny_snap_dir)
    engine.core.max_positions = 100 + 3          # as if the model had been trained on 103 positions
    result = engine.generate([Request(random_prompts([100])[0], max_new_tokens=50)])[0]
    # positions 100..102 can be fed: the prefill token plus 3 decode tokens
    assert result.finish_reason == "context" and len(result.output_ids) == 4


def test_a_request_failing_inside_the_engine_fails_alone(artifact, faulty_sampling):
    from snapcompile import Engine, Request, SamplingParams
    engine = Engine.from_artifact(artifact, session_cache_bytes=0)
    requests = [Request(engine.encode("one"), max_new_tokens=3),
                Request(engine.encode("two"), max_new_tokens=3, sampling=SamplingParams(seed=FAULT_SEED)),
                Request(engine.encode("three"), max_new_tokens=3)]
    results = engine.generate(requests)
    assert [r.error is None for r in results] == [True, False, True]
    assert "internal error: RuntimeError: injected fault" in results[1].error
    assert all(len(r.output_ids) == 3 for r in (results[0], results[2]))


@given(text=st.text(alphabet="ab", max_size=30), stop=st.text(alphabet="ab", min_size=1, max_size=8))
def test_stop_hold_back_is_the_longest_suffix_that_may_still_become_the_stop(text, stop):
    from snapcompile.engine.output import stop_prefix_overlap
    brute = max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    assert stop_prefix_overlap(text, stop) == brute


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dense_dir):
    from snapcompile.artifact.files import artifact_tokenizer
    from snapcompile.artifact.manifest import read_manifest
    return artifact_tokenizer(tiny_dense_dir, read_manifest(tiny_dense_dir))


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 258), max_size=60), windowed=st.booleans())
def test_incremental_text_is_the_whole_decode(tiny_tokenizer, ids, windowed):
    """Token by token (DecodeStream, or the window of a tokenizer without one), then what is held
    back: the tokenizer's decode of every id, special tokens skipped, U+FFFD for bytes no character
    completes; and each token's text is final (never changes after it is given)."""
    from snapcompile.engine.output import IncrementalText
    text = IncrementalText(tiny_tokenizer)
    if windowed:
        text.stream = None
    pieces = [text.add(token) for token in ids]
    assert "".join(pieces) + text.rest() == tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(piece.endswith("\ufffd") for piece in pieces if windowed)


def test_bytes_that_never_make_a_character_are_given_after_a_bounded_wait(tiny_tokenizer):
    """An output of lone UTF-8 continuation bytes: held back at most MAX_HELD tokens, then given as
    U+FFFD, so its decoding never grows with its length."""
    from snapcompile.engine.output import IncrementalText
    continuation = next(i for i in range(259) if tiny_tokenizer.decode([i]) == "\ufffd"
                        and tiny_tokenizer.decode([i, i]) == "\ufffd\ufffd")
    for windowed in (False, True):
        text = IncrementalText(tiny_tokenizer)
        if windowed:
            text.stream = None
        pieces = [text.add(continuation) for _ in range(3 * IncrementalText.MAX_HELD)]
        given = [i for i, piece in enumerate(pieces) if piece]
        assert given and all(b - a <= IncrementalText.MAX_HELD for a, b in zip([-1, *given], given))
        assert "".join(pieces) + text.rest() == "\ufffd" * len(pieces)


def test_each_token_decodes_a_bounded_window_not_the_whole_output(tiny_tokenizer):
    """The text of token 4000 costs what the text of token 200 does: no step decodes the whole output
    again (before engine/output.py every token decoded all the output so far: quadratic)."""
    from snapcompile.engine.core import TokenStep
    from snapcompile.engine.output import OutputProcessor

    class Counting:
        def __init__(self, tokenizer):
            self.tokenizer, self.ids_decoded = tokenizer, []

        def decode(self, ids, skip_special_tokens=False):
            self.ids_decoded.append(len(ids))
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    counting = Counting(tiny_tokenizer)
    output = OutputProcessor(counting)          # no DecodeStream for it: the windowed decode
    output.add(Request([1], max_new_tokens=10**6, stop=("never said",), request_id="r"), 0.0)
    for token in np.random.default_rng(0).integers(3, 250, 4000):
        output.process(TokenStep("r", int(token), False, 0.0))
    assert len(counting.ids_decoded) == 2 * 4000 and max(counting.ids_decoded) <= 16


def test_stop_strings_are_bounded():
    from snapcompile.engine.request import MAX_STOP_CHARS, MAX_STOP_STRINGS
    Request([1], stop=("x" * MAX_STOP_CHARS,) * MAX_STOP_STRINGS)
    with pytest.raises(SnapcompileError, match="at most 256 characters"):
        Request([1], stop=("q" * 2_000_000,))
    with pytest.raises(SnapcompileError, match="at most 16 stop strings"):
        Request([1], stop=tuple(str(i) for i in range(17)))



@pytest.mark.parametrize(("name", "inside", "outside"), [
    ("temperature", 2.0, 2.01), ("top_p", 1.0, 0.0), ("top_k", 0, -2), ("min_p", 1.0, 1.01),
    ("repetition_penalty", 100.0, 100.5), ("presence_penalty", -2.0, -2.5), ("frequency_penalty", 2.0, 2.5),
    ("seed", 2**63 - 1, 2**63)])
def test_the_engine_and_the_api_accept_the_same_sampling_values(name, inside, outside):
    """One home for the ranges (engine/sampling_bounds.py): what serve's wire format takes, the engine
    takes, and what one refuses the other refuses."""
    from pydantic import ValidationError

    from snapcompile.serve.protocol import CompletionRequest
    SamplingParams(**{name: inside})
    CompletionRequest(model="m", prompt="x", **{name: inside})
    with pytest.raises(SnapcompileError, match=name):
        SamplingParams(**{name: outside})
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="x", **{name: outside})


@pytest.mark.parametrize("artifact", ["tiny_dense_dir", "tiny_snap_dir"])
def test_the_generation_limit_is_what_the_engine_generates(request, artifact):
    """generation_limit(P) tokens run to "length"; one more ends at that many with "context" (a dense
    slot's rows, or the model's positions for a ring). The server refuses a max_tokens past it."""
    engine = Engine.from_artifact(request.getfixturevalue(artifact), session_cache_bytes=0)
    prompt = random_prompts([300], seed=2)[0]
    limit = engine.generation_limit(len(prompt))
    assert limit == (512 - 300 + 1 if artifact == "tiny_dense_dir" else 4096 - 300 + 1)
    exact, past = engine.generate([Request(prompt, max_new_tokens=limit, ignore_eos=True),
                                   Request(prompt, max_new_tokens=limit + 1, ignore_eos=True)])
    assert (exact.finish_reason, len(exact.output_ids)) == ("length", limit)
    assert (past.finish_reason, len(past.output_ids)) == ("context", limit)


def test_prompt_logprobs_reduce_a_block_of_positions_exactly():
    """Each row's log probability (float64 reference), rank (1 + the tokens strictly likelier), top k
    (top_logprobs' ids); a row's likeliest token has exactly the top entry's value (lm-eval's greedy check)."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((6, 300)) * 4).astype(np.float32)
    logits[2, 17] = logits[2, 40] = logits[2].max() + 1          # a tie for the likeliest
    tokens = [5, 299, 40, int(np.argmax(logits[3])), 0, 17]
    scores = prompt_logprobs(logits, tokens, 3)
    reference = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    for row, (score, token) in enumerate(zip(scores, tokens)):
        assert score.token_id == token and abs(score.logprob - reference[row, token]) < 1e-5
        assert score.rank == 1 + int(np.sum(logits[row] > logits[row, token]))
        assert [i for i, _ in score.top] == [i for i, _ in top_logprobs(logits[row], 3)]
    assert scores[2].rank == 1 and scores[2].top[0] == (17, scores[2].top[0][1])    # ties to the lower id
    assert scores[3].logprob == scores[3].top[0][1] and scores[3].rank == 1
    assert prompt_logprobs(logits, tokens, 0)[0].top == []
    for one, three in zip(prompt_logprobs(logits, tokens, 1), scores):       # k = 1 has a way of its own
        assert one.top == three.top[:1] and (one.logprob, one.rank) == (three.logprob, three.rank)
