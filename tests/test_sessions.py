"""Conversations that keep their compressed cache: the resume rule and the store without a model,
resumed turns through the engine against the oracle's multi-turn policy on tiny-llama."""
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from snapcompile.engine.request import Request
from snapcompile.errors import PromptError
from snapcompile.reference.oracle import ReferenceSequence
from snapcompile.sessions.kept import KeptCache, common_prefix, plan_resume
from snapcompile.sessions.restore import resumed_prefill
from snapcompile.sessions.store import SessionStore
from tests.conftest import TINY_SNAPSTREAM, TINY_SUMMARIES, random_prompts
from tests.test_engine import _engine


def _kept(token_ids, positions_per_head, layers=2, dim=4, compressed_at=0) -> KeptCache:
    """A kept cache of the given tokens whose KV heads hold `positions_per_head` (lists, ascending)."""
    positions = np.array(positions_per_head, np.int64)
    hkv, rows = positions.shape
    keys = tuple(np.random.default_rng(i).normal(size=(hkv, rows, dim)).astype(np.float32) for i in range(layers))
    return KeptCache(np.array(token_ids, np.int64), keys, tuple(k + 1 for k in keys), (positions,) * layers,
                     compressed_at)


def test_common_prefix():
    assert common_prefix(np.array([1, 2, 3]), [1, 2, 4, 5]) == 2
    assert common_prefix(np.array([1, 2]), [1, 2, 3]) == 2
    assert common_prefix(np.array([1, 2, 3]), [1, 2]) == 2
    assert common_prefix(np.array([7]), [1]) == 0


def test_resume_point_leaves_the_window_and_one_token_to_prefill():
    kept = _kept(range(10), [list(range(10))])
    assert plan_resume(kept, list(range(14)), window=0, max_rows=100).resume_at == 10
    assert plan_resume(kept, list(range(14)), window=8, max_rows=100).resume_at == 6   # the window is new tokens
    assert plan_resume(kept, list(range(10)), window=0, max_rows=100).resume_at == 9   # one token's logits
    plan = plan_resume(kept, [0, 1, 2, 99, 98, 97], window=0, max_rows=100)            # a partial match
    assert (plan.resume_at, plan.rows) == (3, 3)
    assert plan_resume(kept, [5, 1, 2], window=0, max_rows=100) is None
    assert plan_resume(kept, list(range(14)), window=0, max_rows=13) is None           # 10 + 4 rows > 13


def test_resume_point_inside_a_per_head_selection_is_refused():
    kept = _kept(range(20), [[0, 1, 5, 9, 18, 19], [0, 1, 6, 7, 18, 19]])   # heads kept different positions
    assert plan_resume(kept, list(range(25)), window=4, max_rows=100).rows == 6       # at 20: all rows
    assert plan_resume(kept, list(range(6)) + [77] * 10, window=0, max_rows=100) is None   # at 6: 3 rows vs 2
    assert plan_resume(kept, list(range(2)) + [77] * 10, window=0, max_rows=100).rows == 2


def test_no_resume_before_the_kept_rows_were_selected():
    kept = _kept(range(30), [[0, 1, 5, 9, 18, 19, 20, 25, 29]], compressed_at=20)   # 20 prompt tokens, then decode
    assert plan_resume(kept, list(range(26)) + [99] * 10, window=4, max_rows=100).resume_at == 26   # in the ring
    assert plan_resume(kept, list(range(19)) + [99] * 10, window=4, max_rows=100) is None    # inside the selection
    assert plan_resume(kept, list(range(20)), window=4, max_rows=100) is None                # the prompt sent again
    assert plan_resume(kept, list(range(22)), window=4, max_rows=100) is None                # window reaches back


def test_kept_arrays_are_read_only():
    kept = _kept([1, 2, 3], [[0, 1, 2]])
    with pytest.raises(ValueError):
        kept.keys[0][0, 0, 0] = 1.0
    with pytest.raises(ValueError):
        kept.token_ids[0] = 5


