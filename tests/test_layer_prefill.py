"""The layer-by-layer prefill (runtime/layer_prefill.py): the chunk-by-chunk prefill's numbers bit for
bit (the same rows kept, the same slot rows and logits), fresh and resumed, and a prompt's memory that
does not grow with the model's layers beyond what one layer's rows take."""
from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from transformers import AutoTokenizer

from snapcompile.config import ExportConfig, PolicyConfig
from snapcompile.engine.engine import Engine
from snapcompile.engine.request import Request
from snapcompile.models import load_model
from snapcompile.runtime.layer_prefill import LayerPrefill
from snapcompile.runtime.ort_backend import OrtBackend
from snapcompile.runtime.prefill import PrefillRunner
from tests.conftest import TINY_SNAPSTREAM, build_artifact, random_prompts, write_hf_folder

LENGTHS = (5, 63, 64, 100, 130, 200, 300, 450, 512)    # one chunk, overlapped last chunks, every bucket


@pytest.fixture(scope="module")
def int4_streaming_dir(tiny_llama, tmp_path_factory):
    export = ExportConfig(slots=3, max_context=512, chunk=64, weight_format="int4")
    return build_artifact(tiny_llama, tmp_path_factory.mktemp("layers") / "streaming", export,
                          PolicyConfig(policy="streamingllm", budget=64, sinks=4, window=8))


@pytest.fixture(scope="module")
def int4_snap_dir(tiny_llama, tmp_path_factory):
    export = ExportConfig(slots=3, max_context=512, chunk=64, weight_format="int4")
    return build_artifact(tiny_llama, tmp_path_factory.mktemp("layers") / "int4", export, TINY_SNAPSTREAM)


def both_orders(folder) -> tuple[OrtBackend, OrtBackend]:
    layers, chunks = OrtBackend(folder), OrtBackend(folder, prefill_order="chunks")
    assert isinstance(layers.prefills, LayerPrefill) and isinstance(chunks.prefills, PrefillRunner)
    return layers, chunks


def assert_same_prefill(ours, theirs, layers: OrtBackend, chunks: OrtBackend, slot: int = 0) -> None:
    assert np.array_equal(ours.logits, theirs.logits)
    assert ours.layout == theirs.layout and ours.filled == theirs.filled and ours.compressed == theirs.compressed
    assert (ours.kept_rows is None) == (theirs.kept_rows is None)
    for mine, other in zip(ours.kept_rows or [], theirs.kept_rows or []):
        assert np.array_equal(mine, other)
    kept = ours.layout.kept
    for i in range(layers.num_layers):
        assert np.array_equal(layers.keys[i][slot, :, :kept], chunks.keys[i][slot, :, :kept]), f"layer {i} keys"
        assert np.array_equal(layers.values[i][slot, :, :kept], chunks.values[i][slot, :, :kept]), f"layer {i} values"


@pytest.mark.parametrize("fixture", ["tiny_snap_dir", "tiny_summary_dir", "int4_snap_dir", "int4_streaming_dir"])
def test_a_prompt_prefilled_layer_by_layer_equals_chunk_by_chunk_bit_for_bit(fixture, request):
    layers, chunks = both_orders(request.getfixturevalue(fixture))
    for prompt in random_prompts(LENGTHS, seed=54):
        assert_same_prefill(layers.prefill(1, prompt), chunks.prefill(1, prompt), layers, chunks, slot=1)


def test_the_rows_each_layer_hands_over_are_the_prompts_rows(tiny_snap_dir):
    """rows_to gets every layer's filled rows once, in order, as the chunk-by-chunk prefill hands them."""
    from snapcompile.runtime.device import drain
    layers, chunks = both_orders(tiny_snap_dir)
    prompt, = random_prompts([300], seed=3)
    handed = {}
    for name, backend in (("layers", layers), ("chunks", chunks)):
        seen = handed[name] = []

        def keep(i, keys, values, kept, seen=seen):
            seen.append((i, keys.copy(), values.copy(), None if kept is None else kept.copy()))
        drain(backend.prefill_chunks(0, prompt, rows_to=keep))
    assert [i for i, *_ in handed["layers"]] == list(range(layers.num_layers))
    for ours, theirs in zip(handed["layers"], handed["chunks"]):
        assert ours[1].shape == (2, 300, 16)
        for mine, other in zip(ours[1:], theirs[1:]):
            assert np.array_equal(mine, other)


