import pytest
from hypothesis import given
from hypothesis import strategies as st

from snapcompile.layout import SlotLayout


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