def test_store_evicts_least_recently_used_by_bytes():
    entries = [_kept([i, 1, 2, 3], [[0, 1, 2, 3]]) for i in range(4)]
    size = entries[0].nbytes
    store = SessionStore(max_bytes=3 * size, window=0, max_rows=100)
    for kept in entries[:3]:
        store.put(kept)
    assert store.lookup([0, 1, 2, 3, 9]).kept is entries[0]      # entry 0 is now the most recent
    store.put(entries[3])                                         # evicts entry 1, the least recent
    assert len(store) == 3 and store.bytes == 3 * size <= store.max_bytes
    assert store.lookup([1, 1, 2, 3, 9]) is None
    assert store.counters.evictions == 1 and store.counters.hits == 1 and store.counters.misses == 1
    assert store.counters.tokens_reused == 4
    store.put(entries[3])                                         # the same tokens replace, not duplicate
    assert len(store) == 3 and store.bytes == 3 * size
    tiny = SessionStore(max_bytes=size - 1, window=0, max_rows=100)
    tiny.put(entries[0])
    assert len(tiny) == 0 and tiny.counters.refused == 1


def test_store_picks_the_entry_that_reuses_most():
    short, long = _kept([1, 2, 3], [[0, 1, 2]]), _kept([1, 2, 3, 4, 5, 6], [[0, 1, 2, 3, 4, 5]])
    store = SessionStore(max_bytes=10**6, window=0, max_rows=100)
    store.put(long)
    store.put(short)
    assert store.lookup([1, 2, 3, 4, 5, 6, 7]).kept is long
    assert store.lookup([1, 2, 3, 9, 9]).resume_at == 3


@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=30), budget=st.integers(0, 4000))
def test_store_never_holds_more_than_its_bytes(sizes, budget):
    store = SessionStore(max_bytes=budget, window=0, max_rows=100, max_entries=8)
    for i, rows in enumerate(sizes):
        store.put(_kept([i] + [0] * (rows - 1), [list(range(rows))], layers=1, dim=2))
        assert store.bytes <= budget and len(store) <= 8
        assert store.bytes == sum(e.nbytes for e in store._entries.values())


@given(puts=st.lists(st.tuples(st.sampled_from(["", "a", "b"]), st.integers(2, 30)), min_size=1, max_size=30),
       budget=st.integers(0, 3000))
def test_partitions_never_see_each_other_s_entries(puts, budget):
    """A lookup finds only its own partition's entries, whatever the others hold; eviction runs over
    every partition, and the bytes and the partition index stay exact."""
    store = SessionStore(max_bytes=budget, window=0, max_rows=100, max_entries=8)
    for partition, rows in puts:
        store.put(_kept([7] * rows, [list(range(rows))], layers=1, dim=2), partition)
        assert store.bytes == sum(e.nbytes for e in store._entries.values()) <= budget
        assert sorted(store._entries) == sorted(key for keys in store._partitions.values() for key in keys)
    for partition in ("", "a", "b", "c"):
        plan = store.lookup([7] * 40, partition)
        own = [kept for (where, _), kept in store._entries.items() if where == partition]
        assert (plan is None) == (not own)
        assert plan is None or any(plan.kept is kept for kept in own)


def test_a_request_without_a_partition_is_neither_resumed_nor_kept(tiny_snap_dir):
    document, question = random_prompts([160, 70], seed=5)
    engine = _engine(tiny_snap_dir, session_cache_bytes=2**26)
    first, = engine.generate([Request(document, max_new_tokens=4, ignore_eos=True, cache_partition="alice")])
    follow = document + first.output_ids[:-1] + question
    other, = engine.generate([Request(follow, max_new_tokens=2, cache_partition=None)])
    assert other.cached_tokens == 0 and len(engine.sessions) == 1
    stranger, = engine.generate([Request(follow, max_new_tokens=2, cache_partition="mallory")])
    same, = engine.generate([Request(follow, max_new_tokens=2, cache_partition="alice")])
    assert stranger.cached_tokens == 0 and same.cached_tokens > 0 and len(engine.sessions) == 3


@given(entries=st.lists(st.tuples(st.sampled_from(["", "a"]), st.lists(st.integers(0, 1), min_size=1, max_size=6),
                                  st.integers(0, 6)), min_size=1, max_size=12),
       prompt=st.lists(st.integers(0, 1), min_size=1, max_size=7), partition=st.sampled_from(["", "a"]),
       window=st.integers(0, 60))