def _engine(folder, order: str | None, **kwargs) -> Engine:
    backend = OrtBackend(folder, prefill_order=order)
    return Engine(backend, AutoTokenizer.from_pretrained(str(folder)), backend.manifest.eos_token_ids, **kwargs)


@pytest.mark.parametrize("fixture, keep", [("tiny_snap_dir", "full"), ("tiny_snap_dir", "slot"),
                                           ("tiny_summary_dir", "slot")])
def test_resumed_conversations_are_the_same_in_both_orders(fixture, keep, request):
    """Turn two resumes from the store (the whole prompt's rows; the slot's; the slot's and the
    summaries, attended with their logit bias): the same tokens, and a hit on both sides."""
    folder = request.getfixturevalue(fixture)
    document, question = random_prompts([300, 20], seed=9)
    outputs = {}
    for order in ("layers", "chunks"):
        engine = _engine(folder, order, session_cache_bytes=2**26, session_keep=keep)
        first, = engine.generate([Request(document, max_new_tokens=6, ignore_eos=True, cache_partition="u")])
        second, = engine.generate([Request(document + first.output_ids + question, max_new_tokens=6,
                                           ignore_eos=True, cache_partition="u")])
        assert second.cached_tokens > 0
        outputs[order] = (first.output_ids, second.output_ids, second.cached_tokens)
    assert outputs["layers"] == outputs["chunks"]


def test_a_quantized_keeps_tail_sees_the_dropped_rows_in_both_orders(tiny_snap_dir):
    """The last export.tail new tokens attend over the dropped rows: on the tail graph chunk by chunk, in
    chunks of C on the layer graphs layer by layer (the same attention, other chunk shapes: close, and
    the same greedy tokens)."""
    from snapcompile.runtime.device import drain
    from snapcompile.sessions.kept import plan_resume
    from snapcompile.sessions.restore import resumed_prefill
    document, question = random_prompts([160, 40], seed=24)
    results = {}
    for order in ("layers", "chunks"):
        engine = _engine(tiny_snap_dir, order, session_cache_bytes=2**26, session_keep="quantized")
        engine.generate([Request(document, max_new_tokens=1, cache_partition="u")])
        held, backend = engine.sessions.newest(), engine.backend
        plan = plan_resume(held, document + question, TINY_SNAPSTREAM.selection_window, backend.max_resume_rows())
        assert plan.dropped_rows > 0
        results[order] = drain(resumed_prefill(backend, 0, plan, document + question,
                                               engine.core.keeper.resume_rows(plan)))
    ours, theirs = results["layers"], results["chunks"]
    np.testing.assert_allclose(ours.logits, theirs.logits, atol=1e-5)
    assert ours.logits.argmax() == theirs.logits.argmax() and ours.layout == theirs.layout


def test_a_layer_by_layer_artifact_says_so_and_the_plugin_lowering_does_not(tiny_snap_dir, tiny_dense_dir):
    assert json.loads((tiny_snap_dir / "manifest.json").read_text())["prefill_order"] == "layers"
    assert json.loads((tiny_dense_dir / "manifest.json").read_text())["prefill_order"] == "chunks"
    assert isinstance(OrtBackend(tiny_dense_dir).prefills, PrefillRunner)    # a dense prompt goes into its slot


# ---------------------------------------------------------------- memory
MEMORY_CONTEXT = 4096


