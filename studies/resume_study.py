#!/usr/bin/env python3
"""What a resumed turn's new tokens attend over: eval-turns' conversations in the PyTorch oracle.

A study, not a policy the engine runs. Each conversation of `snapcompile eval-turns` (a document
with five facts in turn 1, turns 2..5 asking about the others) is run greedily in the oracle
(no artifacts built) under these variants:

  dense     every turn prefilled whole, dense attention: the reference
  resume    each turn resumed from the B kept rows and re-selected (the engine's policy)
  all-rows  the new tokens attend over every row the conversation ever had (kept or dropped);
            the re-selection and every decode step still see only the B kept rows and the new
            tokens, as in resume: what the new question lacks when resumed, measured alone
  all-rows-early, all-rows-late  all-rows in the first (last) half of the layers, resume in the
            others
  all-rows-q4, all-rows-q8  all-rows with the rows a head did not keep seen through 4-bit (8-bit)
            quantization (sessions/kv_quant.py: KIVI's groups, keys per channel, values per
            position; every position before the resume point is quantized, the dropped ones
            shown); the kept rows exact. all-rows-q4-kept8: besides, the kept rows held in 8 bits
            between turns (they are what the re-selection keeps and decode attends over)
  summary   the oracle's policy with summaries (PolicyConfig.summaries, docs/design.md): the rows
            each selection drops are summed per KV head and position segment (--segment
            positions): one row of mean key and mean value whose logit gets log(rows summed),
            visible to a resumed turn's new tokens only. Counted within B: the prompt share P is
            lowered by the most segments the final conversation can have.
  summary-decode  summary, with every decode step attending over the summaries too (turn 1's
            answers included)
  cluster   summary with the rows grouped by key instead of position: a selection's dropped rows
            are grouped by k-means on their keys the first time (from the position segments),
            later ones join the summary of the nearest mean key
  recompute summary, and at each resumed turn the --recall summary segments the new question
            wants most are fed again from their token ids, at their positions, over the kept rows
            before them; the last W new tokens are fed again over those rows too, then select as
            usual. The recomputed rows are never kept (the entry stays within B). Which segments:
            recompute (the window's attention mass on the summaries), recompute-quest (Quest's
            bound from each segment's dropped keys' per-dimension min and max, counted within B),
            recompute-max (the largest true logit of a dropped row: a chooser that cheats, to
            measure the recomputation alone)
  reconstruct  turn 1's selection scored query-agnostically, as KVzip does (Kim et al. 2025):
            after the prompt, the model is fed "Repeat the previous context." and the prompt again;
            a row's score is the most attention any of those reconstruction queries (and query
            heads of its KV head) pays it, pooled as the policy pools; the reconstruction's rows
            are then dropped. Later turns resume and re-select as in resume. reconstruct-1: the
            same without pooling (kernel 1)

    python studies/resume_study.py --samples 8 --kernel 31 --variants dense,resume,all-rows,summary \\
        --json resume-study.json

Correct: the asked number appears in the answer. Printed per variant: turns 2..5 answered, and of
the turns dense answered those this variant answered too. `--reference` takes dense's answers from
an earlier run's JSON on the same conversations instead of running dense again.
"""
from __future__ import annotations

import argparse
import math
import sys

from snapcompile.evaluation.conversations import PARTS

VARIANTS = ("dense", "resume", "all-rows", "all-rows-early", "all-rows-late", "summary", "summary-decode", "cluster",
            "recompute", "recompute-max", "recompute-quest", "reconstruct", "reconstruct-1",
            "all-rows-q4", "all-rows-q8", "all-rows-q4-kept8")
REPEAT_REQUEST = "Repeat the previous context."
RECONSTRUCT_CHUNK = 512                # reconstruction queries scored at a time (bounds the logits' memory)
CLUSTER_ITERATIONS = 8
SAME_CONVERSATIONS = ("model", "length", "first", "samples", "seed", "part")
EARLIER_DEFAULTS = {"first": 0}       # the value of an argument in a JSON written before it existed


