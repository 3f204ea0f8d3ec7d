"""Who may save a chain asynchronously: one live trainer per chain and rank, and the hand-over from
the agent of a trainer that died.

The control block (``staging.Control``) carries two POSIX record locks: byte 0 is held by the live
trainer's engine, byte 1 by the live agent; the kernel drops them when a process dies. Call order
when an engine opens::

    1. lock byte 0, or raise ChainBusyError (another live trainer saves this chain and rank)
    2. byte 1 held: the agent of a trainer that died; ask it to hand over (``takeover_pid``) and
       wait until it has committed what it held, released the chain (lease.py) and exited
    3. record our pid; the engine then applies the chain's own fence (``chain.check_writer()``,
       the mechanism every writer shares): a live writer elsewhere also raises ChainBusyError, and
       a claim of this very process (a synchronous writer here) is released for the agent
"""
from __future__ import annotations

import os
import time

from ..errors import AgentError, ChainBusyError
from . import staging


def take_ownership(ctl: staging.Control, url: str, rank: int, takeover_timeout_s: float) -> None:
    """Make this process the trainer of ``ctl``'s chain and rank (the caller closes ``ctl`` if it raises)."""
    while True:
        if not ctl.try_lock(staging.TRAINER_BYTE):
            pid = ctl.trainer_pid
            raise ChainBusyError(f"{url} (rank {rank}) is being saved asynchronously by process {pid}; one writer "
                                 "per chain and rank: close that engine or stop its process first (a crashed "
                                 "one hands over by itself)")
        if ctl.reopen_if_unlinked():
            continue  # we locked a removed name; lock the current one
        if ctl.held_elsewhere(staging.AGENT_BYTE):
            # the agent of a trainer that died: it finishes its current commit, then hands over
            ctl.takeover_pid = os.getpid()
            deadline = time.monotonic() + takeover_timeout_s
            while ctl.held_elsewhere(staging.AGENT_BYTE):
                if time.monotonic() > deadline:
                    pid = ctl.agent_pid
                    raise AgentError(f"the agent (pid {pid}) of a previous trainer of {url} did not hand "
                                     f"over within {takeover_timeout_s} s; kill it or wait")
                time.sleep(0.02)
            if ctl.reopen_if_unlinked():
                continue  # it cleaned up just before we asked: start afresh
        break
    ctl.takeover_pid = 0
    ctl.trainer_pid = os.getpid()
