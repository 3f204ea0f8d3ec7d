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