@example(entries=[("", [0, 0], 0), ("", [0, 0, 0], 0)], prompt=[0, 0, 0], partition="", window=20)   # a depths' tie
def test_the_prefix_index_finds_what_comparing_every_entry_finds(entries, prompt, partition, window):
    """Token ids in blocks of 16 (each drawn digit a block, so prefixes collide often), entries whose
    rows were selected at some block (a resume before it is refused) and windows that cap the resume
    point (ties across depths): the indexed lookup returns the plan of the entry a scan of every entry
    of the partition picks (the most tokens reused; ties to the least recently used)."""
    def tokens(digits):
        return [d for d in digits for _ in range(16)]
    indexed = SessionStore(max_bytes=10**9, window=window, max_rows=10**4, min_tokens=16)
    order = []
    for where, digits, selected_at in entries:
        kept = _kept(tokens(digits), [list(range(16 * len(digits)))], layers=1, dim=2,
                     compressed_at=16 * min(selected_at, len(digits)))
        indexed.put(kept, where)
        order = [(w, k) for w, k in order if not (w == where and np.array_equal(k.token_ids, kept.token_ids))]
        order.append((where, kept))
    ids, best = tokens(prompt) + [5], None
    for where, kept in order:                               # least recently used first
        plan = plan_resume(kept, ids, window, 10**4, 16) if where == partition else None
        if plan is not None and (best is None or plan.resume_at > best.resume_at):
            best = plan
    found = indexed.lookup(ids, partition)
    assert (found is None) == (best is None)
    assert found is None or (found.kept is best.kept and found.resume_at == best.resume_at)


@pytest.mark.parametrize("compressed_at, planned", [(600, 0), (0, 1)])
def test_a_new_conversation_sharing_a_system_prompt_with_every_entry_plans_at_most_one(monkeypatch, compressed_at,
                                                                                      planned):
    """1024 kept conversations that begin with one 190-token system prompt, and a new one that shares only
    that: entries selected past it (SnapStream's) are passed over by level, none planned; dense entries
    (never selected) all reach 190 tokens, and only the least recently used of the tie is planned."""
    import snapcompile.sessions.store as store_module
    rng = np.random.default_rng(0)
    system = rng.integers(0, 1000, 190).tolist()
    store = SessionStore(max_bytes=10**12, window=8, max_rows=10**4, min_tokens=64)
    entries = [_kept(system + rng.integers(0, 1000, 500).tolist(), [list(range(690))], layers=1, dim=1,
                     compressed_at=compressed_at) for _ in range(1024)]
    for kept in entries:
        store.put(kept)
    calls = []
    real = store_module.plan_resume
    monkeypatch.setattr(store_module, "plan_resume", lambda *args: calls.append(args[0]) or real(*args))
    plan = store.lookup(system + rng.integers(1000, 2000, 300).tolist())
    assert len(calls) == planned
    assert (plan is None) if compressed_at else (plan.kept is entries[0] and plan.resume_at == 190)


# ---------------------------------------------------------------- through the engine


def run_conversation(engine, turns, steps: int, between: list[int] | None = None):
    """Each turn sends the conversation so far (every earlier turn and answer) and its own tokens,
    `steps` greedy tokens a turn: each turn's output ids and cached tokens. between: a prompt run
    (3 tokens) after each turn."""
    ids, outputs, cached = [], [], []
    for turn in turns:
        ids = ids + (outputs[-1] if outputs else []) + turn
        result, = engine.generate([Request(ids, max_new_tokens=steps, ignore_eos=True)])
        outputs.append(result.output_ids)
        cached.append(result.cached_tokens)
        if between is not None:
            engine.generate([Request(between, max_new_tokens=3, ignore_eos=True)])
    return outputs, cached


def _oracle_conversation(model, policy, rows, turns, steps):
    """Greedy tokens of each turn under the oracle's multi-turn policy, with the resume points
    the engine's store gives (the same rule)."""
    ids, window, outputs = list(turns[0]), policy.selection_window, []
    ref = ReferenceSequence(model, policy, rows)
    logits = ref.feed(ids)
    for turn in range(len(turns)):
        out = [int(logits.argmax())]
        for _ in range(steps - 1):
            logits = ref.feed([out[-1]])
            out.append(int(logits.argmax()))
        outputs.append(out)
        if turn + 1 == len(turns):
            break
        kept_ids = ids + out[:-1]
        ids = ids + out + list(turns[turn + 1])
        resume_at = min(len(kept_ids), len(ids) - max(window, 1))
        logits = ref.resume(ids, resume_at)
    return outputs


