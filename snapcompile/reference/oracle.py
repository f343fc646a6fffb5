"""The PyTorch oracle: the eager Hugging Face model with the cache policy applied in PyTorch.

Attention is swapped for `_policy_attention` through transformers' AttentionInterface; every
other operation (embeddings, RoPE, norms, MLP, head) is the HF model's own. Each attention
module gets a `_LayerCache` holding that layer's fixed-rows_per_slot cache for one sequence.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from snapcompile.config import PolicyConfig
from snapcompile.layout import SlotLayout
from snapcompile.reference.policy import Selection, ring_decode_attention, snapkv_select, streaming_select

ATTENTION_NAME = "snapcompile_reference"


@dataclass(frozen=True)
class LayerPrefill:
    """One layer's recorded prefill: window_query [H, W, D] (the last W prompt queries, post-RoPE),
    keys / values [Hkv, T, D] (post-RoPE keys), and the attention scale."""

    window_query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scale: float


class _LayerCache:
    """One layer's cache for one sequence: K/V [Hkv, rows_per_slot, D] laid out as in the runner.

    record_window: when > 0, prefill keeps a LayerPrefill with that many trailing queries.
    """

    def __init__(self, policy: PolicyConfig, rows_per_slot: int, forced: torch.Tensor | None, record_window: int = 0):
        self.policy, self.rows_per_slot, self.forced = policy, rows_per_slot, forced
        self.keys = self.values = None
        self.row_positions: torch.Tensor | None = None     # [Hkv, rows_per_slot] position per row, -1 empty
        self.resume_rows: tuple | None = None   # (keys, values, positions, resume_at) a resumed turn attends over
        self.layout: SlotLayout | None = None
        self.selection: Selection | None = None
        self.generated = 0
        self.record_window = record_window
        self.recorded: LayerPrefill | None = None
        # summaries of the dropped rows (policy.summaries > 0): sums [Hkv, S, D], counts [Hkv, S]
        self.summary_keys = self.summary_values = self.summary_counts = None

    def prefill(self, query, key, value, scale):
        """query [1, H, T, D], key/value [1, Hkv, T, D]; returns dense causal attention [1, H, T, D]."""
        length = key.shape[2]
        out = _attend(query, key, value, scale, torch.ones(length, length).tril().bool())
        if self.record_window:
            self.recorded = LayerPrefill(query[0, :, -self.record_window:].clone(), key[0].clone(),
                                         value[0].clone(), scale)
        self.load(query[0, :, -self.policy.window:], key[0], value[0], scale)
        return out

    def load(self, window_query, key, value, scale, positions: torch.Tensor | None = None) -> None:
        """Select the kept prompt rows and lay them out: window_query [H, >=W, D] (the last
        prompt queries), key/value [Hkv, T', D]; positions [Hkv, T'] the rows' positions,
        ascending per head (None: 0 .. T'-1, a fresh prompt; a resumed turn's rows are its kept
        rows and the new tokens, docs/design.md "Conversations that keep their cache")."""
        hkv, rows, d = key.shape
        if positions is None:
            positions = torch.arange(rows).expand(hkv, -1)
        share = self.policy.resolved_prompt_share if self.policy.compressed else None
        self.layout = SlotLayout.for_rows(int(positions[0, -1]) + 1, rows, self.rows_per_slot, share)
        kept = self._kept_rows(window_query, key, scale, positions)                # [Hkv, kept]
        self.keys = torch.zeros(hkv, self.rows_per_slot, d)
        self.values = torch.zeros(hkv, self.rows_per_slot, d)
        self.row_positions = torch.full((hkv, self.rows_per_slot), -1, dtype=torch.int64)
        index = kept[:, :, None].expand(-1, -1, d)
        self.keys[:, : self.layout.kept] = torch.gather(key, 1, index)
        self.values[:, : self.layout.kept] = torch.gather(value, 1, index)
        self.row_positions[:, : self.layout.kept] = torch.gather(positions, 1, kept)
        if self.policy.summaries:
            self._summarize_dropped(key, value, positions, kept)

    def _summarize_dropped(self, key, value, positions, kept) -> None:
        """Add the rows of key/value [Hkv, n, D] (positions [Hkv, n]) not in `kept` ([Hkv, kept]
        rows) to their summaries (docs/design.md, "Summaries of the dropped rows")."""
        weight = torch.ones(positions.shape).scatter(1, kept, 0.0)                       # [Hkv, n]: 1 dropped
        self.add_to_summaries(key, value, self.policy.summary_index(positions), weight)

    def add_to_summaries(self, key, value, index, weight) -> None:
        """Add key/value [Hkv, n, D] times weight [Hkv, n] to summaries index [Hkv, n]."""
        hkv, _, dim = key.shape
        if self.summary_counts is None:
            self.summary_keys = torch.zeros(hkv, self.policy.summaries, dim)
            self.summary_values = torch.zeros(hkv, self.policy.summaries, dim)
            self.summary_counts = torch.zeros(hkv, self.policy.summaries)
        self.summary_keys.scatter_add_(1, index[..., None].expand(-1, -1, dim), key * weight[..., None])
        self.summary_values.scatter_add_(1, index[..., None].expand(-1, -1, dim), value * weight[..., None])
        self.summary_counts.scatter_add_(1, index, weight)

    def summaries(self):
        """Mean keys and values [Hkv, S, D] of the summaries and their logit bias [Hkv, S] (log
        count; -inf for an empty one); None without summaries."""
        if self.summary_counts is None:
            return None
        n = self.summary_counts.clamp(min=1)
        bias = torch.where(self.summary_counts > 0, n.log(), torch.tensor(float("-inf")))
        return self.summary_keys / n[..., None], self.summary_values / n[..., None], bias

    def _kept_rows(self, window_query, key, scale, positions) -> torch.Tensor:
        """[Hkv, kept] rows of `key` to keep, ascending; self.selection in positions."""
        hkv, rows, _ = key.shape
        if self.layout.kept == rows:
            return torch.arange(rows).expand(hkv, -1)
        if self.forced is not None:    # positions -> rows (each head's positions are ascending)
            chosen = torch.searchsorted(positions.contiguous(), self.forced)
            self.forced, self.selection = None, Selection(torch.gather(positions, 1, chosen), None)
            return chosen
        if self.policy.policy == "streamingllm":
            chosen = streaming_select(rows, hkv, self.policy).indices
            self.selection = Selection(torch.gather(positions, 1, chosen), None)
            return chosen
        by_row = snapkv_select(window_query[:, -self.policy.window:], key, self.policy, scale)
        scores = torch.full((hkv, self.layout.prompt_len), float("-inf"))
        self.selection = Selection(torch.gather(positions, 1, by_row.indices),
                                   scores.scatter(1, positions, by_row.scores))
        return by_row.indices

    def start_resume(self, resume_at: int) -> None:
        """Keep the rows of positions < resume_at, in position order, for the next fed tokens to
        attend over (`resume`); raises ValueError when heads hold different counts of them."""
        valid = self.row_positions >= 0
        order = torch.sort(self.row_positions.masked_fill(~valid, torch.iinfo(torch.int64).max), dim=1)
        counts = {int(c) for c in ((self.row_positions >= 0) & (self.row_positions < resume_at)).sum(dim=1)}
        if len(counts) != 1:
            raise ValueError(f"resuming at {resume_at} would keep different row counts per head: {sorted(counts)}")
        rows = order.indices[:, : counts.pop()]
        index = rows[:, :, None].expand(-1, -1, self.keys.shape[2])
        self.resume_rows = (torch.gather(self.keys, 1, index), torch.gather(self.values, 1, index),
                            torch.gather(self.row_positions, 1, rows), resume_at)

    def resume(self, query, key, value, scale):
        """query [1, H, C, D], key/value [1, Hkv, C, D] of a resumed turn's new tokens: they attend
        over the kept rows and causally over themselves; the rows are then kept as a prompt."""
        kept_k, kept_v, kept_pos, first = self.resume_rows
        self.resume_rows = None
        new = key.shape[2]
        keys, values = torch.cat([kept_k, key[0]], dim=1), torch.cat([kept_v, value[0]], dim=1)
        out = self.attend_resumed(query, keys, values, kept_k.shape[1], scale)
        new_pos = torch.arange(first, first + new).expand(kept_pos.shape[0], -1)
        positions = torch.cat([kept_pos, new_pos], dim=1)
        self.load(query[0, :, -self.policy.window:], keys, values, scale, positions)
        self.generated = 0
        return out

    def attend_resumed(self, query, keys, values, kept: int, scale):
        """query [1, H, C, D] of a resumed turn's new tokens over keys/values [Hkv, kept + C, D]
        (the kept rows, then the new tokens): every kept row (and summary), and the new tokens causally."""
        summaries = self.summaries()
        if summaries is not None:
            return summary_attention(query, keys, values, kept, scale, *summaries)
        return _attend(query, keys[None], values[None], scale, resumed_visible(keys.shape[1] - kept, kept))

    def decode(self, query, key, value, scale):
        """query [1, H, 1, D], key/value [1, Hkv, 1, D]: attend, then write into the ring."""
        step = self.layout.step(self.generated)
        self.generated += 1
        out = self.attend_decoded(query, key, value, step, scale)
        self.keys[:, step.write_index] = key[0, :, 0]
        self.values[:, step.write_index] = value[0, :, 0]
        self.row_positions[:, step.write_index] = step.position
        return out

    def attend_decoded(self, query, key, value, step, scale):
        """One decode step's attention [1, H, 1, D]: the cache rows `step` (a layout step) leaves
        visible, and the new token itself; the cache is not written yet."""
        heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
        out = ring_decode_attention(
            query.reshape(1, kv_heads, heads // kv_heads, dim), key, value, self.keys[None], self.values[None],
            torch.tensor([step.write_index]), torch.tensor([step.cache_len]), scale)
        return out.reshape(1, heads, 1, dim)


class _WindowCache:
    """A local (sliding-window) layer's cache (Gemma 3's): every key and value of the sequence, each
    query seeing the keys at positions (q - window, q], the model's own rule whatever the policy (the
    artifact holds them in a window ring: layout.WindowRing). Nothing is selected."""

    selection = None

    def __init__(self, window: int):
        self.window = window
        self.keys = self.values = None        # [Hkv, T, D] of every position fed

    def attend(self, query, key, value, scale):
        """query [1, H, C, D], key/value [1, Hkv, C, D] of the next C positions -> [1, H, C, D]."""
        seen = 0 if self.keys is None else self.keys.shape[1]
        self.keys = key[0] if self.keys is None else torch.cat([self.keys, key[0]], dim=1)
        self.values = value[0] if self.values is None else torch.cat([self.values, value[0]], dim=1)
        queries = torch.arange(seen, seen + key.shape[2])[:, None]
        keys = torch.arange(self.keys.shape[1])[None, :]
        visible = (keys <= queries) & (queries - keys < self.window)
        return _attend(query, self.keys[None], self.values[None], scale, visible)

    def start_resume(self, resume_at: int) -> None:
        """Keep the keys and values of positions < resume_at (the next fed tokens start there)."""
        self.keys, self.values = self.keys[:, :resume_at], self.values[:, :resume_at]


def summary_attention(query, keys, values, kept: int, scale: float, summary_k, summary_v, bias):
    """Attention of new tokens (query [1, H, C, D]) over summary rows (summary_k / summary_v
    [Hkv, S, D], logit bias [Hkv, S]; -inf: empty), then keys/values [Hkv, kept + C, D] (the kept
    rows, visible to all, and the new tokens, causally). Returns [1, H, C, D]."""
    visible = resumed_visible(keys.shape[1] - kept, summary_k.shape[1] + kept)
    row_bias = torch.cat([bias, torch.zeros(keys.shape[0], keys.shape[1])], dim=1)
    return _attend(query, torch.cat([summary_k, keys], dim=1)[None], torch.cat([summary_v, values], dim=1)[None],
                   scale, visible, row_bias)


def resumed_visible(new: int, seen: int) -> torch.Tensor:
    """[new, seen + new] bool: new tokens see every one of `seen` earlier rows, and themselves causally."""
    return torch.cat([torch.ones(new, seen, dtype=torch.bool), torch.ones(new, new).tril().bool()], dim=1)


def _attend(query, key, value, scale, visible, bias=None):
    """GQA attention: query [1, H, Q, D], key/value [1, Hkv, K, D], visible [Q, K] bool;
    bias: optional [Hkv, K] added to each key's logits."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.repeat_interleave(group, dim=0)[None, :, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), value)


