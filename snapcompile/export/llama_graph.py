"""Writes a decoder of the supported families (Llama, Mistral, Qwen2, Qwen3, Gemma 3) as static ONNX prefill and
decode graphs.

Graph contracts (L = max_context, C = chunk, N = slots, Hkv KV heads, D head dim, V vocab):

prefill (one sequence, one chunk of C tokens, against a cache of R rows: R = L for the graph
  "prefill", R = Lb for the bucket graphs "prefill_<Lb>" that serve prompts of at most Lb tokens
  without attending over L rows; "prefill_tail" is the same over L rows with C = T, export.tail):
  inputs  input_ids [1, C] int64; start [1] int64 (cache rows [0, start) are valid and precede
          the chunk); position [1] int64 (RoPE position of the chunk's first token: start for a
          fresh prompt, more for a resumed conversation whose kept rows are fewer than its
          positions); chunk_len [1] int64 (valid tokens, the rest is padding);
          past_key.{i}, past_value.{i} [1, Hkv, R, D] float32
  outputs logits [1, V] (of token chunk_len-1); key.{i}, value.{i} [1, Hkv, C, D] (the chunk's
          post-RoPE K/V, for the caller to write at rows [start, start+C))
decode (N slots, one token each):
  inputs  input_ids [N, 1]; position [N] (RoPE position); cache_len [N] (rows [0, cache_len)
          valid); past_key.{i}, past_value.{i} [N, Hkv, L, D]
  outputs logits [N, V]; key.{i}, value.{i} [N, Hkv, 1, D] (to be written by the caller)

Each writer writes a static graph (R and N numbers: the artifact's members, which TensorRT builds) or,
given a SymbolicSize for R or N, one graph for every member of its family; the layer-by-layer
prefill's graphs (embeddings, one decoder layer, the head) are written for ONNX Runtime only.
Target "ort" writes the
form ONNX Runtime opens: quantized layers as MatMulNBits, float16 products in float32
(`export/weights.py`); "static" the standard form (blocked DequantizeLinear -> MatMul).
"""
from __future__ import annotations

from functools import partial

import numpy as np

from snapcompile.artifact.naming import PREFILL_EMBED, PREFILL_HEAD, PREFILL_SCORES, graph_name, prefill_layer
from snapcompile.config import ExportConfig
from snapcompile.export.quantize import emit_matmul, emit_nbits_matmul
from snapcompile.export.weights import Weights, float32_name
from snapcompile.graphs.attention import additive_mask, emit_cached_attention, emit_joined_attention, joined_mask
from snapcompile.graphs.builder import GraphBuilder, Size, SymbolicSize
from snapcompile.models.spec import ModelSpec

TARGETS = ("static", "ort")