def study_sequence_type(variant: str, recall: int = 2):
    """The ReferenceSequence subclass of a variant (the oracle's own for dense and resume);
    recall: the segments a recompute variant feeds again."""
    import torch

    from snapcompile.reference import oracle
    from snapcompile.reference.policy import snapkv_select
    from snapcompile.sessions.kv_quant import KEY_AXIS, VALUE_AXIS

    class AllRowsCache(oracle._LayerCache):
        """Keeps every row computed ([Hkv, positions, D], in position order) for resumed tokens."""

        def prefill(self, query, key, value, scale):
            self.all_keys, self.all_values = key[0].clone(), value[0].clone()
            return super().prefill(query, key, value, scale)

        def decode(self, query, key, value, scale):
            self.all_keys = torch.cat([self.all_keys, key[0]], dim=1)
            self.all_values = torch.cat([self.all_values, value[0]], dim=1)
            return super().decode(query, key, value, scale)

        def attend_resumed(self, query, keys, values, kept, scale):
            first = self.resume_at            # every position before the new tokens, one row each
            self.all_keys = torch.cat([self.all_keys[:, :first], keys[:, kept:]], dim=1)
            self.all_values = torch.cat([self.all_values[:, :first], values[:, kept:]], dim=1)
            return super().attend_resumed(query, self.all_keys, self.all_values, first, scale)

        def start_resume(self, resume_at):
            super().start_resume(resume_at)
            self.resume_at = resume_at

    class QuantizedRowsCache(AllRowsCache):
        """all-rows, the rows a head did not keep seen through `bits`-bit quantization."""

        bits = 4
        kept_bits = None             # the bits the kept rows are held in between turns (None: float32)

        def start_resume(self, resume_at):
            super().start_resume(resume_at)
            keys, values, self.kept_positions, first = self.resume_rows
            if self.kept_bits:
                self.resume_rows = (quantized(keys, self.kept_bits, KEY_AXIS),
                                    quantized(values, self.kept_bits, VALUE_AXIS), self.kept_positions, first)

        def attend_resumed(self, query, keys, values, kept, scale):
            first = self.resume_at
            hkv = self.all_keys.shape[0]
            kept_here = torch.zeros(hkv, first, dtype=torch.bool).scatter(1, self.kept_positions, True)[..., None]
            exact_k, exact_v = self.all_keys[:, :first], self.all_values[:, :first]
            seen_k = torch.where(kept_here, exact_k, quantized(exact_k, self.bits, KEY_AXIS))
            seen_v = torch.where(kept_here, exact_v, quantized(exact_v, self.bits, VALUE_AXIS))
            if self.kept_bits:       # the kept rows as the slot has them (resume_rows, held in kept_bits)
                index = self.kept_positions[..., None].expand(-1, -1, seen_k.shape[2])
                seen_k, seen_v = seen_k.scatter(1, index, keys[:, :kept]), seen_v.scatter(1, index, values[:, :kept])
            self.all_keys = torch.cat([exact_k, keys[:, kept:]], dim=1)
            self.all_values = torch.cat([exact_v, values[:, kept:]], dim=1)
            return oracle._LayerCache.attend_resumed(self, query, torch.cat([seen_k, keys[:, kept:]], 1),
                                                     torch.cat([seen_v, values[:, kept:]], 1), first, scale)

    class SummaryDecodeCache(oracle._LayerCache):
        """The oracle's summaries (policy.summaries), seen by every decode step too."""

        def attend_decoded(self, query, key, value, step, scale):
            summaries = self.summaries()
            if summaries is None:
                return super().attend_decoded(query, key, value, step, scale)
            rows = [r for r in range(step.cache_len) if r != step.write_index]
            keys = torch.cat([self.keys[:, rows], key[0]], dim=1)
            values = torch.cat([self.values[:, rows], value[0]], dim=1)
            return oracle.summary_attention(query, keys, values, len(rows), scale, *summaries)

    class ClusterCache(oracle._LayerCache):
        """Summaries by key instead of position: the first dropped rows are grouped by k-means on
        their keys (started from the position segments), later ones join the nearest mean key."""

        def _summarize_dropped(self, key, value, positions, kept):
            hkv, _, dim = key.shape
            weight = torch.ones(positions.shape).scatter(1, kept, 0.0)
            if self.summary_counts is None or not self.summary_counts.any():
                index = self.policy.summary_index(positions)
                for _ in range(CLUSTER_ITERATIONS):
                    sums = torch.zeros(hkv, self.policy.summaries, dim).scatter_add_(
                        1, index[..., None].expand(-1, -1, dim), key * weight[..., None])
                    counts = torch.zeros(hkv, self.policy.summaries).scatter_add_(1, index, weight)
                    index = nearest(key, sums, counts)
                self.summary_keys = self.summary_values = self.summary_counts = None
            else:
                index = nearest(key, self.summary_keys, self.summary_counts)
            self.add_to_summaries(key, value, index, weight)

    def nearest(key, sums, counts):
        """[Hkv, n] the non-empty summary whose mean key is nearest each key [Hkv, n, D]."""
        distance = torch.cdist(key, sums / counts.clamp(min=1)[..., None])
        return distance.masked_fill(counts[:, None, :] == 0, float("inf")).argmin(dim=2)

    class RecomputeCache(AllRowsCache):
        """The `recompute` variants' layer: a resumed turn runs in passes set by `mode` (see
        RecomputeSequence.resume); outside them it is the oracle's own (summaries on). Every row
        is kept aside only for the "max" chooser (which cheats: it reads the dropped rows) and to
        compute what "quest" would have stored (each segment's dropped keys' min and max)."""

        mode = None
        chooser = "summary"

        def resume(self, query, key, value, scale):
            return getattr(self, f"{self.mode}_pass")(query, key[0], value[0], scale)

        def recomputed_rows(self):
            """Keys, values [Hkv, n, D] and positions [n] of the rows pass 2 computed so far."""
            done, (kept_k, kept_v, _, _) = self.recomputed, self.resume_rows_seen
            if not done:
                return kept_k[:, :0], kept_v[:, :0], torch.zeros(0, dtype=torch.int64)
            return tuple(torch.cat(part, dim=-2 if i < 2 else 0) for i, part in enumerate(zip(*done)))

        def score_pass(self, query, key, value, scale):
            """Pass 1: the new tokens over the summaries and kept rows (as `summary`); keeps their
            rows and the window's attention mass on each summary [Hkv, S]."""
            kept_k, kept_v, _, _ = self.resume_rows
            keys, values = torch.cat([kept_k, key], dim=1), torch.cat([kept_v, value], dim=1)
            self.new_rows, self.recomputed, self.resume_rows_seen = (key, value), [], self.resume_rows
            summaries = self.summaries()
            window = query[0, :, -self.policy.window:].reshape(key.shape[0], -1, query.shape[3])
            self.segment_mass = None if summaries is None else self.segment_weights(
                window, keys, kept_k.shape[1], scale, summaries)
            return oracle._LayerCache.attend_resumed(self, query, keys, values, kept_k.shape[1], scale)

        def segment_weights(self, window, keys, kept, scale, summaries):
            """[Hkv, S] how much the window wants each summary segment back (>= 0)."""
            if self.chooser == "summary":
                return summary_mass(window, keys, kept, scale, summaries, self.policy.window)
            first, count = self.resume_at, summaries[2].shape[1]
            dropped = ~torch.zeros(keys.shape[0], first, dtype=torch.bool).scatter(1, self.resume_rows[2], True)
            score = segment_scores(self.chooser, window, self.all_keys[:, :first], dropped,
                                   self.policy.summary_index(torch.arange(first)), count)
            return torch.softmax(score * scale, dim=1).nan_to_num(0.0)

        def recompute_pass(self, query, key, value, scale):
            """Pass 2: dropped positions [a, b) fed again from their token ids, attending over the
            kept rows and earlier recomputed rows of lower positions (the kept copies of [a, b)
            hidden) and causally over themselves; their rows are kept for pass 3."""
            kept_k, kept_v, kept_pos, _ = self.resume_rows
            a = self.chunk_start
            rec_k, rec_v, _ = self.recomputed_rows()
            hkv, new = key.shape[0], key.shape[1]
            bias = torch.cat([torch.where(kept_pos < a, 0.0, float("-inf")),
                              torch.zeros(hkv, rec_k.shape[1] + new)], dim=1)
            visible = oracle.resumed_visible(new, kept_k.shape[1] + rec_k.shape[1])
            out = oracle._attend(query, torch.cat([kept_k, rec_k, key], 1)[None],
                                 torch.cat([kept_v, rec_v, value], 1)[None], scale, visible, bias)
            self.recomputed.append((key, value, torch.arange(a, a + new)))
            return out

        def window_pass(self, query, key, value, scale):
            """Pass 3: the last W tokens over the summaries not recomputed, the kept rows, the
            recomputed rows (where the head kept no copy), the new tokens' pass-1 rows before
            them and causally over themselves; then the oracle's re-selection over the kept rows
            and the new tokens, as without recomputing."""
            kept_k, kept_v, kept_pos, first = self.resume_rows
            self.resume_rows = None
            width = key.shape[1]
            earlier_k, earlier_v = (rows[:, : rows.shape[1] - width] for rows in self.new_rows)
            seen_k, seen_v, bias, _ = self.window_rows(earlier_k, earlier_v)
            visible = oracle.resumed_visible(width, seen_k.shape[1])
            out = oracle._attend(query, torch.cat([seen_k, key], 1)[None], torch.cat([seen_v, value], 1)[None],
                                 scale, visible, torch.cat([bias, torch.zeros(key.shape[0], width)], 1))
            keys, values = torch.cat([kept_k, earlier_k, key], 1), torch.cat([kept_v, earlier_v, value], 1)
            new = keys.shape[1] - kept_k.shape[1]
            positions = torch.cat([kept_pos, torch.arange(first, first + new).expand(key.shape[0], -1)], dim=1)
            self.load(query[0, :, -self.policy.window:], keys, values, scale, positions)
            self.all_keys = torch.cat([self.all_keys[:, :first], keys[:, kept_k.shape[1]:]], dim=1)
            self.all_values = torch.cat([self.all_values[:, :first], values[:, kept_k.shape[1]:]], dim=1)
            self.generated = 0
            return out

        def window_rows(self, earlier_k, earlier_v):
            """What pass 3's window sees before itself: keys, values [Hkv, R, D], logit bias [Hkv, R]
            and positions [Hkv, R] (-1 for a summary) of the summaries (-inf for the recomputed
            ones), the kept rows, the recomputed rows (-inf where the head kept that position:
            the kept row is the exact one) and the new tokens' pass-1 rows before the window."""
            kept_k, kept_v, kept_pos, first = self.resume_rows_seen
            hkv = kept_k.shape[0]
            rec_k, rec_v, rec_pos = self.recomputed_rows()
            copied = torch.stack([torch.isin(rec_pos, head) for head in kept_pos])           # [Hkv, rec]
            summary_k, summary_v, bias = self.summaries()
            bias = bias.masked_fill(torch.isin(torch.arange(bias.shape[1]), self.chosen)[None], float("-inf"))
            row_bias = torch.cat([bias, torch.zeros(kept_pos.shape), torch.where(copied, float("-inf"), 0.0),
                                  torch.zeros(hkv, earlier_k.shape[1])], dim=1)
            positions = torch.cat([torch.full(bias.shape, -1), kept_pos, rec_pos.expand(hkv, -1),
                                   torch.arange(first, first + earlier_k.shape[1]).expand(hkv, -1)], dim=1)
            return (torch.cat([summary_k, kept_k, rec_k, earlier_k], 1),
                    torch.cat([summary_v, kept_v, rec_v, earlier_v], 1), row_bias, positions)

    class RecomputeSequence(oracle.ReferenceSequence):
        """`recompute`: a resumed turn's new tokens are fed once over the kept rows and summaries
        (pass 1); the `recall` summaries their window wants most (by the cache's chooser), summed
        over layers and heads, are fed again from their token ids at their positions (pass 2); the last W tokens
        are fed again over the kept, recomputed and new rows (pass 3), and select as usual. The
        recomputed rows are never kept: a kept conversation stays B rows."""

        cache_type = RecomputeCache

        def resume(self, token_ids, resume_at):
            caches, end, width = self.caches, len(token_ids), self.caches[0].policy.window
            self.start_resume(token_ids, resume_at)
            self._passes("score", token_ids[resume_at:])
            chosen = self.chosen_summaries()
            policy = caches[0].policy
            segment = policy.summary_index(torch.arange(resume_at))
            for index in sorted(chosen.tolist()):
                members = torch.nonzero(segment == index).flatten()
                start, stop = int(members[0]), int(members[-1]) + 1
                for cache in caches:
                    cache.chunk_start = start
                self.position = start
                self._passes("recompute", token_ids[start:stop])
            for cache in caches:
                cache.chosen = chosen
            self.position = end - width
            return self._passes("window", token_ids[end - width:])

        def _passes(self, mode: str, token_ids):
            for cache in self.caches:
                cache.mode = mode
            try:
                return self.feed(token_ids)
            finally:
                for cache in self.caches:
                    cache.mode = None

        def chosen_summaries(self) -> torch.Tensor:
            """The `recall` non-empty summaries with the most pass-1 window mass over every layer
            and KV head (a summary's mass is the share of the window's attention it drew)."""
            masses = [c.segment_mass for c in self.caches if c.segment_mass is not None]
            if not masses:
                return torch.zeros(0, dtype=torch.int64)
            total = torch.stack(masses).clamp(min=0).sum(dim=(0, 1))
            empty = torch.stack([c.summary_counts for c in self.caches]).sum(dim=(0, 1)) == 0
            total = total.masked_fill(empty, float("-inf"))
            return total.topk(min(recall, int((~empty).sum()))).indices

    class HalfAllRowsSequence(oracle.ReferenceSequence):
        """all-rows in the layers of one half of the model (`early`: the first half), the
        engine's resume in the others: which depth the new question needs every row at."""

        cache_type, early = AllRowsCache, True

        def __init__(self, model, policy, rows_per_slot, forced_selection=None, record_window=0):
            super().__init__(model, policy, rows_per_slot, forced_selection, record_window)
            half = len(self.caches) // 2
            for layer in range(len(self.caches)):
                if (layer < half) != self.early:
                    self.caches[layer] = oracle._LayerCache(policy, rows_per_slot, None, record_window)

    class ReconstructCache(oracle._LayerCache):
        """Turn 1's selection by reconstruction scores (`reconstruct`): the prompt's rows wait
        unselected until the reconstruction pass has scored them."""

        waiting = None           # (window queries, keys, values) of the prompt, until scored
        scores = None            # [Hkv, T] the reconstruction's scores, while the prompt is selected

        def prefill(self, query, key, value, scale):
            if self.waiting is not None:
                return self.reconstruct(query, key[0], value[0], scale)
            length = key.shape[2]
            self.waiting = (query[0, :, -self.policy.window:], key[0], value[0])
            return oracle._attend(query, key, value, scale, torch.ones(length, length).tril().bool())

        def reconstruct(self, query, key, value, scale):
            """query [1, H, R, D], key/value [Hkv, R, D] of the reconstruction tokens: attend over
            the waiting prompt rows and causally over themselves; score the prompt rows and select."""
            window_query, prompt_k, prompt_v = self.waiting
            self.waiting = None
            keys, values = torch.cat([prompt_k, key], dim=1), torch.cat([prompt_v, value], dim=1)
            length, new = prompt_k.shape[1], key.shape[1]
            visible = oracle.resumed_visible(new, length)
            outs, best = [], torch.zeros(prompt_k.shape[0], length)
            group = query.shape[1] // keys.shape[0]
            for start in range(0, new, RECONSTRUCT_CHUNK):
                part = query[:, :, start:start + RECONSTRUCT_CHUNK]
                logits = torch.matmul(part, keys.repeat_interleave(group, 0).transpose(1, 2)[None]) * scale
                probs = torch.softmax(logits.masked_fill(~visible[start:start + RECONSTRUCT_CHUNK], float("-inf")), -1)
                outs.append(torch.matmul(probs, values.repeat_interleave(group, 0)[None]))
                heads = probs[0, :, :, :length].amax(dim=1).reshape(keys.shape[0], group, length)
                best = torch.maximum(best, heads.amax(dim=1))
            self.scores = best
            self.load(window_query, prompt_k, prompt_v, scale)
            self.scores = None
            return torch.cat(outs, dim=2)

        def _kept_rows(self, window_query, key, scale, positions):
            if self.scores is None:
                return super()._kept_rows(window_query, key, scale, positions)
            scores = self.scores
            by_row = snapkv_select(window_query, key, self.policy, scale,
                                   scorer=lambda q, k, s: scores[:, : k.shape[1] - q.shape[1]])
            self.selection = by_row
            return by_row.indices

    class ReconstructSequence(oracle.ReferenceSequence):
        """`reconstruct`: the first feed (the prompt) is followed by `repeat` (the request's
        template tokens) and the prompt again, fed at the positions after the prompt to score
        its rows; then the sequence stands where the prompt left it."""

        cache_type = ReconstructCache
        repeat: list[int] = []

        def feed(self, token_ids):
            if self.caches[0].layout is not None:
                return super().feed(token_ids)
            logits = super().feed(token_ids)
            end = self.position
            super().feed(self.repeat + token_ids)
            self.position = end
            return logits

    if variant.startswith("reconstruct"):
        return ReconstructSequence
    if variant.startswith("all-rows-q"):
        bits, _, kept = variant[len("all-rows-q"):].partition("-kept")
        cache = type(f"{variant}Cache", (QuantizedRowsCache,), {"bits": int(bits), "kept_bits": int(kept or 0)})
        return type(f"{variant}Sequence", (oracle.ReferenceSequence,), {"cache_type": cache})
    if variant in ("all-rows-early", "all-rows-late"):
        return type(f"{variant}Sequence", (HalfAllRowsSequence,), {"early": variant.endswith("early")})
    cache_type = {"all-rows": AllRowsCache, "summary-decode": SummaryDecodeCache,
                  "cluster": ClusterCache}.get(variant, oracle._LayerCache)
    if variant.startswith("recompute"):
        chooser = variant.partition("-")[2] or "summary"
        return type(f"{variant}Sequence", (RecomputeSequence,),
                    {"cache_type": type(f"{variant}Cache", (RecomputeCache,), {"chooser": chooser})})
    return type(f"{variant}Sequence", (oracle.ReferenceSequence,), {"cache_type": cache_type})


