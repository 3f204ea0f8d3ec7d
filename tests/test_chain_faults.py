"""Retention under crashes, and readers under a writer's commits (chain.py), with real processes.

A writer (a child of tests/data/fault_writer.py, a fork server) is SIGKILLed at each storage
call of a save whose retention drops files in turn: before its container, between container and
commit, between the commit and the deletes, mid-sweep. After every kill a reader finds a chain
that verifies (never an entry without its file), holding either the old steps or the new ones;
gc removes what the kill left; the next writer takes the dead owner's chain over and saves on.
A reader process looping restore and verify while a writer saves and sweeps sees no error.
"""
import pathlib
import queue
import shutil
import subprocess
import sys
import threading
import time

import pytest

from helpers import assert_same

sys.path.insert(0, str(pathlib.Path(__file__).parent / "data"))
import fault_writer  # noqa: E402  (its state() and writer_chain() are what the children use)


class ForkServer:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, fault_writer.__file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        assert self.next(120) == "ready"

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("eof")

    def next(self, timeout=60.0) -> str:
        line = self.lines.get(timeout=timeout)
        assert not line.startswith(("error", "eof")), line
        return line

    def send(self, cmd: str) -> None:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def close(self):
        if self.proc.poll() is None:
            self.send("quit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def server():
    s = ForkServer()
    yield s
    s.close()


def test_kill_at_every_storage_call_of_a_save_with_retention(tmp_path, server):
    template = tmp_path / "template"
    chain = fault_writer.writer_chain(str(template))
    for step in (1, 2, 3):
        chain.save(fault_writer.state(step), step=step)
    old = chain.steps()
    chain.close()  # releases the chain: copies of it are free for the children
    killed = orphaned = 0
    for at in range(1, 100):
        d = tmp_path / f"kill-{at}"
        shutil.copytree(template, d)
        server.send(f"save {d} 4 {at}")
        status = int(server.next().split()[1])
        assert status in (0, 9), status
        chain = fault_writer.writer_chain(str(d))
        assert chain.verify() == [], f"killed at call {at}"  # never an entry without its file
        steps = chain.steps()
        assert steps == old or steps[-1] == 4, (at, steps)
        assert_same(fault_writer.state(steps[-1]), chain.load())
        orphaned += bool(chain.orphans())
        chain.gc()
        assert chain.orphans() == [] and chain.verify() == []
        chain.save(fault_writer.state(5), step=5)  # the killed owner is taken over without asking
        assert chain.steps()[-1] == 5 and chain.verify() == []
        if status == 0:
            break
        killed += 1
    assert killed >= 6 and orphaned >= 3, (killed, orphaned)  # incl. kills between commit and sweep


def test_readers_during_commits_see_a_consistent_chain(tmp_path, server):
    d = tmp_path / "c"
    chain = fault_writer.writer_chain(str(d))
    step = 0
    for step in (1, 2):
        chain.save(fault_writer.state(step), step=step)
    server.send(f"read {d} 3")
    deadline = time.monotonic() + 120
    answer = None
    while answer is None and time.monotonic() < deadline:
        step += 1
        chain.save(fault_writer.state(step), step=step)  # keyframe every 2, keep_last 2: files go often
        time.sleep(0.01)
        try:
            answer = server.lines.get_nowait()
        except queue.Empty:
            pass
    assert server.next() == "exit 0"
    _, n, errors, *first = answer.split()
    assert int(errors) == 0, " ".join(first)
    assert int(n) >= 10 and step >= 10, (n, step)