class LlamaGraphWriter:
    """Emits the decoder body shared by prefill and decode; subclasses differ in attention layout."""

    def __init__(self, spec: ModelSpec, weights: Weights, export: ExportConfig, store=None, target: str = "static"):
        """store: the WeightsFile (or WeightStores) the graph's weights were written to (None: the
        graph holds them). target: "static" or "ort" (the module docstring)."""
        if target not in TARGETS:
            raise ValueError(f"unknown graph target {target!r}")
        self.spec, self.w, self.export, self.store, self.target = spec, weights, export, store, target
        self.ring = spec.window_ring(export.chunk)      # the local layers' cache, where the model has them

    def _attach_weights(self, b: GraphBuilder) -> None:
        for name in self.w.float_names():
            b.tensor(name, partial(self.w.tensor, name))

    def _matmul(self, b: GraphBuilder, x: str, weight: str, op: str = "MatMul", **attrs) -> str:
        """x @ W (float32 in and out) for a linear weight name of Weights: quantized, float32,
        or float16 (multiplied in float16 between two Casts: its input and product rounded to
        float16; the "ort" target multiplies the rounded input by the weight's float32 form)."""
        matrix = self.w.quantized.get(weight)
        if matrix is not None:
            emit = emit_nbits_matmul if self.target == "ort" else emit_matmul
            return emit(b, x, weight, matrix, self.w.tensor)
        if self.w.dtype[weight] == np.float16:
            half = b.op("Cast", x, to=10)
            if self.target == "static":
                return b.op("Cast", b.op(op, half, weight, **attrs), to=1)
            wide = b.tensor(float32_name(weight), partial(self.w.tensor, float32_name(weight)))
            product = b.op(op, b.op("Cast", half, to=1), wide, **attrs)
            return b.op("Cast", b.op("Cast", product, to=10), to=1)
        return b.op(op, x, weight, **attrs)

    def _linear(self, b: GraphBuilder, x: str, layer: dict, key: str) -> str:
        y = self._matmul(b, x, layer[key])
        return b.op("Add", y, layer[key + "_bias"]) if key + "_bias" in layer else y

    def _embed(self, b: GraphBuilder, ids: str) -> str:
        rows = b.op("Gather", self.w.embed, ids)
        rows = rows if self.w.dtype[self.w.embed] == np.float32 else b.op("Cast", rows, to=1)
        if self.spec.embed_scale != 1.0:      # Gemma: times sqrt(hidden), as a float32 constant
            rows = b.op("Mul", rows, b.const(self.spec.embed_scale, np.float32))
        return rows

    def _rms_norm(self, b: GraphBuilder, x: str, weight: str) -> str:
        var = b.op("ReduceMean", b.op("Mul", x, x), b.const([-1]), keepdims=1)
        inv = b.op("Reciprocal", b.op("Sqrt", b.op("Add", var, b.const(self.spec.rms_norm_eps, np.float32))))
        return b.op("Mul", b.op("Mul", x, inv), weight)

    def _head_norm(self, b: GraphBuilder, x: str, norm: str | None) -> str:
        """x [..., D] RMS-normed over D by weight `norm`, or x where the model has no such norm."""
        return x if norm is None else self._rms_norm(b, x, norm)

    def _rope_tables(self, b: GraphBuilder, positions: str, shape: list, local: bool = False) -> tuple[str, str]:
        """cos/sin [.., D/2] of int64 positions, reshaped to `shape` for broadcasting (one entry may
        be a SymbolicSize); local: with the sliding-window layers' own rope (Gemma 3's local base)."""
        inv_freq, scaling = self.w.local_rope if local else (self.w.inv_freq, self.w.attention_scaling)
        pos = b.op("Cast", b.op("Unsqueeze", positions, b.const([-1])), to=1)
        freqs = b.op("Mul", pos, b.const(inv_freq, np.float32))
        cos, sin = b.op("Cos", freqs), b.op("Sin", freqs)
        if scaling != 1.0:
            factor = b.const(scaling, np.float32)
            cos, sin = b.op("Mul", cos, factor), b.op("Mul", sin, factor)
        return b.op("Reshape", cos, b.shape(shape)), b.op("Reshape", sin, b.shape(shape))

    def _ropes(self, b: GraphBuilder, positions: str, shape: list) -> list[tuple[str, str]]:
        """Each layer's (cos, sin) of `_rope_tables`: the model's, or the local layers' own for them
        (each table computed once)."""
        tables = self._rope_tables(b, positions, shape)
        local = self._rope_tables(b, positions, shape, local=True) if self.spec.local_layers else None
        return [local if i in self.spec.local_layers else tables for i in range(self.spec.num_layers)]

    def _rotate(self, b: GraphBuilder, x: str, cos: str, sin: str) -> str:
        """HF rotate-half RoPE on the last axis."""
        half = self.spec.head_dim // 2
        x1, x2 = b.op("Split", x, b.const([half, half]), outputs=2, axis=-1)
        lo = b.op("Sub", b.op("Mul", x1, cos), b.op("Mul", x2, sin))
        hi = b.op("Add", b.op("Mul", x2, cos), b.op("Mul", x1, sin))
        return b.op("Concat", lo, hi, axis=-1)

    def _mlp(self, b: GraphBuilder, x: str, layer: dict) -> str:
        gate = self._linear(b, x, layer, "gate")
        if self.spec.activation == "gelu_tanh":
            act = b.op("Gelu", gate, approximate="tanh")
        else:
            act = b.op("Mul", gate, b.op("Sigmoid", gate))
        return self._linear(b, b.op("Mul", act, self._linear(b, x, layer, "up")), layer, "down")

    def _residuals(self, b: GraphBuilder, x: str, attn: str, layer: dict) -> str:
        """A layer's output from its input x and its attention's output projection `attn` (both
        [.., hidden]): x + attn, then + the MLP of its norm; with sandwich norms (Gemma 3) the attention's
        and the MLP's outputs normed before they are added."""
        x = b.op("Add", x, self._rms_norm(b, attn, layer["attn_out_norm"]) if "attn_out_norm" in layer else attn)
        mlp = self._mlp(b, self._rms_norm(b, x, layer["post_norm"]), layer)
        return b.op("Add", x, self._rms_norm(b, mlp, layer["mlp_out_norm"]) if "mlp_out_norm" in layer else mlp)

    def _logits(self, b: GraphBuilder, hidden: str) -> str:
        """[rows, hidden] -> [rows, V]; Gemm with transB reads a tied embedding without a copy."""
        normed = self._rms_norm(b, hidden, self.w.final_norm)
        if self.w.lm_head in self.w.quantized:
            return self._matmul(b, normed, self.w.lm_head)
        return self._matmul(b, normed, self.w.lm_head, "Gemm", transB=1)

    def _cache_inputs(self, b: GraphBuilder, batch: Size, length: Size,
                      layers: list[int] | None = None) -> list[tuple[str, str]]:
        """past_key.{n}, past_value.{n} [batch, Hkv, rows, D] of the n-th of `layers` (default: every
        layer): `length` rows, a local layer's its window ring's (`ModelSpec.window_ring`)."""
        caches = []
        for n, layer in enumerate(range(self.spec.num_layers) if layers is None else layers):
            rows = self.ring.rows if layer in self.spec.local_layers else length
            shape = [batch, self.spec.num_kv_heads, rows, self.spec.head_dim]
            caches.append((b.input(f"past_key.{n}", np.float32, shape), b.input(f"past_value.{n}", np.float32, shape)))
        return caches

    def _ring_positions(self, b: GraphBuilder, first: str) -> str:
        """int64 [.., Rw]: the position each window-ring row holds for a run whose first new token is at
        `first` ([N, 1] or [1, 1]), negative where none was written (layout.WindowRing.position_at)."""
        before = b.op("Sub", first, b.const(1))
        rows = b.const(np.arange(self.ring.rows)[None, :])
        return b.op("Sub", before, b.op("Mod", b.op("Sub", before, rows), b.const(self.ring.rows)))

    def _sees(self, b: GraphBuilder, queries: str, held: str) -> str:
        """bool: the query positions see the keys of positions `held` (written, and within the window)."""
        written = b.op("GreaterOrEqual", held, b.const(0))
        near = b.op("Less", b.op("Sub", queries, held), b.const(self.ring.window))
        return b.op("And", written, near)