@pytest.mark.parametrize("folder", ["tiny_dense_dir", "tiny_snap_dir", "tiny_summary_dir"])
def test_resumed_turns_equal_the_oracle_multi_turn_policy(request, tiny_llama, folder):
    folder = request.getfixturevalue(folder)
    engine = _engine(folder, session_cache_bytes=2**26, session_keep="slot")
    turns = random_prompts([200, 30, 12], seed=5)
    steps = 40
    outputs, cached = run_conversation(engine, turns, steps)
    policy = engine.backend.manifest.policy
    rows = engine.backend.rows_per_slot if policy.compressed else 512
    assert outputs == _oracle_conversation(tiny_llama.model, policy, rows, turns, steps)
    window = TINY_SNAPSTREAM.window if policy.compressed else 0
    assert cached == [0, 200 + steps - 1, min(200 + 30 + 2 * steps - 1, 200 + 30 + 2 * steps + 12 - window)]
    assert engine.sessions.counters.hits == 2 and engine.sessions.counters.misses == 1
    if policy.compressed:
        assert all(kept.rows <= policy.slot_rows for kept in engine.sessions._entries.values())
    if policy.summaries:
        _check_summaries(sorted(engine.sessions._entries.values(), key=lambda kept: kept.compressed_at))


def _check_summaries(entries: list[KeptCache]) -> None:
    """Turn 1's entry keeps or sums each prompt position once; each later turn's sums only grow
    (the ring's overwritten decode rows are the one loss: they are not summed)."""
    first = entries[0]
    for positions, counts in zip(first.positions, first.summaries.counts):
        held = (positions < first.compressed_at).sum(axis=1) + counts.sum(axis=1)
        assert held.tolist() == [first.compressed_at] * len(held)
    for earlier, later in zip(entries, entries[1:]):
        for before, after in zip(earlier.summaries.counts, later.summaries.counts):
            assert (after >= before).all() and after.sum() > before.sum()


@pytest.mark.parametrize("folder", ["tiny_snap_dir", "tiny_summary_dir"])
def test_one_entry_serves_concurrent_requests_unchanged(request, folder):
    folder = request.getfixturevalue(folder)
    engine = _engine(folder, session_cache_bytes=2**26, session_keep="slot")
    document, = random_prompts([300], seed=6)
    first, = engine.generate([Request(document, max_new_tokens=4, ignore_eos=True)])
    kept, = engine.sessions._entries.values()
    held = [*kept.keys, *(kept.summaries.key_sums if kept.summaries else ())]
    snapshot = [k.copy() for k in held]
    questions = random_prompts([20, 25, 30], seed=7)
    shared = [Request(document + first.output_ids + q, max_new_tokens=8, ignore_eos=True) for q in questions]
    together = engine.generate(shared)
    assert [r.cached_tokens for r in together] == [300 + 3] * 3
    assert all(np.array_equal(a, b) for a, b in zip(snapshot, held))
    alone = [_engine(folder, session_cache_bytes=2**26, session_keep="slot") for _ in questions]
    for solo, request in zip(alone, shared):
        solo.generate([Request(document, max_new_tokens=4, ignore_eos=True)])
        again, = solo.generate([Request(request.prompt_ids, max_new_tokens=8, ignore_eos=True)])
        assert again.cached_tokens == 303
        assert again.output_ids == together[shared.index(request)].output_ids


def test_a_conversation_may_pass_max_context_but_not_the_model_positions(tiny_snap_dir):
    engine = _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="slot")
    ids, = random_prompts([480], seed=8)
    first, = engine.generate([Request(ids, max_new_tokens=30, ignore_eos=True)])
    longer = ids + first.output_ids + random_prompts([60], seed=9)[0]      # 570 tokens > max_context 512
    engine.check_prompt(longer)
    result, = engine.generate([Request(longer, max_new_tokens=4, ignore_eos=True)])
    assert result.error is None and result.cached_tokens == 480 + 29
    fresh = _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="slot")
    refused, = fresh.generate([Request(longer, max_new_tokens=4)])        # nothing to resume from
    assert "does not fit" in refused.error
    limit = engine.core.max_positions
    with pytest.raises(PromptError, match=f"1..{limit - 1}"):
        engine.check_prompt([1] * limit)


