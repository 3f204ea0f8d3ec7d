"""Writer fencing: one owner per chain at a time, named in the document every commit rewrites.

The owner record (JSON) travels inside what a writer commits -- the chain's ``index.json`` carries
it as ``"owner"`` -- and every commit is a compare-and-swap of that document
(:meth:`ckptzip.storage.Storage.write_if`). The record says who may write; the compare-and-swap
makes a commit based on a stale read fail, whoever made it. Call order for one write::

    lease = Lease(url, takeover=False, lease_s=600.0)
    doc, version = storage.read_versioned(name)       # the current document and its owner
    record = lease.claim(doc.get("owner"))            # ChainBusyError, or the record to commit
    ... write the payload (a new, exclusively created object) ...
    storage.write_if(name, doc_with(record), version) # the commit; WriteConflictError: lost
    lease.held(record)                                # on success
    raise lease.lost(owner_now, what)                 # on WriteConflictError, after a re-read
    if lease.mine(owner): storage.write_if(name, doc_with(lease.released(owner)), version)  # release

Who counts as live: an owner on this machine (same boot id and pid namespace) while its process
runs (pid and start time, so a reused pid is not mistaken for it); an owner elsewhere until
``lease_s`` after its last commit (clocks assumed to agree within seconds); an owner that released
(closed its chain) never. A live owner makes ``claim`` raise :class:`ChainBusyError` unless
``takeover=True``; a dead one is taken over silently. A writer that held the chain and finds
another owner has been fenced: it never takes the chain back by itself (a new one with
``takeover=True`` does). Records without an owner (chains written by ckptzip 0.1) are free.

Processes, not objects, own chains: two chain objects in one process share the identity.
"""
from __future__ import annotations

import os
import socket
import time
import uuid

from .configcheck import Range, check_arg
from .errors import ChainBusyError

_ME: dict = {}


def this_process() -> dict:
    """This process as an owner: id, host, machine, pid, start (recomputed after a fork)."""
    pid = os.getpid()
    if _ME.get("pid") != pid:
        host = socket.gethostname()
        _ME.clear()
        _ME.update(id=f"{host}:{pid}:{uuid.uuid4().hex[:12]}", host=host, machine=_machine(), pid=pid,
                   start=_proc_start(pid)[1])
    return dict(_ME)


def alive(owner: dict, now: float | None = None) -> bool:
    """Whether ``owner`` may still write (see the module docstring)."""
    if owner.get("released"):
        return False
    if owner.get("machine") and owner["machine"] == _machine():
        state, start = _proc_start(int(owner.get("pid", -1)))
        if state is None:  # no /proc: signal 0 tells whether the pid exists
            return _pid_exists(int(owner.get("pid", -1)))
        return state not in "ZX" and (owner.get("start") in (None, start))
    now = time.time() if now is None else now
    return now < float(owner.get("renewed_unix", 0)) + float(owner.get("lease_s", 0))


def describe(owner: dict) -> str:
    since = time.time() - float(owner.get("renewed_unix", time.time()))
    return (f"pid {owner.get('pid')} on {owner.get('host')}, generation {owner.get('generation')}, "
            f"last commit {since:.0f} s ago")


class Lease:
    """One writer's claim on one chain (or any document committed by compare-and-swap)."""

    def __init__(self, url: str, *, takeover: bool = False, lease_s: float = 600.0):
        check_arg("Lease lease_s", lease_s, float, Range(gt=0))
        self.url, self.takeover, self.lease_s = url, takeover, float(lease_s)
        self.generation: int | None = None   # the generation this writer holds (None: never held)

    def claim(self, owner: dict | None) -> dict:
        """The owner record to commit next; ChainBusyError if another writer owns the chain."""
        me = this_process()
        gen = int(owner.get("generation", 0)) if owner else 0
        if owner and owner.get("id") == me["id"]:
            gen += 1 if owner.get("released") else 0
        elif self.generation is not None:
            raise self._fenced(owner)
        elif owner is None or self.takeover or not alive(owner):
            gen += 1
        else:
            raise ChainBusyError(
                f"{self.url} is being written by another process ({describe(owner)}); one writer per chain: "
                "stop that writer, or if it is gone for good take the chain over with takeover=True "
                "(CheckpointChain(..., takeover=True) or Compressor(..., takeover=True))")
        return {**me, "generation": gen, "renewed_unix": round(time.time(), 3), "lease_s": self.lease_s}

    def held(self, record: dict) -> None:
        """A commit with ``record`` succeeded."""
        self.generation = int(record["generation"])

    @staticmethod
    def mine(owner: dict | None) -> bool:
        """Whether ``owner`` (the record now committed) is this process, unreleased."""
        return bool(owner) and owner.get("id") == this_process()["id"] and not owner.get("released")

    @staticmethod
    def released(record: dict) -> dict:
        return {**record, "released": True, "renewed_unix": round(time.time(), 3)}

    def lost(self, owner: dict | None, what: str) -> ChainBusyError:
        """The error for a commit that lost its compare-and-swap (``owner``: the record now committed)."""
        if owner and owner.get("id") == this_process()["id"]:
            who = "another chain object in this process"
        elif owner:
            who = f"another writer ({describe(owner)})"
        else:
            who = "another writer"
        return ChainBusyError(f"{who} committed to {self.url} while this writer was {what}; nothing of it was "
                              "committed; one writer per chain: stop the other writer, or reopen the chain "
                              "(takeover=True to fence the other one)")

    def _fenced(self, owner: dict | None) -> ChainBusyError:
        who = f"another writer ({describe(owner)})" if owner else "another writer"
        return ChainBusyError(f"{self.url} was taken over by {who} after this writer's last commit; this writer is "
                              "fenced and commits nothing more: stop it (the other writer continues the chain), or "
                              "open a new CheckpointChain(..., takeover=True) to take the chain back")


def _machine() -> str:
    """Boot id and pid namespace: equal exactly when pids can be compared (hostname elsewhere)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


def _proc_start(pid: int) -> tuple[str | None, int | None]:
    """(state letter, start time in clock ticks) of a process from /proc; ('X', None) if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], int(rest[19])
    except FileNotFoundError:
        return ("X", None) if os.path.isdir("/proc/self") else (None, None)
    except (OSError, IndexError, ValueError):
        return None, None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0
