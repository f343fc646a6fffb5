"""PyTorch implementations of the custom ops (the same functions the oracle uses, snapcompile.reference.policy)."""
from __future__ import annotations

import torch

from snapcompile.config import PolicyConfig
from snapcompile.reference.policy import ring_decode_attention, snapkv_select, window_scores

decode_attention = ring_decode_attention


def select(window_query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prompt_len: int,
           policy: PolicyConfig, scale: float, scorer=window_scores):
    """SnapKVSelect on one sequence: see plugins.contracts. Returns (key, value, index) with a
    leading batch axis of 1; scores in float32, K/V returned in the input dtype. scorer: the
    window-score implementation (the PyTorch reference, or the Triton kernel)."""
    keys = key[0, :, :prompt_len].float()
    index = snapkv_select(window_query[0].float(), keys, policy, scale, scorer).indices  # [Hkv, P]
    gather = index[:, :, None].expand(-1, -1, key.shape[-1])
    picked_k = torch.gather(key[0], 1, gather)
    picked_v = torch.gather(value[0], 1, gather)
    return picked_k[None], picked_v[None], index[None]


def policy_from_attrs(sinks: int, window: int, kernel: int, prompt_share: int, pooling: str,
                      scope: str) -> PolicyConfig:
    """The PolicyConfig an op node's attributes describe. A node knows no budget: the smallest
    one its prompt share fits (share + 1) stands in, which the selection never reads."""
    return PolicyConfig(policy="snapstream", budget=prompt_share + 1, sinks=sinks, window=window,
                        kernel=kernel, pooling=pooling, scope=scope, prompt_share=prompt_share)
