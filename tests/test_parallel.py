"""parallel.thread_map: order, errors, nesting."""
from __future__ import annotations

import threading

import pytest

from ckptzip.parallel import thread_map


def test_results_in_order_on_threads():
    seen = set()

    def f(x):
        seen.add(threading.current_thread().name)
        return x * x

    assert thread_map(f, range(50), threads=3) == [x * x for x in range(50)]
    assert thread_map(f, [], threads=3) == [] and thread_map(f, [4], threads=1) == [16]
    assert any(name.startswith("ckptzip") for name in seen)


def test_first_error_in_item_order_and_nested_calls_run_inline():
    def f(x):
        if x in (3, 7):
            raise ValueError(f"item {x}")
        return x

    with pytest.raises(ValueError, match="item 3"):
        thread_map(f, range(10), threads=4)
    # a worker calling thread_map again runs it inline instead of waiting on its own pool
    assert thread_map(lambda x: sum(thread_map(lambda y: y, range(x), threads=4)), range(6), threads=2) == \
        [sum(range(x)) for x in range(6)]


def test_workers_run_kernels_on_their_own_thread_and_leave_the_trainers_count():
    import sys

    import torch

    from ckptzip.parallel import _openmp_team_setter

    if sys.platform != "linux":
        pytest.skip("the OpenMP runtime is looked up in /proc/self/maps")
    assert _openmp_team_setter() is not None, "torch's OpenMP runtime was not found: pool workers would open teams"
    before = torch.get_num_threads()
    if before < 2:
        torch.set_num_threads(2)
    try:
        counts = thread_map(lambda _: torch.get_num_threads(), range(8), threads=2)
        assert counts == [1] * 8
        # the trainer's count and the count a thread started later inherits are unchanged
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start(), t.join()
        assert torch.get_num_threads() == max(before, 2) and later == [max(before, 2)]
    finally:
        torch.set_num_threads(before)