class PrefillWriter(LlamaGraphWriter):
    """The prefill graph of `chunk` tokens (default: C) against a cache of `cache_rows` rows
    (default: max_context; a SymbolicSize: the family of prefill graphs), named `name` (default:
    "prefill" or its bucket's name)."""

    def __init__(self, spec: ModelSpec, weights: Weights, export: ExportConfig, cache_rows: Size | None = None,
                 store=None, chunk: int | None = None, name: str | None = None, target: str = "static"):
        super().__init__(spec, weights, export, store, target)
        self.cache_rows = cache_rows or export.max_context
        self.chunk = chunk or export.chunk
        self.name = name or ("prefill" if isinstance(self.cache_rows, SymbolicSize)
                             else graph_name("prefill", self.cache_rows, export.max_context))

    def build(self) -> GraphBuilder:
        s, c, L = self.spec, self.chunk, self.cache_rows
        hkv, d = s.num_kv_heads, s.head_dim
        b = GraphBuilder(self.name, self.store)
        self._attach_weights(b)
        ids = b.input("input_ids", np.int64, [1, c])
        start = b.input("start", np.int64, [1])
        first_position = b.input("position", np.int64, [1])
        chunk_len = b.input("chunk_len", np.int64, [1])
        caches = self._cache_inputs(b, 1, L)
        ropes, masks = self._ropes_and_masks(b, start, first_position, range(s.num_layers))
        x = self._embed(b, ids)                                                          # [1, C, hidden]
        for i, layer in enumerate(self.w.layers):
            x, k, v = self._layer(b, x, layer, *ropes[i], caches[i], masks[i])
            b.output(k, f"key.{i}", np.float32, [1, hkv, c, d])
            b.output(v, f"value.{i}", np.float32, [1, hkv, c, d])
        b.output(self._last_logits(b, x, chunk_len), "logits", np.float32, [1, s.vocab_size])
        return b

    def _ropes_and_masks(self, b: GraphBuilder, start: str, first_position: str, layers) -> tuple[list, list]:
        """Each layer's (cos, sin) of the chunk's positions (`_ropes`) and the joined mask of each of
        `layers` (those the graph holds; None for the others): [C, R + C] over the cache rows, a local
        layer's [C, Rw + C] over its window ring (`_window_mask`)."""
        c, L, d = self.chunk, self.cache_rows, self.spec.head_dim
        positions = b.op("Add", b.op("Unsqueeze", b.const(np.arange(c)), b.const([0])), first_position)  # [1, C]
        ropes = self._ropes(b, positions, [1, 1, c, d // 2])
        local = set(self.spec.local_layers)
        mask = joined_mask(b, b.op("Less", b.arange(L), start), L, c) if set(layers) - local else None   # [C, L + C]
        ring = self._window_mask(b, first_position) if local & set(layers) else None
        return ropes, [ring if i in local else mask for i in range(self.spec.num_layers)]

    def _window_mask(self, b: GraphBuilder, first_position: str) -> str:
        """The additive [C, Rw + C] mask of a local layer's chunk at `first_position` [1]: ring rows
        holding a key within each query's window, then the chunk's tokens causally within it."""
        c, window = self.chunk, self.ring.window
        first = b.op("Unsqueeze", first_position, b.const([0]))                          # [1, 1]
        queries = b.op("Add", first, b.const(np.arange(c)[:, None]))                     # [C, 1]
        ring = additive_mask(b, self._sees(b, queries, self._ring_positions(b, first)))  # [C, Rw]
        offset = np.arange(c)[:, None] - np.arange(c)[None, :]                           # query - key
        chunk = additive_mask(b, b.const((offset >= 0) & (offset < window), np.bool_))
        return b.op("Concat", ring, chunk, axis=-1)

    def _layer(self, b: GraphBuilder, x: str, layer: dict, cos: str, sin: str, cache: tuple[str, str],
               mask: str) -> tuple[str, str, str]:
        """One decoder layer on the chunk's hidden states x [1, C, hidden]: (x after it, the chunk's K and
        V [1, Hkv, C, D]), attending over `cache` (its keys and values [1, Hkv, R, D]) and causally."""
        s, c = self.spec, self.chunk
        hkv, g, d = s.num_kv_heads, s.group_size, s.head_dim
        h = self._rms_norm(b, x, layer["in_norm"])
        q = self._heads(b, self._linear(b, h, layer, "q"), s.num_heads, cos, sin, layer.get("q_norm"))  # [1, H, C, D]
        k = self._heads(b, self._linear(b, h, layer, "k"), hkv, cos, sin, layer.get("k_norm"))          # [1, Hkv, C, D]
        v = self._heads(b, self._linear(b, h, layer, "v"), hkv, None, None)
        q = b.op("Reshape", q, b.const([1, hkv, g, c, d]))
        attn = emit_joined_attention(b, q, k, v, *cache, mask, s.attention_scale)   # [1,Hkv,G,C,D]
        attn = b.op("Reshape", attn, b.const([1, s.num_heads, c, d]))
        attn = b.op("Reshape", b.op("Transpose", attn, perm=[0, 2, 1, 3]), b.const([1, c, s.num_heads * d]))
        return self._residuals(b, x, self._linear(b, attn, layer, "o"), layer), k, v

    def _last_logits(self, b: GraphBuilder, x: str, chunk_len: str) -> str:
        """logits [1, V] of the chunk's last valid token."""
        last = b.op("Gather", b.op("Reshape", x, b.const([self.chunk, self.spec.hidden_size])),
                    b.op("Sub", chunk_len, b.const([1])), axis=0)                        # [1, hidden]
        return self._logits(b, last)

    def _heads(self, b: GraphBuilder, x: str, heads: int, cos: str | None, sin: str | None,
               norm: str | None = None) -> str:
        """[1, C, heads*D] -> [1, heads, C, D], each head RMS-normed by `norm` [D] (Qwen3) and
        rotated when cos/sin are given."""
        x = b.op("Transpose", b.op("Reshape", x, b.const([1, self.chunk, heads, self.spec.head_dim])),
                 perm=[0, 2, 1, 3])
        return x if cos is None else self._rotate(b, self._head_norm(b, x, norm), cos, sin)


class PrefillEmbedWriter(LlamaGraphWriter):
    """prefill_embed (layer by layer, target "ort"): input_ids [1, C] int64 -> hidden [1, C, hidden]
    float32, a chunk's embeddings."""

    def build(self) -> GraphBuilder:
        c, hidden = self.export.chunk, self.spec.hidden_size
        b = GraphBuilder(PREFILL_EMBED, self.store)
        self._attach_weights(b)
        b.output(self._embed(b, b.input("input_ids", np.int64, [1, c])), "hidden", np.float32, [1, c, hidden])
        return b


class PrefillLayerWriter(PrefillWriter):
    """prefill_layer_<i> (layer by layer, target "ort"): decoder layer `layer` on a chunk's hidden
    states against a cache of R rows (a SymbolicSize: every prefill bucket and max_context). The
    prefill contract of one layer, its index 0 in every name: inputs hidden [1, C, hidden] (the
    layer's input), start, position, chunk_len, past_key.0, past_value.0 [1, Hkv, R, D]; outputs
    key.0, value.0 [1, Hkv, C, D], hidden_out [1, C, hidden] (the layer's output). The same nodes
    as the layer's in the whole-model prefill graph (`PrefillWriter._layer`)."""

    def __init__(self, spec: ModelSpec, weights: Weights, export: ExportConfig, layer: int, cache_rows: Size,
                 store=None):
        super().__init__(spec, weights, export, cache_rows, store, name=prefill_layer(layer), target="ort")
        self.layer = layer

    def build(self) -> GraphBuilder:
        s, c = self.spec, self.chunk
        b = GraphBuilder(self.name, self.store)
        self._attach_weights(b)
        x = b.input("hidden", np.float32, [1, c, s.hidden_size])
        start, first_position = b.input("start", np.int64, [1]), b.input("position", np.int64, [1])
        b.input("chunk_len", np.int64, [1])      # read by the passes' window queries
        cache = self._cache_inputs(b, 1, self.cache_rows, layers=[self.layer])[0]
        ropes, masks = self._ropes_and_masks(b, start, first_position, [self.layer])
        x, k, v = self._layer(b, x, self.w.layers[self.layer], *ropes[self.layer], cache, masks[self.layer])
        shape = [1, s.num_kv_heads, c, s.head_dim]
        b.output(k, "key.0", np.float32, shape)
        b.output(v, "value.0", np.float32, shape)
        b.output(x, "hidden_out", np.float32, [1, c, s.hidden_size])
        return b


class PrefillHeadWriter(LlamaGraphWriter):
    """prefill_head (layer by layer, target "ort"): hidden [1, hidden] (the last layer's output at
    the prompt's last token) -> logits [1, V]; with `rows` C, prefill_scores: hidden [C, hidden] (a
    chunk of positions) -> logits [C, V], run only for a prompt's log probabilities."""

    def __init__(self, spec: ModelSpec, weights: Weights, export: ExportConfig, store=None, target: str = "ort",
                 rows: int = 1):
        super().__init__(spec, weights, export, store, target)
        self.rows = rows

    def build(self) -> GraphBuilder:
        b = GraphBuilder(PREFILL_HEAD if self.rows == 1 else PREFILL_SCORES, self.store)
        self._attach_weights(b)
        hidden = b.input("hidden", np.float32, [self.rows, self.spec.hidden_size])
        b.output(self._logits(b, hidden), "logits", np.float32, [self.rows, self.spec.vocab_size])
        return b


class DecodeWriter(LlamaGraphWriter):
    """The decode graph of `slots` slots (default: N; fewer for the slot buckets; a SymbolicSize:
    the family of decode graphs)."""

    def __init__(self, spec: ModelSpec, weights: Weights, export: ExportConfig, store=None, slots: Size | None = None,
                 target: str = "static"):
        super().__init__(spec, weights, export, store, target)
        self.slots = slots or export.slots

    def build(self) -> GraphBuilder:
        s, n, L = self.spec, self.slots, self.export.max_context
        hkv, g, d = s.num_kv_heads, s.group_size, s.head_dim
        name = "decode" if isinstance(n, SymbolicSize) else graph_name("decode", n, self.export.slots)
        b = GraphBuilder(name, self.store)
        self._attach_weights(b)
        ids = b.input("input_ids", np.int64, [n, 1])
        position = b.input("position", np.int64, [n])
        cache_len = b.input("cache_len", np.int64, [n])
        caches = self._cache_inputs(b, n, L)
        ropes = self._ropes(b, position, [n, 1, 1, d // 2])
        visible = b.op("Less", b.const(np.arange(L)[None, :]), b.op("Unsqueeze", cache_len, b.const([1])))
        cache_mask = b.op("Reshape", additive_mask(b, visible), b.shape([n, 1, 1, L]))
        masks = [cache_mask] * s.num_layers
        if s.local_layers:      # a local layer's ring rows within the window of the token at `position`
            query = b.op("Unsqueeze", position, b.const([1]))                             # [N, 1]
            sees = self._sees(b, query, self._ring_positions(b, query))                   # [N, Rw]
            ring_mask = b.op("Reshape", additive_mask(b, sees), b.shape([n, 1, 1, self.ring.rows]))
            masks = [ring_mask if i in s.local_layers else cache_mask for i in range(s.num_layers)]
        x = b.op("Reshape", self._embed(b, ids), b.shape([n, s.hidden_size]))
        for i, layer in enumerate(self.w.layers):
            cos, sin = ropes[i]
            h = self._rms_norm(b, x, layer["in_norm"])
            q = b.op("Reshape", self._linear(b, h, layer, "q"), b.shape([n, hkv, g, d]))
            q = self._rotate(b, self._head_norm(b, q, layer.get("q_norm")), cos, sin)
            k = b.op("Reshape", self._linear(b, h, layer, "k"), b.shape([n, hkv, 1, d]))
            k = self._rotate(b, self._head_norm(b, k, layer.get("k_norm")), cos, sin)
            v = b.op("Reshape", self._linear(b, h, layer, "v"), b.shape([n, hkv, 1, d]))
            rows = self.ring.rows if i in s.local_layers else L
            attn = emit_cached_attention(b, q, k, v, *caches[i], masks[i], s.attention_scale, rows, 1)
            x = self._residuals(b, x, self._linear(b, b.op("Reshape", attn, b.shape([n, s.num_heads * d])), layer, "o"),
                                layer)
            b.output(k, f"key.{i}", np.float32, [n, hkv, 1, d])
            b.output(v, f"value.{i}", np.float32, [n, hkv, 1, d])
        b.output(self._logits(b, x), "logits", np.float32, [n, s.vocab_size])
        return b
