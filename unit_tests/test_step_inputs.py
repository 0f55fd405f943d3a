"""A prefill or mixed step's host index arrays (prefill_inputs, built with numpy in one pass) against
the same indices spelled out row by row, for any rows the scheduler can build; and their single upload."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from autoprofile.engine.pinned import pick_buffer
from autoprofile.engine.step_inputs import prefill_inputs, upload
from autoprofile.engine.sampling import GREEDY
from autoprofile.engine.scheduler import StepRow


@st.composite
def steps(draw):
    def row(decode: bool):
        start = draw(st.integers(0, 300))
        n = 1 if decode else draw(st.integers(1, 40))
        ids = draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n))
        return StepRow(draw(st.integers(0, 63)), start, ids, decode or draw(st.booleans()), GREEDY)
    return ([row(False) for _ in range(draw(st.integers(1, 6)))],
            [row(True) for _ in range(draw(st.integers(0, 5)))])


@settings(max_examples=150, deadline=None)
@given(steps(), st.booleans())
def test_prefill_inputs_equal_the_rows_spelled_out(step, with_keys):
    rows, decode = step
    got = prefill_inputs(rows, decode, with_keys)
    assert got["ids"].tolist() == [t for r in rows for t in r.ids] + [r.ids[0] for r in decode]
    assert got["positions"].tolist() == ([p for r in rows for p in range(r.start, r.start + len(r.ids))]
                                         + [r.start for r in decode])
    assert got["token_rows"].tolist() == [r.slot for r in rows for _ in r.ids]
    assert got["cu"].tolist() == [sum(len(r.ids) for r in rows[:i]) for i in range(len(rows) + 1)]
    assert got["decode_slots"].tolist() == [r.slot for r in decode]
    n = got["cu"][-1]
    ends = [int(e) - 1 for e, r in zip(got["cu"][1:], rows) if r.sample]
    assert got["last"].tolist() == ends + [n + i for i in range(len(decode))]
    assert got["kv_lens"].tolist() == [r.start + len(r.ids) for r in rows]
    keys = with_keys and any(r.start for r in rows)
    assert ("kv_rows" in got) == keys
    if keys:
        assert got["kv_rows"].tolist() == [r.slot for r in rows for _ in range(r.start + len(r.ids))]
        assert got["kv_pos"].tolist() == [p for r in rows for p in range(r.start + len(r.ids))]
        assert got["cu_k"].tolist() == [0, *np.cumsum(got["kv_lens"]).tolist()]
    assert all(a.dtype == np.int64 for a in got.values())


def test_upload_is_one_tensor_viewed_by_name():
    arrays = {"a": np.arange(3, dtype=np.int64), "empty": np.zeros(0, np.int64), "b": np.array([7, 8])}
    parts = upload(arrays, torch.device("cpu"))
    assert parts["a"].tolist() == [0, 1, 2] and parts["empty"].numel() == 0 and parts["b"].tolist() == [7, 8]
    assert parts["a"].untyped_storage().data_ptr() == parts["b"].untyped_storage().data_ptr()


@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.booleans()), max_size=6), st.integers(1, 1 << 20))
def test_staging_writes_only_a_free_buffer_and_grows_only_when_none_free_fits(buffers, n):
    """Staging's choice: a buffer whose copy is still queued is never written (the GPU may not have
    read it); a free one that holds n is reused, the smallest; otherwise a free one is replaced by a larger
    one, or a new one is made."""
    i, grow = pick_buffer(buffers, n)
    fits = [cap for cap, free in buffers if free and cap >= n]
    if i is None:
        assert grow and not any(free for _, free in buffers)
        return
    cap, free = buffers[i]
    assert free
    assert grow == (not fits)
    if not grow:
        assert cap == min(fits)
