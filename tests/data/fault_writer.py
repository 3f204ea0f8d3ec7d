"""Fork server for tests/test_chain_faults.py and bench/faults.py: imports torch once, then forks one
child per command, so each trial costs a fork, not an interpreter start.

Run as ``python fault_writer.py``; stdin commands (paths are chain folders):

    save DIR STEP KILL_AT [takeover]
                            -> a child saves step STEP into DIR (keyframe every 2, keep_last 2) through
                               the failing filesystem (tests/faultfs.py), SIGKILLed at its KILL_AT-th
                               storage call (0: never), fencing a live owner with "takeover";
                               answers "exit STATUS" (9: killed, 0: saved, 1: after an "error" line)
    read DIR SECONDS        -> a child loops restore (latest) + verify on DIR for SECONDS; answers
                               "read ITERATIONS ERRORS FIRST_ERROR..." and then "exit STATUS"
    quit
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: faultfs, helpers
import faultfs  # noqa: E402
from ckptzip.chain import CheckpointChain, KeyframePolicy, RetentionPolicy  # noqa: E402


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(2000, generator=g)}, "step": step}


def writer_chain(folder: str, plan=None, **kw) -> CheckpointChain:
    url = f"faulty://{folder}" if plan is not None else folder
    opts = {"target_protocol": "file", "plan": plan} if plan is not None else None
    return CheckpointChain(url, "lossless", keyframe=KeyframePolicy(every=2), retention=RetentionPolicy(keep_last=2),
                           storage_options=opts, **kw)


def save(folder: str, step: int, kill_at: int, takeover: bool = False) -> None:
    plan = faultfs.FaultPlan()
    if kill_at:
        plan.arm(kill_at, None, when="kill")
    writer_chain(folder, plan, takeover=takeover).save(state(step), step=step)


def read(folder: str, seconds: float) -> None:
    chain = CheckpointChain(folder)
    n, errors, first = 0, 0, ""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            got = chain.load()
            assert got["step"] == chain.entries()[-1].step, "loaded a step that is not the index's latest"
            problems = chain.verify(deep=False)
            if problems:
                raise AssertionError(f"verify: {problems[0]}")
        except Exception as e:  # noqa: BLE001 - every error counts
            errors += 1
            first = first or f"{type(e).__name__}: {e}"
        n += 1
    say(f"read {n} {errors} {' '.join(first.split())}")


def main() -> None:
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            return
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                if cmd[0] == "save":
                    save(cmd[1], int(cmd[2]), int(cmd[3]), "takeover" in cmd[4:])
                elif cmd[0] == "read":
                    read(cmd[1], float(cmd[2]))
            except BaseException as e:  # report, so a broken child fails the test instead of idling
                say(f"error {type(e).__name__}: {' '.join(str(e).split())}")
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        say(f"exit {os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)}")


if __name__ == "__main__":
    torch.set_num_threads(1)  # no thread pools before fork
    say("ready")
    main()