def test_a_prefix_that_matches_only_partly_resumes_up_to_the_divergence(tiny_llama, tiny_dense_dir):
    """A resent answer that differs from the tokens generated (a client's re-tokenization, a cut
    stop string) resumes up to the first differing token, and equals the oracle resumed there."""
    engine = _engine(tiny_dense_dir, session_cache_bytes=2**26)
    prompt, = random_prompts([150], seed=10)
    first, = engine.generate([Request(prompt, max_new_tokens=30, ignore_eos=True)])
    changed = [(t + 1) % 250 for t in first.output_ids[10:12]]
    ids = prompt + first.output_ids[:10] + changed + random_prompts([20], seed=11)[0]
    second, = engine.generate([Request(ids, max_new_tokens=8, ignore_eos=True)])
    assert second.cached_tokens == 160
    ref = ReferenceSequence(tiny_llama.model, engine.backend.manifest.policy, 512)
    ref.feed(prompt)
    for token in first.output_ids[:29]:
        ref.feed([token])
    out = [int(ref.resume(ids, 160).argmax())]
    for _ in range(7):
        out.append(int(ref.feed([out[-1]]).argmax()))
    assert second.output_ids == out


# ---------------------------------------------------------------- session_keep="full"


def test_full_keep_resumes_a_shared_prefix_as_its_own_prefill(tiny_snap_dir):
    """A full entry holds every prompt row, so a request resumed from it is selected from the same
    rows as when it is prefilled whole: the same answer, with only the suffix prefilled."""
    document, question = random_prompts([300, 30], seed=12)
    full = _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="full")
    full.generate([Request(document, max_new_tokens=1)])
    kept = full.sessions.newest()
    assert kept.rows == 300 and kept.compressed_at == 0
    assert all(np.array_equal(p, np.broadcast_to(np.arange(300), p.shape)) for p in kept.positions)
    resumed, = full.generate([Request(document + question, max_new_tokens=8, ignore_eos=True)])
    alone, = _engine(tiny_snap_dir).generate([Request(document + question, max_new_tokens=8, ignore_eos=True)])
    assert resumed.cached_tokens == 300 and resumed.output_ids == alone.output_ids


def test_full_keep_holds_the_prompt_and_prefills_the_answer_again(tiny_snap_dir):
    """The answer's rows were computed against the B selected rows, not the whole conversation:
    the entry holds the prompt's rows only, and the next turn prefills the answer with its own."""
    prompt, follow_up = random_prompts([200, 20], seed=13)
    engine = _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="full")
    first, = engine.generate([Request(prompt, max_new_tokens=6, ignore_eos=True)])
    kept = engine.sessions.newest()
    assert kept.rows == len(kept.token_ids) == 200 and kept.compressed_at == 0
    second, = engine.generate([Request(prompt + first.output_ids + follow_up, max_new_tokens=4, ignore_eos=True)])
    assert second.cached_tokens == 200
    assert engine.sessions.newest().rows == len(prompt + first.output_ids + follow_up)


def test_full_keep_stores_the_prompt_once_it_is_selected_within_the_store_bytes(tiny_snap_dir):
    """The entry goes into the store at the prompt's selection, so the store's bytes bound every
    full copy (no running sequence holds one of its own); one larger than the store is refused."""
    prompt, = random_prompts([200], seed=16)
    engine = _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="full")
    seq = engine.submit(Request(prompt, max_new_tokens=20, ignore_eos=True))
    while not len(engine.sessions):
        engine.step()
    assert not seq.finished and list(engine.sessions.newest().token_ids) == prompt and not engine.core.keeper._held
    size = engine.sessions.bytes
    small = _engine(tiny_snap_dir, session_cache_bytes=size - 1, session_keep="full")
    small.generate([Request(prompt, max_new_tokens=4)])
    assert len(small.sessions) == 0 and small.sessions.counters.refused == 1


