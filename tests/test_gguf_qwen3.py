"""A Qwen3 GGUF (llama.cpp's qwen3 architecture: per-head q/k norms as attn_q_norm / attn_k_norm)
converts like a Llama one: written here from the tiny random Qwen3 model's weights and tokenizer,
loaded by snapcompile, its artifact equal to the PyTorch oracle of the same weights."""
from __future__ import annotations

import json

import gguf
import numpy as np
import torch

from snapcompile.models import load_model
from snapcompile.validate.parity import Validator, summarize
from tests.conftest import build_artifact, random_prompts

LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_qwen3_gguf(loaded, path) -> None:
    """`loaded` (a Qwen3 model and its byte-level BPE tokenizer) as a float32 GGUF in llama.cpp's names."""
    config, state = loaded.config, loaded.model.state_dict()
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    vocab = json.loads(loaded.tokenizer.backend_tokenizer.to_str())["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    tokens += ["<|im_start|>", "<|im_end|>"] + [f"[PAD{i}]" for i in range(config.vocab_size - len(tokens) - 2)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(vocab) + [gguf.TokenType.CONTROL] * 2
                           + [gguf.TokenType.UNUSED] * (len(tokens) - len(vocab) - 2))
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_eos_token_id(len(vocab) + 1)
    writer.add_bos_token_id(len(vocab))
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].float().numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].float().numpy())
    if not config.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"].float().numpy())
    for i in range(config.num_hidden_layers):
        for hf, ours in LAYER_NAMES.items():
            writer.add_tensor(f"blk.{i}.{ours}.weight", state[f"model.layers.{i}.{hf}.weight"].float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_qwen3_gguf_converts_and_equals_its_weights_model(tmp_path):
    source = load_model("tiny-qwen3")
    write_qwen3_gguf(source, tmp_path / "qwen3.gguf")
    loaded = load_model(str(tmp_path / "qwen3.gguf"))
    assert loaded.spec.qk_norm and loaded.config.model_type == "qwen3"
    for name in ("model.layers.1.self_attn.q_norm.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.embed_tokens.weight"):
        assert np.array_equal(loaded.tensors.read(name), source.model.state_dict()[name].float().numpy()), name
    folder = build_artifact(loaded, tmp_path / "art")
    with torch.no_grad():
        summary = summarize(Validator(folder, source.model).run(random_prompts([9, 80], seed=2, vocab=250), 12), 12)
    assert summary["max_abs_logit_diff"] <= 1e-4 and summary["greedy_agreement"] == 1.0