def _policy_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cache: _LayerCache | _WindowCache = module._snapcompile_cache
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(cache, _WindowCache):
        out = cache.attend(query, key, value, scale)
    elif cache.layout is None:
        out = cache.prefill(query, key, value, scale)
    elif cache.resume_rows is not None:
        out = cache.resume(query, key, value, scale)
    else:
        out = cache.decode(query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION_NAME, _policy_attention)
    with contextlib.suppress(ImportError):
        from transformers.masking_utils import AttentionMaskInterface
        AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)


class ReferenceSequence:
    """Runs one sequence through the HF model under `policy` (batch 1, no HF cache).

    rows_per_slot: cache rows (the budget for compressed policies; for dense, enough for the run).
    forced_selection: optional per-layer [Hkv, P] positions that replace the policy's own
    selection (validate uses it to continue past a reported near-tie with the backend's choice).
    record_window: keep the prompt's K/V and last record_window queries per layer, so other
    policies can start from this prefill (`from_prefill`).
    """

    cache_type = _LayerCache     # a study may subclass it (studies/resume_study.py)

    def __init__(self, model, policy: PolicyConfig, rows_per_slot: int,
                 forced_selection: list[torch.Tensor] | None = None, record_window: int = 0):
        _register()
        self.model = model
        layers = model.model.layers
        window = getattr(model.config, "sliding_window", None)
        self.caches = [_WindowCache(window) if getattr(layer.self_attn, "is_sliding", False) else
                       self.cache_type(policy, rows_per_slot, forced_selection[i] if forced_selection else None,
                                       record_window) for i, layer in enumerate(layers)]
        self.position = 0

    @classmethod
    def from_prefill(cls, model, prefill: list[LayerPrefill], policy: PolicyConfig,
                     rows_per_slot: int) -> ReferenceSequence:
        """A sequence whose prompt was already run (and recorded, see `recorded_prefill`),
        compressed under `policy` and ready for decode: the same state `feed(prompt)` under
        `policy` leaves, without running the prompt again (prefill attention is dense either way)."""
        sequence = cls(model, policy, rows_per_slot)
        for cache, layer in zip(sequence.caches, prefill):
            cache.load(layer.window_query, layer.keys, layer.values, layer.scale)
        sequence.position = prefill[0].keys.shape[1]
        return sequence

    def recorded_prefill(self) -> list[LayerPrefill]:
        """Per-layer prefill tensors (needs record_window >= the policies' window)."""
        if any(cache.recorded is None for cache in self.caches):
            raise ValueError("no prefill was recorded: create the sequence with record_window > 0 and feed a prompt")
        return [cache.recorded for cache in self.caches]

    @contextlib.contextmanager
    def _installed(self):
        attn_modules = [layer.self_attn for layer in self.model.model.layers]
        previous = self.model.config._attn_implementation
        for module, cache in zip(attn_modules, self.caches):
            module._snapcompile_cache = cache
        self.model.config._attn_implementation = ATTENTION_NAME
        try:
            yield
        finally:
            self.model.config._attn_implementation = previous
            for module in attn_modules:
                del module._snapcompile_cache

    @torch.no_grad()
    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """Feed the prompt (first call) or one decode token; returns the last token's logits [V]."""
        ids = torch.tensor([token_ids])
        positions = torch.arange(self.position, self.position + len(token_ids))[None]
        with self._installed():
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False,
                             logits_to_keep=1)
        self.position += len(token_ids)
        return out.logits[0, -1].float()

    @torch.no_grad()
    def resume(self, token_ids: list[int], resume_at: int) -> torch.Tensor:
        """A later turn of this conversation: `token_ids` are the whole conversation, of which
        [0, resume_at) were fed before (resume_at <= the positions fed so far). The rows of
        positions < resume_at stay, the rest is dropped, tokens [resume_at, T) are fed against
        them and the cache is compressed back as a prompt of T positions. Returns the last
        token's logits [V]."""
        self.start_resume(token_ids, resume_at)
        return self.feed(token_ids[resume_at:])

    def start_resume(self, token_ids: list[int], resume_at: int) -> None:
        """Keep the rows of positions < resume_at for the next fed tokens (`resume`, or a study's
        own passes); ValueError when resume_at is not in 1 .. min(fed, len(token_ids) - 1)."""
        if not 0 < resume_at < len(token_ids) or resume_at > self.position:
            raise ValueError(f"resume_at {resume_at} must be in 1..{min(self.position, len(token_ids) - 1)}")
        for cache in self.caches:
            cache.start_resume(resume_at)
        self.position = resume_at

    def selections(self) -> list[Selection | None]:
        return [cache.selection for cache in self.caches]