def _generated(layers: int, tiny_llama, tmp_path):
    """A snapstream artifact of a random model of `layers` decoder layers (the tiny model's widths) over
    MEMORY_CONTEXT positions."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**{**tiny_llama.config.to_dict(), "num_hidden_layers": layers,
                            "max_position_embeddings": MEMORY_CONTEXT})
    torch.manual_seed(layers)
    model = LlamaForCausalLM(config).eval()

    class Loaded:                              # what write_hf_folder reads
        pass
    loaded = Loaded()
    loaded.model, loaded.tokenizer, loaded.spec = model, tiny_llama.tokenizer, tiny_llama.spec
    folder = write_hf_folder(loaded, tmp_path / f"hf{layers}")
    export = ExportConfig(slots=1, max_context=MEMORY_CONTEXT, chunk=64)
    return build_artifact(load_model(str(folder)), tmp_path / f"art{layers}", export, TINY_SNAPSTREAM)


def _prompt_peak(folder, order: str) -> tuple[int, int]:
    """(the peak of what Python and numpy hold while a MEMORY_CONTEXT prompt is prefilled, the backend's
    buffers included and its slot caches not; one layer's rows of that prompt in bytes). The opening's
    passing reads (files, checksums, the graphs' sessions) are left out of the peak."""
    tracemalloc.start()
    try:
        backend = OrtBackend(folder, prefill_order=order)
        backend.make_graphs()
        prompt, = random_prompts([MEMORY_CONTEXT], seed=1)
        tracemalloc.reset_peak()
        backend.prefill(0, prompt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    spec = backend.manifest.spec
    return peak - backend.kv_bytes_allocated(), MEMORY_CONTEXT * spec.kv_bytes_per_token // spec.num_layers


def test_a_prompts_memory_does_not_grow_with_the_layers(tiny_llama, tmp_path):
    """Six layers against two, a prompt of 4096 tokens: layer by layer the prompt's memory grows by less
    than one layer's rows (it holds one layer's, and the hidden states); chunk by chunk by four
    layers' rows (the measure sees what it is meant to)."""
    two, six = _generated(2, tiny_llama, tmp_path), _generated(6, tiny_llama, tmp_path)
    (layers_two, layer_bytes), (layers_six, _) = _prompt_peak(two, "layers"), _prompt_peak(six, "layers")
    (chunks_two, _), (chunks_six, _) = _prompt_peak(two, "chunks"), _prompt_peak(six, "chunks")
    assert layers_six - layers_two < layer_bytes / 2
    assert chunks_six - chunks_two > 4 * layer_bytes * 0.9
    assert layers_six < chunks_six - 3 * layer_bytes


@pytest.mark.parametrize("fixture", ["tiny_dense_dir", "tiny_snap_dir", "int4_snap_dir"])
def test_a_prompts_logits_at_every_position_are_the_models(fixture, request, tiny_llama):
    """logits_to hands out each position's logits (the model's own, as a full forward computes them),
    and the prefill's slot rows and last logits are those of a prefill that was not asked: a dense
    artifact, prefilled chunk by chunk, scores on a layer-by-layer prefill of its own."""
    import torch
    folder = request.getfixturevalue(fixture)
    scored, plain = OrtBackend(folder), OrtBackend(folder)
    for prompt in random_prompts((5, 64, 130), seed=57):
        seen = {}
        def record(first, logits, seen=seen):
            seen.update({first + row: logits[row].copy() for row in range(len(logits))})
        result = _drained(scored.prefill_chunks(0, prompt, logits_to=record))
        with torch.no_grad():
            expected = tiny_llama.model(torch.tensor([prompt])).logits[0].float().numpy()
        assert sorted(seen) == list(range(len(prompt) - 1))
        got = np.stack([seen[i] for i in range(len(prompt) - 1)] + [result.logits])
        if "int4" not in fixture:          # int4: the quantized model's, not the float one's
            assert np.abs(got - expected).max() < 2e-4
        theirs = plain.prefill(0, prompt)
        assert np.array_equal(result.logits, theirs.logits) and result.layout == theirs.layout
        kept = result.layout.kept
        for i in range(scored.num_layers):
            assert np.array_equal(scored.keys[i][0, :, :kept], plain.keys[i][0, :, :kept])


def _drained(chunks):
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value
