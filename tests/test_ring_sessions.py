"""Kept conversations on a model with sliding-window layers (tiny-gemma3: a local layer of window 40
holding a ring of 40 + 64 rows, a global layer under the policy): an entry holds each local layer's
ring whole, and a turn resumes where that ring still holds its first new token's window."""
from dataclasses import replace

import numpy as np
import pytest
from transformers import AutoTokenizer

from snapcompile.engine.engine import Engine
from snapcompile.engine.request import Request
from snapcompile.errors import SnapcompileError
from snapcompile.layout import WindowRing
from snapcompile.models import load_model
from snapcompile.runtime.ort_backend import OrtBackend
from snapcompile.sessions.kept import KeptCache, plan_resume
from tests.conftest import TINY_EXPORT, TINY_SNAPSTREAM, build_artifact, random_prompts
from tests.test_sessions import _oracle_conversation, run_conversation

RING = WindowRing.for_export(40, 64)


@pytest.fixture(scope="module")
def gemma3():
    return load_model("tiny-gemma3")


@pytest.fixture(scope="module")
def gemma3_dirs(tmp_path_factory, gemma3):
    root = tmp_path_factory.mktemp("gemma3_sessions")
    return {"dense": build_artifact(gemma3, root / "dense"),
            "snapstream": build_artifact(gemma3, root / "snap", policy=TINY_SNAPSTREAM),
            "snapstream-float16": build_artifact(gemma3, root / "snap16", replace(TINY_EXPORT, kv_dtype="float16"),
                                                 TINY_SNAPSTREAM)}


def _engine(folder, prefill_order=None, **kwargs) -> Engine:
    backend = OrtBackend(folder, prefill_order=prefill_order)
    return Engine(backend, AutoTokenizer.from_pretrained(str(folder)), backend.manifest.eos_token_ids, **kwargs)


def _ring_entry(fed: int, global_rows: int) -> KeptCache:
    """An entry of `fed` positions: layer 0 a ring (its last RING.rows positions), layer 1 every position
    below global_rows."""
    held = np.array(RING.held(fed))
    rows = (np.zeros((1, len(held), 2), np.float32), np.zeros((1, global_rows, 2), np.float32))
    positions = (held[None].copy(), np.arange(global_rows)[None])
    return KeptCache(np.arange(fed), rows, rows, positions, ring_layers=(0,))


def test_a_ring_resumes_only_where_it_holds_the_first_new_token_s_window():
    """The ring holds [F - 104, F): a resume point r serves while r - 39 >= F - 104 (its first new
    token's window is held); the plan counts the global layer's rows only."""
    fed = 300
    entry = _ring_entry(fed, fed)
    prompt = list(range(fed)) + [7] * 20
    plan = plan_resume(entry, prompt, 8, 512, ring=RING)
    assert plan.resume_at == fed and plan.rows == fed
    earliest = fed - RING.rows + RING.window - 1                      # 235
    changed = list(range(earliest)) + [-1] * (len(prompt) - earliest)     # diverges at `earliest`
    assert plan_resume(entry, changed, 8, 512, ring=RING).resume_at == earliest
    changed[earliest - 1] = -1
    assert plan_resume(entry, changed, 8, 512, ring=RING) is None
    short = _ring_entry(50, 50)                                        # the ring holds every position
    assert plan_resume(short, list(range(10)) + [-1] * 40, 8, 512, ring=RING).resume_at == 10


