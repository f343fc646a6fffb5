"""--session-keep quantized: the slot's rows in 8 bits and every row its selections dropped in 4,
attended by a resumed turn's new tokens (sessions/dropped.py, sessions/kept.py, the backend)."""
import numpy as np
import pytest
import torch

from snapcompile.engine.request import Request
from snapcompile.errors import SnapcompileError
from snapcompile.reference import oracle
from snapcompile.runtime.ort_backend import OrtBackend
from snapcompile.sessions.dropped import DroppedChunk, DroppedRows
from snapcompile.sessions.kept import KeptCache, plan_resume
from snapcompile.sessions.kv_quant import QuantizedRows
from tests.conftest import TINY_EXPORT, TINY_SNAPSTREAM, build_artifact, random_prompts
from tests.test_engine import _engine


def _chunk(rows: int, first: int, layers=2, hkv=2, dim=4) -> DroppedChunk:
    rng = np.random.default_rng(first)
    positions = np.broadcast_to(np.arange(first, first + rows), (hkv, rows))
    return DroppedChunk.of([(rng.normal(size=(hkv, rows, dim)).astype(np.float32),
                             rng.normal(size=(hkv, rows, dim)).astype(np.float32), positions) for _ in range(layers)])


def _entry(tokens: int, kept_positions, dropped: DroppedRows | None, layers=2, dim=4) -> KeptCache:
    positions = np.array(kept_positions, np.int64)
    keys = tuple(np.ones((*positions.shape, dim), np.float32) for _ in range(layers))
    return KeptCache(np.arange(tokens, dtype=np.int64), keys, keys, (positions,) * layers, tokens, None, dropped)


def test_dropped_rows_are_attended_only_when_they_fit_the_resumed_prefill():
    dropped = DroppedRows((_chunk(10, 2),))
    kept = _entry(20, [[0, 1, *range(12, 20)]] * 2, dropped)
    ids = list(range(20)) + [99] * 5
    assert plan_resume(kept, ids, window=4, max_rows=100).dropped_rows == 10
    plan = plan_resume(kept, ids, window=4, max_rows=20)           # 10 kept + 5 new fit, the 10 dropped not
    assert (plan.rows, plan.dropped_rows) == (10, 0)


def test_the_oldest_dropped_rows_go_first_past_the_bound():
    old, new = _chunk(64, 2), _chunk(32, 70)
    kept = _entry(120, [[0, 1, *range(102, 120)]] * 2, None)
    held = kept.quantized(DroppedRows((old, new)), max_bytes=10**6)
    assert isinstance(held.keys[0], QuantizedRows) and held.keys[0].bits == 8
    assert held.dropped.chunks == (old, new)
    bound = held.nbytes - old.nbytes
    assert kept.quantized(DroppedRows((old, new)), max_bytes=bound).dropped.chunks == (new,)
    assert kept.quantized(DroppedRows((old, new)), max_bytes=bound - 1).dropped is None


def test_quantized_keep_holds_the_slot_rows_in_8_bits_and_every_dropped_row_in_4(tiny_snap_dir):
    document, = random_prompts([160], seed=21)
    quantized = _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="quantized")
    compressed = _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="slot")
    for engine in (quantized, compressed):
        engine.generate([Request(document, max_new_tokens=4, ignore_eos=True)])
    held, slot = quantized.sessions.newest(), compressed.sessions.newest()
    assert held.keys[0].bits == 8 and held.dropped.rows == len(document) + 3 - held.rows
    for layer, chunk_positions in enumerate(held.dropped.chunks[0].positions):
        for kept_heads, dropped_heads in zip(held.positions[layer], chunk_positions):
            assert sorted([*kept_heads.tolist(), *dropped_heads.tolist()]) == list(range(len(held.token_ids)))
        keys, _ = held.layer_rows(layer, held.rows)
        step = (slot.keys[layer].max(axis=1) - slot.keys[layer].min(axis=1)).max() / 255
        assert np.abs(keys - slot.keys[layer]).max() <= step
    bound = compressed.backend.manifest.kv_bytes_per_slot() + held.token_ids.nbytes \
        + len(held.positions) * held.positions[0].shape[0] * TINY_SNAPSTREAM.slot_rows * 8
    assert held.nbytes <= bound
    assert not quantized.core.keeper._held


class _GivenRows(oracle._LayerCache):
    """The oracle's layer resuming from given rows: the kept ones (selectable) and the dropped ones
    (seen by the last `tail` new tokens only), as a quantized entry holds them."""

    tail = TINY_EXPORT.tail

    def start_resume(self, resume_at):
        keys, values, positions, dropped_keys, dropped_values = (torch.from_numpy(np.array(a)) for a in self.given)
        self.resume_rows, self.dropped_rows = (keys, values, positions, resume_at), (dropped_keys, dropped_values)

    def attend_resumed(self, query, keys, values, kept, scale):
        dropped_keys, dropped_values = self.dropped_rows
        seen_k = torch.cat([keys[:, :kept], dropped_keys, keys[:, kept:]], dim=1)
        seen_v = torch.cat([values[:, :kept], dropped_values, values[:, kept:]], dim=1)
        new, dropped = keys.shape[1] - kept, dropped_keys.shape[1]
        visible = oracle.resumed_visible(new, kept + dropped)
        visible[: max(new - self.tail, 0), kept:kept + dropped] = False
        return oracle._attend(query, seen_k[None], seen_v[None], scale, visible)


