"""Writer for tests/test_crash.py: saves a digits MLP training run into a chain until it is killed.

Run as ``python crash_writer.py CHAIN_DIR DATA_FILE``. It imports torch once and then serves as a
fork server, so each trial costs a fork rather than a fresh interpreter (a few seconds here):

    stdin "fork"  -> forks a writer; prints "pid N", later "exit STATUS" when the writer is gone
    stdin "quit"  -> exits

A writer resumes like a restarted training job: it opens the chain with a new CheckpointChain,
loads the latest committed step into its model and optimizer, then loops -- one Adam step, one
save of step latest+1, print "saved STEP" -- until the parent SIGKILLs it. DATA_FILE holds the
digits features and labels (saved by the test with torch.save; loaded with weights_only=True).
"""
from __future__ import annotations

import os
import sys
import time

import torch

torch.set_num_threads(1)  # no thread pools before fork

from ckptzip.chain import CheckpointChain, KeyframePolicy, RetentionPolicy  # noqa: E402
from ckptzip.demo.workloads import DigitsMLP  # noqa: E402


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def writer(chain_dir: str, x: torch.Tensor, y: torch.Tensor) -> None:
    chain = CheckpointChain(chain_dir, "lossless", keyframe=KeyframePolicy(every=4),
                            retention=RetentionPolicy(keep_last=3))
    torch.manual_seed(os.getpid())
    model = DigitsMLP(hidden=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    steps = chain.steps()
    step = 0
    if steps:
        state = chain.load()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        assert step == steps[-1], (step, steps)
    for _ in range(100_000):
        idx = torch.randint(0, len(x), (32,))
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        chain.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, step=step,
                   model=model, optimizer=opt)
        say(f"saved {step} {time.perf_counter() - t0:.3f}")


def warm_up(x: torch.Tensor, y: torch.Tensor) -> None:
    """Pay the first-call costs (lazy imports, autograd and optimizer set-up, zstd) once, before
    forking, so that a writer reaches its first save within the parent's kill window."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        model = DigitsMLP(hidden=32)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        chain = CheckpointChain(d, "lossless", keyframe=KeyframePolicy(every=4))
        for step in (1, 2):
            torch.nn.functional.cross_entropy(model(x[:32]), y[:32]).backward()
            opt.step()
            chain.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, step=step)
        chain.load()


def main() -> None:
    chain_dir, data_file = sys.argv[1], sys.argv[2]
    data = torch.load(data_file, weights_only=True)
    warm_up(data["x"], data["y"])
    say("ready")
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            return
        if cmd != "fork":
            say(f"error unknown command {cmd!r}")
            continue
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                writer(chain_dir, data["x"], data["y"])
            except BaseException as e:  # report, so a broken writer fails the test instead of idling
                say(f"error {e.__class__.__name__}: {e}")
                code = 1
            os._exit(code)
        say(f"pid {pid}")
        _, status = os.waitpid(pid, 0)
        say(f"exit {status}")


if __name__ == "__main__":
    main()
