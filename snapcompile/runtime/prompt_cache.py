"""One compressed prompt's cache rows, in one buffer per layer that every prefill graph reads.

A prefill graph over R cache rows reads its past keys / values as [1, Hkv, R, D], contiguous: head
h's rows start at h * R * D. The full graph (R = max_context) and each bucket graph (R = 2C, 4C, ...)
see the same flat buffer through views of their own shape, and the rows already filled are moved
into the layout of the graph about to run (`lay_out`). So a prompt's rows are held once, not once in
a max_context scratch cache and again in the largest bucket's cache (at 8B x 4096 that copy was
0.9 GiB). A dense artifact's bucket graphs read their copy of a slot's first rows through the views
of one too (`view` only: the slot is the prompt's cache there).
"""
from __future__ import annotations


class PromptCache:
    """Per layer one K and one V buffer of heads * max_rows * width elements of `dtype` (the
    artifact's kv_dtype; width: a stored row's elements, Manifest.kv_row_width).

    `keys` / `values` (lists, one [1, Hkv, rows, D] view per layer) are the current layout's views;
    the lists are updated in place by `lay_out`, so a caller may hold them. `live` is the number of
    leading rows holding data: `lay_out` keeps those, the rest of the buffer is undefined."""

    def __init__(self, device, num_layers: int, heads: int, width: int, max_rows: int, dtype: str,
                 skipped=()):
        """skipped: layers that hold nothing here (a model's sliding-window layers, whose chunks go to
        their slot's window ring): None in every view."""
        self.device, self.heads, self.width, self.max_rows = device, heads, width, max_rows
        size = heads * max_rows * width
        self._flat_k = [None if i in skipped else device.zeros((size,), dtype) for i in range(num_layers)]
        self._flat_v = [None if i in skipped else device.zeros((size,), dtype) for i in range(num_layers)]
        self._moving = device.zeros((max_rows * width,), dtype)   # one head's rows in transit
        self.rows, self.live = max_rows, 0
        self.keys, self.values = self.view(max_rows)

    def view(self, rows: int) -> tuple[list, list]:
        """Per layer K and V views [1, Hkv, rows, D] of the buffers (new lists; no data moves):
        what a graph over `rows` rows is bound to once."""
        shape, size = (1, self.heads, rows, self.width), self.heads * rows * self.width
        return ([None if flat is None else flat[:size].reshape(shape) for flat in self._flat_k],
                [None if flat is None else flat[:size].reshape(shape) for flat in self._flat_v])

    def lay_out(self, rows: int) -> None:
        """Move the live rows into the layout of a graph over `rows` rows (live <= rows)."""
        if rows == self.rows:
            return
        if not self.live <= rows <= self.max_rows:
            raise ValueError(f"cannot lay {self.live} live rows out as {rows} rows (at most {self.max_rows})")
        span = self.live * self.width
        old, new = self.rows * self.width, rows * self.width
        heads = range(self.heads - 1, 0, -1) if rows > self.rows else range(1, self.heads)   # never over a
        for flat in (f for f in (*self._flat_k, *self._flat_v) if f is not None):          # head not yet moved
            for h in heads:
                self._moving[:span] = flat[h * old:h * old + span]
                flat[h * new:h * new + span] = self._moving[:span]
        self.rows = rows
        self.keys[:], self.values[:] = self.view(rows)

    def reset(self) -> None:
        """A new prompt: no row holds data; laid out as max_rows rows."""
        self.live = 0
        self.lay_out(self.max_rows)

    def filled_to(self, end: int) -> None:
        """Rows below `end` hold data (written in the current layout)."""
        self.live = max(self.live, end)

    def truncate(self, end: int) -> None:
        """Only the rows below `end` hold data."""
        self.live = min(self.live, end)
