"""gcpause: the collector paused over saves and restores, restored after, its deferred work done inside;
and the reference cycles the collector would otherwise have to find (none that hold a state)."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from ckptzip.chain import CheckpointChain
from ckptzip.errors import StepOrderError
from ckptzip.gcpause import collector_paused
from ckptzip.methods.base import EncodeContext
from ckptzip.search.cube import ConfigCube, MonotoneOracle, guided_search
from ckptzip.state import flatten_state, skeleton_refs, unflatten_state


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"l{i}.weight": torch.randn(32, 32, generator=g) for i in range(12)}, "step": seed}


class _Node:
    pass


def test_save_runs_with_the_collector_paused_and_frees_its_cycles_before_returning(tmp_path, monkeypatch):
    chain = CheckpointChain(tmp_path / "c", "dynaquant")
    seen, cycles = [], []
    encode = chain.method.encode

    def spy(*a, **k):
        seen.append(gc.isenabled())
        a_, b_ = _Node(), _Node()
        a_.other, b_.other = b_, a_  # garbage only the cyclic collector frees
        cycles.append(weakref.ref(a_))
        return encode(*a, **k)

    monkeypatch.setattr(chain.method, "encode", spy)
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        for step in (1, 2, 3):
            chain.save(_state(step), step)
            assert gc.isenabled()
            assert cycles[-1]() is None  # collected inside the save that made it
    finally:
        gc.callbacks.remove(count)
    assert seen == [False, False, False]
    # one young collection per save (the deferred one); collected freely, these saves made ~8 each
    assert collections == [0, 0, 0], collections
    assert chain.restore(3).state["step"] == 3 and gc.isenabled()


def test_a_failed_save_and_a_caller_who_disabled_the_collector_keep_their_setting(tmp_path):
    chain = CheckpointChain(tmp_path / "c", "lossless")
    chain.save(_state(1), 5)
    with pytest.raises(StepOrderError):
        chain.save(_state(2), 5)
    assert gc.isenabled()
    gc.disable()
    chain.save(_state(3), 6)
    chain.load(6)
    assert not gc.isenabled()


def test_a_searched_saves_eval_fn_runs_in_the_pause_and_its_cycles_are_freed_by_its_end(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.Tanh(), torch.nn.Linear(48, 4))
    x = torch.randn(64, 48)
    seen, cycles = [], []

    def eval_fn(m):
        seen.append(gc.isenabled())
        a, b = _Node(), _Node()
        a.other, b.other, a.data = b, a, torch.zeros(1000)
        cycles.append(weakref.ref(a))
        with torch.no_grad():
            return float(m(x).square().mean())

    chain = CheckpointChain(tmp_path / "c", "dynaquant")
    chain.save({"model": model.state_dict()}, 1, model=model, ctx=EncodeContext(step=1, model=model, eval_fn=eval_fn))
    assert seen and not any(seen) and gc.isenabled()
    assert all(c() is None for c in cycles)


def test_concurrent_regions_share_one_pause_lifted_by_the_last():
    inside, leave = threading.Event(), threading.Event()

    def other():
        with collector_paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with collector_paused():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's region is still open
    leave.set()
    t.join(10)
    assert gc.isenabled()
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_restored_state_is_freed_when_dropped_without_a_collection(tmp_path):
    # unflatten_state's recursive walk was a closure over the restored tensors: a reference cycle that
    # held the whole state (1.6 GB for GPT-2 124M with Adam) until the collector came by
    chain = CheckpointChain(tmp_path / "c", "dynaquant")
    chain.save(_state(1), 1)
    chain.save(_state(2), 2)
    gc.collect()
    gc.disable()
    restored = CheckpointChain(tmp_path / "c", "dynaquant").restore(1)
    alive = weakref.ref(restored.state["model"]["l0.weight"])
    del restored
    assert alive() is None


def test_flatten_unflatten_and_the_search_leave_no_reference_cycles():
    state = _state(3)
    gc.collect()
    gc.disable()
    flat = flatten_state(state)
    unflatten_state(flat.skeleton, flat.tensors)
    skeleton_refs(flat.skeleton)
    del flat
    cube = ConfigCube()
    guided_search(cube.bottom, cube.top, MonotoneOracle(lambda p: sum(p) > 3))
    assert gc.collect() == 0
