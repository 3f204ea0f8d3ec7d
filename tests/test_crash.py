"""Crash consistency: a writer saving a real digits run is SIGKILLed at random moments, again and
again; after every kill the chain verifies clean and its latest committed step loads.

The writer (tests/data/crash_writer.py) is a fresh interpreter started with ``sys.executable``; it
imports torch once and forks one writer process per trial (a fresh interpreter per trial would spend
seconds importing torch). Each writer resumes from the latest committed step, as a restarted job
does, so the trials also exercise restore-after-crash and delta chains across restarts.
"""
import os
import pathlib
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from ckptzip.chain import INDEX, CheckpointChain
from ckptzip.demo.workloads import DigitsMLP, digits_data

WRITER = pathlib.Path(__file__).parent / "data" / "crash_writer.py"
TRIALS = 60


class Writer:
    """The fork server subprocess and a thread that forwards its stdout lines to a queue."""

    def __init__(self, chain_dir, data_file):
        self.proc = subprocess.Popen([sys.executable, str(WRITER), str(chain_dir), str(data_file)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []  # this trial's lines, for failure messages
        self.saved = 0            # the last step a writer reported saved
        self.child: int | None = None
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("eof")

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        """Next line starting with ``prefix``; 'saved' lines on the way are returned via self.saved."""
        end = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, end - time.monotonic()))
            self.log.append(line)
            if line.startswith("saved "):
                self.saved = int(line.split()[1])
            if line.startswith(("error", "eof")):
                pytest.fail(f"crash writer: {line}")
            if line.startswith(prefix):
                return line

    def send(self, cmd: str):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def close(self):
        if self.child is not None:  # a failed trial: its writer must not outlive the test
            try:
                os.kill(self.child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "SIGKILL"), reason="needs POSIX fork and SIGKILL")
def test_sigkill_at_random_moments_leaves_a_consistent_chain(tmp_path):
    x, y, _, _ = digits_data(0)
    data_file = tmp_path / "digits.pt"
    torch.save({"x": x[:512].clone(), "y": y[:512].clone()}, data_file)
    chain_dir = tmp_path / "chain"
    writer = Writer(chain_dir, data_file)
    rng = random.Random(0)
    chain = CheckpointChain(chain_dir)
    orphaned_trials = committed = 0
    seen_orphans: set[str] = set()
    try:
        writer.expect("ready", timeout=120)
        for trial in range(TRIALS):
            writer.log.clear()
            writer.send("fork")
            pid = writer.child = int(writer.expect("pid").split()[1])
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(pid, signal.SIGKILL)
            status = int(writer.expect("exit").split()[1])
            writer.child = None
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"trial {trial}: {status}"

            assert chain.verify(deep=False) == [], f"trial {trial}"
            steps = chain.steps()
            latest = steps[-1] if steps else 0
            # every save a writer saw return is committed, nothing committed is lost, and at most one
            # save per trial is committed unreported (killed after its commit, before saying so)
            assert max(writer.saved, committed) <= latest <= max(writer.saved, committed) + 1, \
                (trial, writer.saved, committed, steps, writer.log)
            committed = latest
            if steps:
                state = chain.load()
                assert state["step"] == steps[-1]
                DigitsMLP(hidden=32).load_state_dict(state["model"])
            orphans = set(chain.orphans())  # leftovers of a killed save or of a killed retention delete
            orphaned_trials += bool(orphans - seen_orphans)
            seen_orphans |= orphans
    finally:
        writer.close()

    steps = chain.steps()
    assert steps and steps[-1] >= TRIALS // 3, f"writers made little progress: {steps}"
    assert steps == list(range(steps[0], steps[-1] + 1))  # retention keeps a contiguous replayable run
    assert chain.verify(deep=True) == []
    for s in steps:
        assert chain.load(s)["step"] == s
    leftovers = chain.gc()
    assert chain.orphans() == [] and set(chain.storage.list()) == {INDEX} | {e.file for e in chain.entries()}
    print(f"\n{TRIALS} kills: latest step {steps[-1]}, {orphaned_trials} trials left new orphans, "
          f"gc removed {len(leftovers)}")