def test_a_resumed_turn_attends_over_the_dropped_rows_and_selects_among_the_kept(tiny_llama, tiny_snap_dir):
    """The engine's resumed turn from a quantized entry equals the oracle's given the entry's rows
    (the kept ones and, for the last T new tokens only, the dropped ones), step by step; the
    question is longer than the tail, so a prefill chunk runs before the tail graph."""
    document, question = random_prompts([160, 90], seed=22)
    engine = _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="quantized")
    first, = engine.generate([Request(document, max_new_tokens=4, ignore_eos=True)])
    held = engine.sessions.newest()
    ids = document + first.output_ids + question
    plan = plan_resume(held, ids, TINY_SNAPSTREAM.selection_window, engine.backend.max_resume_rows())
    assert plan.dropped_rows == held.dropped.rows > 0
    resumed, = engine.generate([Request(ids, max_new_tokens=6, ignore_eos=True, logprobs=True)])
    assert resumed.cached_tokens == plan.resume_at

    sequence = type("GivenSequence", (oracle.ReferenceSequence,), {"cache_type": _GivenRows})(
        tiny_llama.model, TINY_SNAPSTREAM, TINY_SNAPSTREAM.slot_rows)
    for layer, cache in enumerate(sequence.caches):
        cache.layout = "resumed"                # not a fresh prompt: the next feed resumes
        cache.given = (*held.layer_rows(layer, plan.rows), held.positions[layer][:, :plan.rows],
                       *held.dropped.layer(layer))
    sequence.position = len(held.token_ids)
    logits = sequence.resume(ids, plan.resume_at)
    for token, logprob in zip(resumed.output_ids, resumed.token_logprobs):
        assert abs(float(torch.log_softmax(logits, -1)[token]) - logprob) < 1e-4
        assert int(logits.argmax()) == token
        logits = sequence.feed([token])


def test_the_backend_refuses_a_plan_whose_dropped_rows_would_not_fit(tiny_snap_dir):
    from dataclasses import replace

    from snapcompile.runtime.backend import drain
    from snapcompile.sessions.restore import resumed_prefill
    document, question = random_prompts([160, 20], seed=24)
    engine = _engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="quantized")
    engine.generate([Request(document, max_new_tokens=1)])
    held, backend = engine.sessions.newest(), engine.backend
    plan = plan_resume(held, document + question, TINY_SNAPSTREAM.selection_window, backend.max_resume_rows())
    too_many = replace(plan, dropped_rows=backend.max_resume_rows())
    with pytest.raises(SnapcompileError, match="dropped ones: .* rows, the artifact's resumed prefill takes"):
        drain(resumed_prefill(backend, 0, too_many, document + question))
    without_tail = OrtBackend(tiny_snap_dir, prefill_order="chunks")    # no quantized store: no tail graph loaded
    with pytest.raises(SnapcompileError, match="dropped rows but 0 were given"):
        drain(resumed_prefill(without_tail, 0, plan, document + question))
    with pytest.raises(SnapcompileError, match="runs on the tail graph: call load_tail_graph first"):
        drain(resumed_prefill(without_tail, 0, plan, document + question,
                             engine.core.keeper.resume_rows(plan)))


def test_quantized_keep_is_refused_with_summaries_and_off_without_a_store(tiny_summary_dir, tiny_snap_dir):
    with pytest.raises(SnapcompileError, match="--session-keep quantized keeps the dropped rows themselves"):
        _engine(tiny_summary_dir, session_cache_bytes=2**26, session_keep="quantized")
    off = _engine(tiny_snap_dir, session_keep="quantized")
    assert off.core.keeper is None and off.backend.tail_graph is None


def test_quantized_keep_needs_the_tail_graph(tiny_llama, tmp_path):
    from dataclasses import replace
    folder = build_artifact(tiny_llama, tmp_path / "no-tail", replace(TINY_EXPORT, tail=0), TINY_SNAPSTREAM)
    with pytest.raises(SnapcompileError, match="converted with --tail 0.* convert it again"):
        _engine(folder, session_cache_bytes=2**26, session_keep="quantized")
    with pytest.raises(SnapcompileError, match="graph prefill_tail, which this artifact lacks .* convert it again"):
        OrtBackend(folder, prefill_order="chunks").load_tail_graph()
    assert _engine(folder, session_cache_bytes=2**26).sessions is not None     # the other modes do without it


def test_dropped_rows_follow_a_sequence_moved_to_a_lower_slot(tiny_snap_dir):
    short, long = random_prompts([40, 150], seed=23)
    together, alone = (_engine(tiny_snap_dir, session_cache_bytes=2**26, session_keep="quantized") for _ in range(2))
    together.generate([Request(short, max_new_tokens=2, ignore_eos=True), Request(long, max_new_tokens=12,
                                                                                   ignore_eos=True)])
    alone.generate([Request(long, max_new_tokens=12, ignore_eos=True)])
    moved, solo = together.sessions.newest(), alone.sessions.newest()
    assert np.array_equal(moved.token_ids, solo.token_ids) and not together.core.keeper._held
    assert moved.dropped.rows == solo.dropped.rows > 0
    np.testing.assert_allclose(moved.dropped.layer(0)[0], solo.dropped.layer(0)[0], atol=1e-2)
