"""Several ranks (torch.distributed, gloo on 127.0.0.1) recovering from shared memory: BitSnap Fig. 4.

Phase 1: every rank saves steps 20..100 asynchronously; rank 1 is SIGKILLed in the middle of copying
step 100 and the other ranks are killed after staging it (the job restarts). Phase 2: new rank
processes restore; they all-gather what each has (memory or chain) and resume from 80, the newest
step complete on every rank, read from shared memory; rank 0's committed 100 is rolled back.

Rank processes run this file as a script: ``python tests/test_engine_dist.py <phase> <rank> <world>
<port> <url> <outdir>``.
"""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from ckptzip.chain import CheckpointChain
from ckptzip.engine import staging

STEPS = [20, 40, 60, 80, 100]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def make_state(rank: int, step: int) -> dict:
    """A small real training state (weights + Adam moments after one step), fixed by (rank, step)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16, generator=g)).square().mean().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        w = BITS[a.element_size()] if a.dtype != torch.bool else torch.bool
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(w), b.contiguous().view(w)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(phase, rank, world, port, url, out):
    return subprocess.Popen([sys.executable, __file__, phase, str(rank), str(world), str(port), str(url), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.skipif(
    not os.environ.get("CKPTZIP_TEST_4RANKS"), reason="16 processes: about a minute on 2 cores; "
    "set CKPTZIP_TEST_4RANKS=1"))])
def test_ranks_resume_from_newest_step_complete_on_every_rank(tmp_path, world):
    url, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    port = free_port()
    procs = [spawn("train", r, world, port, url, out) for r in range(world)]
    try:
        markers = [out / ("r1-mid-copy" if r == 1 else f"r{r}-staged") for r in range(world)]

        def ready():
            dead = [p for p in procs if p.poll() is not None]
            assert not dead, dead[0].communicate()[1].decode()[-3000:]
            return all(m.exists() for m in markers)

        wait_for(ready, 90, "every rank to stage step 100 (rank 1: to be mid-copy)")
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
    finally:
        for p in procs:
            p.kill()
            p.wait()

    port = free_port()
    procs = [spawn("resume", r, world, port, url, out) for r in range(world)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r in range(world):
        res = json.loads((out / f"r{r}-result.json").read_text())
        assert res["step"] == 80 and res["source"] == "memory" and res["equal"], (r, res)
        assert res["chain_after_restore"] == [20, 40, 60, 80], (r, res)  # rank 0's 100 rolled back
        assert res["chain"] == STEPS and res["verify"] == [], (r, res)
        rank_url = f"{url}/rank-{r:05d}"
        assert staging.list_segments(staging.chain_key(rank_url)) == []
        chain = CheckpointChain(rank_url)
        assert chain.verify() == []
        assert same(chain.load(80), make_state(r, 80)) and same(chain.load(100), make_state(r, 100))


def _rank_main(phase, rank, world, port, url, out):
    import torch.distributed as dist

    from ckptzip.engine import AsyncCheckpointEngine, EngineOptions

    out = pathlib.Path(out)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    eng = AsyncCheckpointEngine(url, "lossless", options=EngineOptions(orphan_linger_s=60,
                                                                        warn_on_backpressure=False))
    if phase == "train":
        for step in STEPS[:-1]:
            eng.save(make_state(rank, step), step)
        if rank == 1:  # dies in the middle of copying step 100
            copy, n = staging.copy_tensor, []

            def stall(dst, src):
                copy(dst, src)
                n.append(1)
                if len(n) == 2:
                    (out / "r1-mid-copy").touch()
                    time.sleep(120)

            staging.copy_tensor = stall
        eng.save(make_state(rank, 100), 100)
        (out / f"r{rank}-staged").touch()
        time.sleep(120)
        return
    state, step = eng.restore()
    res = {"step": step, "source": eng.last_restore[1], "equal": same(state, make_state(rank, step)),
           "chain_after_restore": eng.chain.steps()}
    eng.save(make_state(rank, 100), 100).wait(60)
    eng.wait()
    res.update(chain=eng.chain.steps(), verify=eng.chain.verify())
    eng.close()
    (out / f"r{rank}-result.json").write_text(json.dumps(res))
    dist.barrier()  # leave together: tearing gloo down while a peer is in a collective can abort it
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    _rank_main(a[0], int(a[1]), int(a[2]), int(a[3]), a[4], a[5])
