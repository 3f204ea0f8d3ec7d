"""Writer fencing (lease.py): one owner per chain, enforced at every commit.

The issue's scenario with two real training processes on one chain (tests/data/chain_writer.py,
driven command by command so the interleaving is exact): the second gets ChainBusyError naming
the chain and ``takeover=True``; with it, the second fences the first, whose next save fails
with a clear error; a killed owner is taken over without asking. Committed steps of both are
never lost or mixed, and no container is left outside the index. In one process: a commit
racing another commit loses cleanly, an owner on another machine holds the chain until its lease
runs out, a 0.1 index without an owner is taken over, and the async engine shares the fence.
"""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from ckptzip.chain import INDEX, CheckpointChain
from ckptzip.errors import ChainBusyError
from ckptzip.lease import Lease, alive, this_process
from faultfs import HookedLossless
from helpers import assert_same

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def digits_file(tmp_path_factory):
    from ckptzip.demo.workloads import digits_data

    x, y, _, _ = digits_data(0)
    path = tmp_path_factory.mktemp("digits") / "digits.pt"
    torch.save({"x": x[:512].clone(), "y": y[:512].clone()}, path)
    return path


class Proc:
    """A chain_writer.py process: one command in, one answer line out."""

    def __init__(self, url, data_file):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.p = subprocess.Popen([sys.executable, str(DATA / "chain_writer.py"), str(url), str(data_file)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)

    def ready(self):
        assert self.p.stdout.readline().strip() == "ready"
        return self

    def __call__(self, cmd: str) -> str:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline().strip()
        assert line, f"writer died on {cmd!r}"
        return line

    def kill(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait()


def test_two_training_processes_on_one_chain(tmp_path, digits_file):
    url = tmp_path / "ckpt"
    a, b = Proc(url, digits_file), Proc(url, digits_file)  # both import torch at once
    try:
        a.ready(), b.ready()
        assert a("open") == "opened" and a("restore") == "restored none"
        assert [a("save") for _ in range(3)] == ["saved 1", "saved 2", "saved 3"]

        # a second writer while the first is alive: refused, one line naming the chain and the way out
        assert b("open") == "opened" and b("restore") == "restored 3"
        busy = b("save")
        assert busy.startswith("error ChainBusyError: ") and str(url) in busy and "takeover=True" in busy
        assert f"pid {a.p.pid}" in busy
        assert a("save") == "saved 4"  # the owner is unaffected

        # the second takes over: the first is fenced at its next save
        assert b("open takeover") == "opened" and b("restore") == "restored 4"
        assert b("save") == "saved 5"
        fenced = a("save")
        assert fenced.startswith("error ChainBusyError: ") and "taken over" in fenced and "fenced" in fenced
        assert f"pid {b.p.pid}" in fenced
        assert a("save").startswith("error ChainBusyError")  # and stays fenced
        assert b("save") == "saved 6"

        # the fenced process reopens without takeover: refused while the owner lives ...
        assert a("open") == "opened" and a("restore") == "restored 6"
        assert a("save").startswith("error ChainBusyError")
        b.kill()  # ... and once it is killed, taken over without asking
        assert a("save") == "saved 7" and a("save") == "saved 8"
        assert a("close") == "closed"
    finally:
        a.kill()
        b.kill()
    chain = CheckpointChain(url)
    assert chain.steps() == list(range(1, 9)) and chain.verify() == []
    assert chain.orphans() == []  # the refused and fenced saves left nothing behind
    assert json.loads((url / INDEX).read_text())["owner"]["released"] is True
    for s in range(1, 9):
        assert chain.load(s)["step"] == s


def tiny(step):
    return {"model": {"w": torch.full((64,), float(step))}, "step": step}


def test_a_commit_racing_another_loses_cleanly(tmp_path):
    url = tmp_path / "c"
    first = CheckpointChain(url)
    first.save(tiny(1), step=1)
    slow = CheckpointChain(url, HookedLossless())
    slow.method.hook = lambda: first.save(tiny(2), step=2)  # commits while `slow` encodes step 2
    with pytest.raises(ChainBusyError, match="while this writer was saving step 2") as ei:
        slow.save(tiny(20), step=2)
    assert "\n" not in str(ei.value)
    assert first.steps() == [1, 2] and first.orphans() == [] and first.verify() == []
    assert_same(tiny(2), first.load(2))  # the winner's bytes, not the loser's
    slow.save(tiny(3), step=3)  # the loser re-reads and goes on from the new head
    assert slow.steps() == [1, 2, 3] and slow.verify() == []


def test_owner_on_another_machine_holds_until_its_lease_runs_out(tmp_path):
    url = tmp_path / "c"
    CheckpointChain(url).save(tiny(1), step=1)
    index = url / INDEX
    doc = json.loads(index.read_text())
    elsewhere = {**doc["owner"], "id": "node7:4242:abc", "host": "node7", "machine": "another-boot/pid:[1]",
                 "pid": 4242, "renewed_unix": time.time(), "lease_s": 600.0}
    index.write_text(json.dumps({**doc, "owner": elsewhere}))  # the owner is outside the checksum
    assert alive(elsewhere)
    with pytest.raises(ChainBusyError, match="pid 4242 on node7.*takeover=True"):
        CheckpointChain(url).save(tiny(2), step=2)
    index.write_text(json.dumps({**doc, "owner": {**elsewhere, "renewed_unix": time.time() - 601}}))
    chain = CheckpointChain(url)
    chain.save(tiny(2), step=2)  # the lease ran out: taken over
    owner = json.loads(index.read_text())["owner"]
    assert owner["id"] == this_process()["id"] and owner["generation"] == elsewhere["generation"] + 1


def test_v01_chain_without_owner_is_taken_over(tmp_path):
    url = tmp_path / "golden"
    shutil.copytree(DATA / "golden_chain_v1", url)
    assert "owner" not in json.loads((url / INDEX).read_text())
    chain = CheckpointChain(url)
    before = {s: chain.load(s) for s in chain.steps()}
    state = chain.load()
    chain.save(state, step=chain.steps()[-1] + 10)
    assert chain.verify() == [] and chain.orphans() == []
    assert json.loads((url / INDEX).read_text())["owner"]["generation"] == 1
    for s, st in before.items():
        assert_same(st, CheckpointChain(url).load(s))


def test_lease_rules():
    me = this_process()
    lease = Lease("u")
    assert lease.claim(None)["generation"] == 1
    mine = lease.claim({**me, "generation": 4})
    assert mine["generation"] == 4  # this process already owns it
    assert lease.claim({**me, "generation": 4, "released": True})["generation"] == 5
    dead = {**me, "id": "x", "pid": 2**22 + 7, "generation": 2}
    assert not alive(dead) and lease.claim(dead)["generation"] == 3
    lease.held(mine)
    with pytest.raises(ChainBusyError, match="fenced"):
        lease.claim({**me, "id": "other", "pid": os.getppid(), "generation": 5})  # held, then lost: fenced
    parent = {**me, "id": "other", "pid": os.getppid(), "start": None, "generation": 1}
    assert alive(parent)
    with pytest.raises(ChainBusyError):
        Lease("u").claim(parent)
    assert Lease("u", takeover=True).claim(parent)["generation"] == 2
    with pytest.raises(ValueError):
        Lease("u", lease_s=0)


def test_async_engine_shares_the_fence(tmp_path, digits_file):
    """An engine opened on a chain a live writer process owns fails at once, naming it; a claim of
    the engine's own process passes to its agent; the writers it replaced are fenced."""
    from ckptzip.engine import AsyncCheckpointEngine

    url = tmp_path / "ckpt"
    a = Proc(url, digits_file)
    try:
        a.ready()
        assert a("open") == "opened" and a("save") == "saved 1"
        with pytest.raises(ChainBusyError, match=f"pid {a.p.pid}.*takeover=True"):
            AsyncCheckpointEngine(url, "lossless")
        mine = CheckpointChain(url, takeover=True)
        mine.save(mine.load(), step=2)  # this process fences the other one ...
        eng = AsyncCheckpointEngine(url, "lossless")  # ... and hands its claim to the engine's agent
        try:
            state, step = eng.restore()
            assert step == 2
            eng.save(state, 3).wait(60)
        finally:
            eng.close()
        with pytest.raises(ChainBusyError, match="fenced"):
            mine.save(state, step=4)
        assert a("save").startswith("error ChainBusyError")
    finally:
        a.kill()
    chain = CheckpointChain(url)
    assert chain.steps() == [1, 2, 3] and chain.verify() == [] and chain.orphans() == []
