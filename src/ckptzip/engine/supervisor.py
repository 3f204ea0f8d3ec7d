"""The agent as the trainer sees it: its lives (subprocesses), the commands sent, the events read.

One :class:`AgentProc` per life of ``python -m ckptzip.engine.agent``; the :class:`Supervisor`
keeps the unsettled commits (seq -> SaveHandle, in submission order) and settles them from the
agent's events on a reader thread, under the engine's condition. What happens to a commit::

    submit(seq, handle, slot)       starts an agent if there is none, sends {"op": "commit", ...}
    event "committed"               handle.committed is set, the slot released
    event "failed"                  handle.committed is set with an AgentError (the agent's
                                    traceback), kept for the engine's wait()
    the agent exits, commits open   a new life gets every unsettled commit again (the agent skips
                                    steps the chain already has); the oldest fails after
                                    max_agent_restarts deaths
    event "fatal" (cannot start)    every unsettled commit fails with the reason
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

from ..chain import Entry
from ..errors import AgentError
from . import staging
from .handle import SaveHandle
from .options import EngineOptions
from .slots import SlotPool


class AgentProc:
    """One life of the agent subprocess, with the threads that send its commands and read its events."""

    def __init__(self, supervisor: "Supervisor", spec: dict):
        opts = supervisor.options
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self._log = open(opts.agent_log, "ab") if opts.agent_log else None
        # the niceness and the thread count must hold before the agent imports torch (about 1.5 s of
        # CPU): at the trainer's priority, with a full-size OpenMP pool, the start-up stalled the
        # trainer's pool (steps 100x slower while an agent started, measured on 2 cores)
        env["OMP_NUM_THREADS"] = str(opts.threads)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptzip.engine.agent"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log or subprocess.DEVNULL, env=env, close_fds=True,
            start_new_session=True)  # its own session: signals to the trainer's group do not reach it
        if opts.agent_nice:
            try:
                os.setpriority(os.PRIO_PROCESS, self.proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + opts.agent_nice)
            except OSError:
                pass  # it already exited: the reader thread reports why
        self.ready = threading.Event()
        self.fatal: dict | None = None
        self.truncated: dict[int, dict] = {}
        # commands go out from a thread: writing to the pipe wakes the agent, and on a busy machine
        # the scheduler may then run it before the trainer (5 ms per save measured on 2 cores)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sender = threading.Thread(target=self._send_loop, daemon=True, name="ckptzip-agent-commands")
        self.sender.start()
        self.send(spec)
        self.reader = threading.Thread(target=supervisor.read_events, args=(self,), daemon=True,
                                       name="ckptzip-agent-events")
        self.reader.start()
        self.timer = threading.Timer(opts.agent_start_timeout_s, self._start_timeout)
        self.timer.daemon = True
        self.timer.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, obj: dict | None) -> None:
        """Queue one command (None: close the pipe after the queued ones)."""
        self._outbox.put(obj)

    def _send_loop(self) -> None:
        while True:
            obj = self._outbox.get()
            try:
                if obj is None:
                    self.proc.stdin.close()
                    return
                self.proc.stdin.write((json.dumps(obj) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass  # it died: the reader thread sees EOF and handles it

    def _start_timeout(self) -> None:
        if not self.ready.is_set() and self.alive():
            self.proc.kill()

    def stop(self, timeout_s: float) -> None:
        self.timer.cancel()
        try:
            if self.alive() and self.ready.is_set():
                self.send({"op": "close"})
                self.send(None)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            if self.alive():
                self.proc.kill()
            self.proc.wait()
        finally:
            self.send(None)
            self.sender.join(5)
            for f in (self.proc.stdin, self._log):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
        self.reader.join(5)


class Supervisor:
    """The agent's lives and the commits it owes; every method runs under the engine's condition."""

    def __init__(self, spec: dict, options: EngineOptions, cond: threading.Condition, pool: SlotPool):
        self.spec, self.options, self.cond, self.pool = spec, options, cond, pool
        self.agent: AgentProc | None = None
        self.outstanding: dict[int, SaveHandle] = {}   # seq -> handle, in submission order
        self.slot_of: dict[int, int] = {}
        self.deaths: dict[int, int] = {}
        self.errors: list[AgentError] = []
        self.closing = False

    # --- lives ------------------------------------------------------------------------------
    def start(self) -> None:
        self.agent = AgentProc(self, self.spec)

    def ensure(self) -> None:
        """Start an agent if there is none; a new one gets every unsettled commit."""
        if self.agent is None:
            self.start()
            for seq in self.outstanding:
                self._send_commit(seq)

    def stop(self, timeout_s: float) -> None:
        with self.cond:
            self.closing = True
            agent, self.agent = self.agent, None
        if agent is not None:
            agent.stop(timeout_s=timeout_s)

    # --- commits ----------------------------------------------------------------------------
    def submit(self, seq: int, handle: SaveHandle, slot: int) -> None:
        self.outstanding[seq], self.slot_of[seq] = handle, slot
        if self.agent is None:
            self.ensure()  # sends seq with the others
        else:
            self._send_commit(seq)

    def pending_steps(self) -> list[int]:
        return [h.step for h in self.outstanding.values()]

    def settle(self, timeout_s: float | None = None) -> None:
        """Wait until every submitted commit is settled (TimeoutError after ``timeout_s``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.outstanding:
            if self.agent is None and not self.closing:
                self.ensure()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.outstanding)} async saves not committed within {timeout_s} s")
            self.cond.wait(0.05)

    def take_errors(self) -> list[AgentError]:
        errs, self.errors = self.errors, []
        return errs

    def truncate(self, url: str, target: int, deadline: float) -> None:
        """Have the agent roll the chain back to ``target`` (resent to a new life if one dies)."""
        sent_to = None
        while True:
            self.ensure()
            a = self.agent
            if a is not sent_to:
                a.send({"op": "truncate", "step": target})
                sent_to = a
            ev = a.truncated.get(target)
            if ev is not None:
                if ev.get("error"):
                    raise AgentError(f"rolling {url} back to step {target} failed in the agent: {ev['error']}\n\n"
                                     f"agent traceback:\n{ev.get('traceback', '')}")
                return
            if time.monotonic() > deadline:
                raise AgentError(f"the agent did not roll {url} back to step {target} in time")
            self.cond.wait(0.05)

    def _send_commit(self, seq: int) -> None:
        self.agent.send({"op": "commit", "slot": self.slot_of[seq], "seq": seq, "step": self.outstanding[seq].step})

    def _release(self, seq: int) -> int | None:
        i = self.slot_of.pop(seq, None)
        self.pool.release(i, seq)
        return i

    def _fail(self, seq: int, err: AgentError) -> None:
        h = self.outstanding.pop(seq)
        self._release(seq)
        h.committed.set(err)
        self.errors.append(err)

    # --- events (the reader thread) ---------------------------------------------------------
    def read_events(self, agent: AgentProc) -> None:
        for line in agent.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with self.cond:
                self._on_event(agent, ev)
                self.cond.notify_all()
        rc = agent.proc.wait()
        with self.cond:
            self._on_exit(agent, rc)
            self.cond.notify_all()

    def _on_event(self, agent: AgentProc, ev: dict) -> None:
        kind = ev.get("ev")
        if kind == "ready":
            agent.ready.set()
            agent.timer.cancel()
        elif kind == "fatal":
            agent.fatal = ev
        elif kind == "truncated":
            agent.truncated[int(ev["step"])] = ev
        elif kind in ("committed", "failed"):
            seq = int(ev["seq"])
            h = self.outstanding.get(seq)
            if h is None:
                self._release(seq)
            elif kind == "committed":
                self.outstanding.pop(seq)
                self._release(seq)
                h.entry = Entry(**ev["entry"])
                h.committed.set()
            else:
                tb = ev.get("traceback", "")
                self._fail(seq, AgentError(f"async save of step {h.step} failed in the agent: {ev['error']}\n\n"
                                           f"agent traceback:\n{tb}", step=h.step, exc_type=ev.get("exc_type"),
                                           errno=ev.get("errno"), agent_traceback=tb))

    def _on_exit(self, agent: AgentProc, rc: int) -> None:
        agent.timer.cancel()
        if agent is not self.agent:
            return
        self.agent = None
        if self.closing:
            return
        if agent.fatal is not None:  # it could not start: every pending save fails with the reason
            f = agent.fatal
            for seq in list(self.outstanding):
                step = self.outstanding[seq].step
                self._fail(seq, AgentError(f"the agent could not start: {f['error']}\n\nagent traceback:\n"
                                           f"{f['traceback']}", step=step, exc_type=f.get("exc_type"),
                                           agent_traceback=f["traceback"]))
            return
        if self.outstanding:
            seq = next(iter(self.outstanding))
            self.deaths[seq] = self.deaths.get(seq, 0) + 1
            if self.deaths[seq] > self.options.max_agent_restarts:
                i = self.slot_of.get(seq)
                if i is not None:
                    staging.set_state(self.pool.slots[i].seg, staging.FAILED)
                step = self.outstanding[seq].step
                self._fail(seq, AgentError(f"the agent died (exit code {rc}) {self.deaths[seq]} times while "
                                           f"committing step {step}; the step stays in shared memory but is not "
                                           "committed", step=step))
        if self.outstanding:
            self.start()
            for seq in self.outstanding:  # the new agent commits them again; steps already in the chain
                self._send_commit(seq)    # are reported committed without re-encoding