def test_full_keep_answers_every_turn_as_if_it_were_prefilled_whole(tiny_snap_dir):
    """The default session mode is exact: a conversation of four turns, each resumed from the one
    before, gets token for token the answers of a store-less engine prefilling every turn whole."""
    first, *later = random_prompts([160, 12, 40, 5], seed=15)
    resumed_engine = _engine(tiny_snap_dir, session_cache_bytes=2**26)
    assert resumed_engine.session_keep == "full", "full is the default"
    whole_engine = _engine(tiny_snap_dir)
    resumed, whole, ids_r, ids_w = [], [], first, first
    for turn in range(4):
        r, = resumed_engine.generate([Request(ids_r, max_new_tokens=5 + 3 * turn, ignore_eos=True)])
        w, = whole_engine.generate([Request(ids_w, max_new_tokens=5 + 3 * turn, ignore_eos=True)])
        resumed.append((r.output_ids, r.cached_tokens))
        whole.append(w.output_ids)
        if turn < 3:
            ids_r = ids_w = ids_r + r.output_ids + later[turn]
    assert [ids for ids, _ in resumed] == whole
    assert [cached for _, cached in resumed] == [0, 160, 160 + 5 + 12, 160 + 5 + 12 + 8 + 40]


def test_full_keep_follows_a_sequence_moved_to_a_lower_slot(tiny_snap_dir):
    engine = _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="full")
    short, long = random_prompts([40, 150], seed=14)
    engine.generate([Request(short, max_new_tokens=2, ignore_eos=True), Request(long, max_new_tokens=12,
                                                                                ignore_eos=True)])
    kept = engine.sessions.newest()
    assert kept.rows == len(kept.token_ids) == 150 and not engine.core.keeper._held


def test_summaries_follow_a_sequence_moved_to_a_lower_slot(tiny_summary_dir):
    short, long = random_prompts([40, 150], seed=14)
    together, alone = (_engine(tiny_summary_dir, session_cache_bytes=2**26, session_keep="slot")
                       for _ in range(2))
    together.generate([Request(short, max_new_tokens=2, ignore_eos=True), Request(long, max_new_tokens=12,
                                                                                   ignore_eos=True)])
    alone.generate([Request(long, max_new_tokens=12, ignore_eos=True)])
    moved, solo = together.sessions.newest(), alone.sessions.newest()
    assert np.array_equal(moved.token_ids, solo.token_ids) and not together.core.keeper._held
    for a, b in zip(moved.summaries.key_sums + moved.summaries.counts, solo.summaries.key_sums + solo.summaries.counts):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert moved.summaries.counts[0].sum() > 0
    assert moved.rows + moved.summaries.rows <= TINY_SUMMARIES.budget
    assert moved.nbytes == solo.nbytes > moved.summaries.nbytes > 0


def test_session_keep_is_checked_and_off_without_a_store(tiny_snap_dir):
    from snapcompile.errors import SnapcompileError
    with pytest.raises(SnapcompileError, match="--session-keep must be one of full, slot"):
        _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="all")
    assert _engine(tiny_snap_dir, session_keep="full").core.keeper is None
    full = _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="full")
    assert full.prompt_limit == full.backend.max_prompt_len(), "every row is kept: the conversation must fit"
    with pytest.raises(PromptError, match="--session-keep slot resumes one past it"):
        full.check_prompt([1] * (full.prompt_limit + 1))


def test_an_abandoned_resumed_prefill_leaves_no_summary_bias_behind(tiny_summary_dir):
    """A request cancelled while its resumed prefill attends over summaries: the next prompt's
    prefill sees plain rows."""
    engine = _engine(tiny_summary_dir, session_cache_bytes=2**26, session_keep="slot")
    document, question, other = random_prompts([200, 150, 120], seed=21)
    first, = engine.generate([Request(document, max_new_tokens=4, ignore_eos=True)])
    ids = document + first.output_ids + question
    plan = engine.sessions.lookup(ids)
    chunks = resumed_prefill(engine.backend, 0, plan, ids, engine.core.keeper.resume_rows(plan))
    next(chunks)
    chunks.close()
    after = engine.backend.prefill(0, other).logits
    np.testing.assert_allclose(after, _engine(tiny_summary_dir).backend.prefill(0, other).logits, atol=1e-5)