def quantized(rows, bits: int, axis: int):
    """rows [Hkv, n, D] (a torch tensor) as the session store holds them in `bits` bits and gives
    them back (sessions/kv_quant.py)."""
    import torch

    from snapcompile.sessions.kv_quant import quantize_rows
    return torch.from_numpy(quantize_rows(rows.numpy(), bits, axis).dequantize())


def summary_mass(window, keys, kept: int, scale: float, summaries, width: int):
    """[Hkv, S] the attention mass each summary row draws from the window queries (window [Hkv,
    G*W, D], grouped by KV head) over the summaries, the kept rows and the new tokens (keys
    [Hkv, kept + new, D], the last `width` of them the window's own, seen causally)."""
    import torch
    summary_k, _, bias = summaries
    hkv, count, new = bias.shape[0], bias.shape[1], keys.shape[1] - kept
    scores = window @ torch.cat([summary_k, keys], dim=1).transpose(1, 2) * scale
    scores = scores + torch.cat([bias, torch.zeros(hkv, keys.shape[1])], 1)[:, None, :]
    own = torch.arange(new - width, new).repeat(window.shape[1] // width)
    later = torch.arange(new)[None, :] > own[:, None]
    scores[:, :, -new:] = scores[:, :, -new:].masked_fill(later, float("-inf"))
    return torch.softmax(scores, dim=-1)[..., :count].sum(dim=1).masked_fill(torch.isinf(bias), -1.0)


def segment_scores(by: str, window, rows, dropped, segment, count: int):
    """[Hkv, S] per summary segment, the largest logit (unscaled) a window query [Hkv, G*W, D] of
    the KV head gives one of the segment's dropped rows: "max" from the rows themselves [Hkv, n, D]
    (dropped [Hkv, n] bool, segment [n] their summary), "quest" Quest's upper bound on it from the
    dropped keys' per-dimension min and max (what a store could keep per segment: two key rows).
    -inf for a segment with no dropped row."""
    import torch
    hkv = rows.shape[0]
    logits = (window @ rows.transpose(1, 2)).amax(dim=1) if by == "max" else None
    score = torch.full((hkv, count), float("-inf"))
    for s in range(count):
        member = dropped & (segment == s)[None]
        if by == "max":
            score[:, s] = logits.masked_fill(~member, float("-inf")).amax(dim=1)
        else:
            big = torch.tensor(float("inf"))
            low = torch.where(member[..., None], rows, big).amin(dim=1)                          # [Hkv, D]
            high = torch.where(member[..., None], rows, -big).amax(dim=1)
            bound = torch.maximum(window * low[:, None], window * high[:, None]).sum(-1)
            score[:, s] = torch.where(member.any(1), bound.amax(dim=1), -big)
    return score


def greedy(sequence, logits, eos: set[int], limit: int) -> list[int]:
    tokens = [int(logits.argmax())]
    while tokens[-1] not in eos and len(tokens) < limit:
        tokens.append(int(sequence.feed([tokens[-1]]).argmax()))
    return tokens


def converse(loaded, case, variant: str, policy, recall: int = 2) -> list[dict]:
    """Greedy answers of every turn of `case` (an evaluation.conversations.Conversation) under
    `variant`, each within the turn's answer_tokens."""
    from snapcompile.config import PolicyConfig
    from snapcompile.evaluation.conversation_eval import first_turn, next_turn_tokens
    from snapcompile.evaluation.conversations import TURNS
    from snapcompile.export.dense import eos_ids
    from snapcompile.reference.oracle import ReferenceSequence
    tokenizer, chat, eos = loaded.tokenizer, loaded.chat, set(eos_ids(loaded.tokenizer))
    ids, turns = first_turn(tokenizer, case, chat), []
    sequence_type = study_sequence_type(variant, recall)
    sequence, fed = None, 0
    for turn in range(TURNS):
        answer_tokens = case.answer_tokens[turn]
        if variant == "dense":
            sequence = ReferenceSequence(loaded.model, PolicyConfig(policy="dense"), len(ids) + answer_tokens + 1)
            logits = sequence.feed(ids)
        elif sequence is None:
            sequence = sequence_type(loaded.model, policy, policy.slot_rows)
            if variant.startswith("reconstruct"):
                sequence.repeat = next_turn_tokens(tokenizer, REPEAT_REQUEST, chat, False)
            logits = sequence.feed(ids)
        else:
            logits = sequence.resume(ids, min(fed, len(ids) - policy.selection_window))
        tokens = greedy(sequence, logits, eos, answer_tokens)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        turns.append({"turn": turn + 1, "text": text, "correct": case.found(turn, text) is not None})
        fed = len(ids) + len(tokens) - 1                 # the last sampled token is never fed
        if turn + 1 < TURNS:
            ids = ids + tokens + next_turn_tokens(tokenizer, case.questions[turn + 1], chat, tokens[-1] in eos)
    return turns


def policy_of(config, variant: str, segment: int):
    """The variant's policy at the suite's length: the summary variants' summaries (one per
    segment of the final conversation) come out of the prompt share; so do, for recompute-quest,
    the per-segment key minima and maxima a store would keep (two key rows a segment, as much as
    one row of key and value): the slot holds B - 2S rows, the ring keeps its share."""
    from dataclasses import replace

    from snapcompile.config import PolicyConfig
    policy = config.policy_at(config.lengths[0])
    if variant == "dense":
        return PolicyConfig(policy="dense")
    if variant == "reconstruct-1":
        return replace(policy, kernel=1)
    if not variant.startswith(("summary", "recompute")) and variant != "cluster":
        return policy
    segments = math.ceil(config.final_length(config.lengths[0]) / segment)
    summed = replace(policy, summaries=segments, summary_segment=segment)
    if variant != "recompute-quest":
        return summed
    return replace(summed, budget=summed.budget - segments, prompt_share=summed.resolved_prompt_share - segments)


def reference_records(path: str, args) -> list[dict]:
    """Dense's records of an earlier run of this script on the same conversations; ValueError
    naming the file when it is not one."""
    import json
    from pathlib import Path
    try:
        earlier = json.loads(Path(path).read_text(encoding="utf-8"))
        stored, records = earlier["args"], earlier["records"]
        differ = [k for k in SAME_CONVERSATIONS if stored.get(k, EARLIER_DEFAULTS.get(k)) != getattr(args, k)]
        dense = [r for r in records if r["variant"] == "dense"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"--reference {path}: not a JSON of this script ({err})") from None
    if differ:
        raise ValueError(f"--reference {path} ran other conversations ({', '.join(differ)} differ)")
    if not dense:
        raise ValueError(f"--reference {path} holds no dense records")
    return dense


def summarize(records: list[dict], variants: list[str]) -> dict:
    dense = {(r["case"], t["turn"]): t["correct"] for r in records if r["variant"] == "dense" for t in r["turns"]}
    summary = {}
    for variant in variants:
        later = [(r["case"], t["turn"], t["correct"]) for r in records if r["variant"] == variant
                 for t in r["turns"] if t["turn"] > 1]
        paired = [c for case, turn, c in later if dense.get((case, turn))]
        summary[variant] = {"later_correct": sum(c for *_, c in later), "later_turns": len(later),
                            "kept_of_dense_correct": sum(paired) if dense else None,
                            "dense_correct": len(paired) if dense else None}
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--length", type=int, default=3000, help="turn 1's tokens")
    parser.add_argument("--samples", type=int, default=8, help="conversations --first .. SAMPLES-1 of the seed")
    parser.add_argument("--first", type=int, default=0, help="the first conversation run (to extend an earlier run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratio", type=int, default=4, help="B = the final conversation's length // ratio")
    parser.add_argument("--kernel", type=int, default=31)
    parser.add_argument("--part", choices=PARTS, default="tune",
                        help="eval-turns' conversations to study (tune: a study is tuning)")
    parser.add_argument("--segment", type=int, default=128, help="positions per summary row (summary)")
    parser.add_argument("--recall", type=int, default=2, help="segments fed again at a resumed turn (recompute*)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reference", help="dense's records from an earlier run's JSON (same conversations)")
    parser.add_argument("--json", dest="json_path", help="also write records and summary here")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        parser.error(f"--variants must be among {', '.join(VARIANTS)}; got {', '.join(unknown) or 'none'}")
    if args.segment < 1 or args.recall < 0 or not 0 <= args.first < args.samples:
        parser.error("--segment must be >= 1, --recall >= 0 and --first in 0 .. --samples - 1")
    try:
        records = reference_records(args.reference, args) if args.reference and "dense" not in variants else []
    except ValueError as err:
        parser.error(str(err))

    import torch

    from snapcompile.errors import SnapcompileError
    from snapcompile.evaluation.conversation_eval import TurnsConfig, check_config
    from snapcompile.evaluation.conversations import TURNS
    from snapcompile.models import load_model
    torch.manual_seed(0)
    config = TurnsConfig(args.model, lengths=(args.length,), samples=args.samples, seed=args.seed, part=args.part,
                         ratio=args.ratio, kernel=args.kernel)
    try:
        check_config(config)
        policies = {v: policy_of(config, v, args.segment) for v in variants}
        loaded = load_model(args.model)
        cases = config.conversations(loaded.tokenizer, args.length, loaded.chat)[args.first:]
    except SnapcompileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for sample, case in enumerate(cases, start=args.first):
        for variant in variants:
            turns = converse(loaded, case, variant, policies[variant], args.recall)
            records.append({"variant": variant, "case": case.key, "turns": turns})
            marks = "".join("+" if t["correct"] else "." for t in turns)
            print(f"[{sample + 1}/{args.samples}] {case.key} {variant:>8} {marks}", file=sys.stderr, flush=True)
    summary = summarize(records, ["dense"] * bool(records and "dense" not in variants) + variants)
    for variant, s in summary.items():
        paired = f", of dense's right answers {s['kept_of_dense_correct']}/{s['dense_correct']}" \
            if s["dense_correct"] is not None else ""
        print(f"{variant:>8}  turns 2-{TURNS}: {s['later_correct']}/{s['later_turns']}{paired}")
    if args.json_path:
        from snapcompile.atomic import write_json_atomic
        write_json_atomic(args.json_path, {"args": vars(args), "policies": {v: str(p) for v, p in policies.items()},
                                           "summary": summary, "records": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