@pytest.mark.parametrize("policy", ["dense", "snapstream"])
def test_slot_keep_resumes_each_turn_as_the_oracle_does(gemma3, gemma3_dirs, policy):
    """Three turns, each resumed from the entry the one before left (its rings wrapped several times),
    another prompt run in the same slot in between (so the rings come from the entry): token for token
    the oracle's multi-turn policy (its local layers on their window)."""
    engine = _engine(gemma3_dirs[policy], session_cache_bytes=2**26, session_keep="slot")
    turns = random_prompts([200, 30, 12], seed=5)
    other, = random_prompts([150], seed=9)
    steps = 40
    outputs, cached = run_conversation(engine, turns, steps, between=other)
    manifest = engine.backend.manifest
    rows = engine.backend.rows_per_slot if manifest.policy.compressed else 512
    assert outputs == _oracle_conversation(gemma3.model, manifest.policy, rows, turns, steps)
    window = TINY_SNAPSTREAM.window if manifest.policy.compressed else 0
    assert cached == [0, 200 + steps - 1, min(200 + 30 + 2 * steps - 1, 200 + 30 + 2 * steps + 12 - window)]
    entry = engine.sessions.newest()
    assert entry.ring_layers == manifest.spec.local_layers
    assert [p.shape[1] for p in entry.positions] == [RING.rows, entry.rows]


@pytest.mark.parametrize("artifact, order", [("snapstream", None), ("snapstream", "chunks"),
                                             ("snapstream-float16", None)])
def test_full_keep_answers_every_turn_as_if_it_were_prefilled_whole(gemma3_dirs, artifact, order):
    """The default mode on a compressed artifact, either prefill order, the cache in float32 or
    float16: each turn resumed from the prompt before it (its global layer's every row, its ring's
    last 104; another prompt run in the same slot in between) gets the answer of a store-less engine
    prefilling the turn whole."""
    first, *later = random_prompts([160, 12, 40, 5], seed=15)
    other, = random_prompts([150], seed=9)
    folder = gemma3_dirs[artifact]
    resumed_engine = _engine(folder, order, session_cache_bytes=2**26)
    whole_engine = _engine(folder, order)
    resumed, whole, ids = [], [], first
    for turn in range(4):
        r, = resumed_engine.generate([Request(ids, max_new_tokens=5 + 3 * turn, ignore_eos=True)])
        w, = whole_engine.generate([Request(ids, max_new_tokens=5 + 3 * turn, ignore_eos=True)])
        resumed_engine.generate([Request(other, max_new_tokens=3, ignore_eos=True)])     # the same slot
        resumed.append((r.output_ids, r.cached_tokens))
        whole.append(w.output_ids)
        if turn < 3:
            ids = ids + r.output_ids + later[turn]
    assert [out for out, _ in resumed] == whole
    assert [cached for _, cached in resumed] == [0, 160, 160 + 5 + 12, 160 + 5 + 12 + 8 + 40]
    entry = resumed_engine.sessions.newest()
    end = len(entry.token_ids)
    assert entry.rows == end and np.array_equal(entry.positions[0][0], np.arange(end - RING.rows, end))
    assert entry.keys[0].dtype == (np.float16 if artifact.endswith("float16") else np.float32)


def test_quantized_keep_is_refused_by_name(gemma3_dirs):
    with pytest.raises(SnapcompileError, match="quantized is not built for a model with sliding-window"):
        _engine(gemma3_dirs["snapstream"], session_cache_bytes=2**26, session_keep="quantized")



@pytest.mark.parametrize("policy", ["dense", "snapstream"])
def test_validate_turns_resume_the_rings(gemma3, gemma3_dirs, policy):
    """`validate --turns` on tiny-gemma3: every turn resumed from the slot's entry (rings and all), its
    logits against the oracle's multi-turn policy."""
    from snapcompile.validate.parity import Validator, summarize
    validator = Validator(gemma3_dirs[policy], gemma3.model)
    reports = validator.run_turns(random_prompts([150, 20], seed=3), 40, 3, random_prompts([30], seed=9)[0])
    summary = summarize(reports, 40)
    assert summary["resumed_tokens"] == [0, 190, 261, 0, 60, 131]
    assert not summary["selection_mismatches"]
    assert summary["max_abs_logit_diff"] <= 1e-4 and summary["greedy_agreement"] == 1.0
