"""Model weights read one tensor at a time (models/tensors.py): every source gives the values the
transformers model holds, and an export streams them (its memory does not grow with the model)."""
import numpy as np
import pytest
import torch

from snapcompile.models.loader import _tiny_config
from snapcompile.models.tensors import (
    ModuleSource,
    RandomSource,
    SafetensorsSource,
    expected_shapes,
    model_from_source,
    rope_frequencies,
)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_safetensors_are_read_as_torch_converts_them(tmp_path, dtype):
    from safetensors.torch import save_file
    config = _tiny_config("tiny-llama")
    expected = expected_shapes(config)
    values = {n: torch.randn(shape).to(getattr(torch, dtype)) for n, shape in expected.items()}
    save_file(values, str(tmp_path / "model.safetensors"))
    source = SafetensorsSource(tmp_path)
    source.check(expected, tied=False)
    for name, tensor in values.items():
        read = source.read(name)
        assert read.dtype == np.float32 and read.flags.c_contiguous
        np.testing.assert_array_equal(read, tensor.float().numpy())


def test_a_tied_embedding_stored_as_the_head_is_read_as_the_embedding(tmp_path):
    from safetensors.torch import save_file
    config = _tiny_config("tiny-llama")
    config.tie_word_embeddings = True
    expected = expected_shapes(config)
    assert "lm_head.weight" not in expected
    stored_as = {"model.embed_tokens.weight": "lm_head.weight"}
    values = {stored_as.get(n, n): torch.randn(s) for n, s in expected.items()}
    save_file(values, str(tmp_path / "model.safetensors"))
    source = SafetensorsSource(tmp_path)
    source.check(expected, tied=True)
    np.testing.assert_array_equal(source.read("model.embed_tokens.weight"), values["lm_head.weight"].numpy())


def test_random_values_are_seeded_per_tensor_and_shaped_as_transformers_initialises():
    source = RandomSource(expected_shapes(_tiny_config("tiny-qwen2")), seed=3)
    again = RandomSource(source.shapes, seed=3)
    name = "model.layers.1.self_attn.q_proj.weight"
    np.testing.assert_array_equal(source.read(name), again.read(name))
    assert not np.array_equal(source.read(name), RandomSource(source.shapes, seed=4).read(name))
    assert abs(float(source.read(name).std()) - 0.02) < 0.002
    assert (source.read("model.layers.0.input_layernorm.weight") == 1).all()
    assert (source.read("model.layers.0.self_attn.k_proj.bias") == 0).all()


def test_a_model_built_from_a_source_holds_its_values():
    source = RandomSource(expected_shapes(_tiny_config("tiny-llama")), seed=5)
    model = model_from_source(_tiny_config("tiny-llama"), source)
    held = ModuleSource(model)
    assert held.shapes == source.shapes
    for name in source.shapes:
        np.testing.assert_array_equal(held.read(name), source.read(name))


@pytest.mark.parametrize("rope_scaling", [None, dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=512)])
def test_rope_frequencies_are_the_models_own(rope_scaling):
    from transformers import AutoModelForCausalLM
    config = _tiny_config("tiny-llama")
    if rope_scaling:
        config = type(config)(**(config.to_dict() | {"rope_scaling": rope_scaling}))
    inv_freq, scaling = rope_frequencies(config)
    rotary = AutoModelForCausalLM.from_config(config).model.rotary_emb
    np.testing.assert_array_equal(inv_freq, rotary.inv_freq.numpy())
    assert scaling == rotary.attention_scaling
    if rope_scaling:
        assert not np.allclose(inv_freq, rope_frequencies(_tiny_config("tiny-llama"))[0])


@pytest.mark.slow
def test_the_gguf_source_reads_what_transformers_loads():
    """SmolLM2's GGUF (Q8_0 embedding, Q4_1 layers, llama q/k row order), read tensor by tensor, equals
    the model transformers' GGUF loader builds from it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from snapcompile.models.loader import _smollm2_gguf
    from snapcompile.models.tensors import GGUFSource
    path = _smollm2_gguf()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    source = GGUFSource(path, config, expected_shapes(config))
    theirs = ModuleSource(model)
    assert source.shapes == theirs.shapes
    for name in source.shapes:
        np.testing.assert_array_equal(source.read(name), theirs.read(name), err_msg=name)
