import pytest
from hypothesis import given
from hypothesis import strategies as st

from snapcompile.layout import SlotLayout, WindowRing


def test_dense_layout_writes_at_position():
    layout = SlotLayout.for_prompt(10, rows_per_slot=16, prompt_share=None)
    step = layout.step(3)
    assert (step.position, step.write_index, step.cache_len) == (13, 13, 13)
    assert layout.can_feed(5) and not layout.can_feed(6)
    with pytest.raises(IndexError):
        layout.step(6)


def test_short_prompt_is_kept_whole_and_the_ring_is_larger():
    layout = SlotLayout.for_prompt(5, rows_per_slot=16, prompt_share=12)
    assert layout.kept == 5 and not layout.compressed and layout.ring_size == 11


@given(prompt=st.integers(1, 200), rows_per_slot=st.integers(8, 64), steps=st.integers(1, 300))
def test_ring_never_overwrites_kept_prompt_and_evicts_the_oldest(prompt, rows_per_slot, steps):
    share = rows_per_slot - max(1, rows_per_slot // 4)
    layout = SlotLayout.for_prompt(prompt, rows_per_slot, share)
    rows = {}                                   # row -> generated index stored there
    for g in range(steps):
        step = layout.step(g)
        assert layout.kept <= step.write_index < rows_per_slot
        assert step.position == prompt + g
        if g >= layout.ring_size:                # ring full: the evicted token is the oldest one
            assert rows[step.write_index] == min(rows.values())
        assert step.cache_len == min(layout.kept + g, rows_per_slot)
        rows[step.write_index] = g
    assert len(rows) == min(steps, layout.ring_size)


@given(prompt=st.integers(1, 200), rows_per_slot=st.integers(8, 64), fed=st.integers(0, 300),
       dense=st.booleans())
def test_fed_rows_are_the_rows_the_steps_left(prompt, rows_per_slot, fed, dense):
    share = None if dense else rows_per_slot - max(1, rows_per_slot // 4)
    layout = SlotLayout.for_prompt(prompt, rows_per_slot if not dense else prompt + fed, share)
    rows = {}                                   # row -> position of the token written there last
    for g in range(fed):
        step = layout.step(g)
        rows[step.write_index] = step.position
    listed = layout.fed_rows(fed)
    assert dict(listed) == rows
    assert [position for _, position in listed] == sorted(rows.values())     # oldest first


def _chunk_starts(prompt_len: int, chunk: int) -> list[int]:
    """runtime.device.chunk_starts (the runtime is above the foundation): the last chunk ends at the
    prompt's end, overlapping the one before."""
    starts = list(range(0, max(prompt_len - chunk, 0), chunk))
    return starts + [max(prompt_len - chunk, 0)]


@given(window=st.integers(1, 40), chunk=st.integers(1, 24), prompt=st.integers(1, 200), steps=st.integers(0, 60))
def test_window_ring_holds_every_key_a_query_sees_and_shows_no_other(window, chunk, prompt, steps):
    """A list model of the ring: the prompt written chunk by chunk (the last chunk overlapping), then one
    token a step. Before each run, the rows `visible` shows a query are exactly the positions of its
    window written before the run, each row holding the position `position_at` says."""
    ring = WindowRing.for_export(window, chunk)
    rows: list[int | None] = [None] * ring.rows           # the position each row holds
    runs = [(start, min(chunk, prompt - start)) for start in _chunk_starts(prompt, chunk)]
    runs += [(prompt + step, 1) for step in range(steps)]
    for first, count in runs:
        for query in range(first, first + count):
            wanted = {p for p in range(max(query - window + 1, 0), first)}
            seen = {rows[r] for r in range(ring.rows) if ring.visible(r, first, query)}
            assert seen == wanted
        for position in range(first, first + count):
            rows[ring.row(position)] = position
