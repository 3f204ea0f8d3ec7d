"""What an asynchronous save returns: ``staged`` (safe to mutate weights) and ``committed`` (durable)."""
from __future__ import annotations

import threading

from ..chain import Entry


class Signal:
    """A one-shot event that re-raises the failure it was set with (``wait`` never hangs on an error)."""

    def __init__(self):
        self._ev = threading.Event()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._ev.set()

    def is_set(self) -> bool:
        return self._ev.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once set (False on timeout); raises the stored error, if any."""
        ok = self._ev.wait(timeout)
        if ok and self.error is not None:
            raise self.error
        return ok


class SaveHandle:
    """One asynchronous save: ``staged`` (safe to mutate weights) and ``committed`` (durable)."""

    def __init__(self, step: int, seq: int):
        self.step, self.seq = step, seq
        self.staged, self.committed = Signal(), Signal()
        self.entry: Entry | None = None

    @property
    def error(self) -> BaseException | None:
        return self.committed.error

    def done(self) -> bool:
        return self.committed.is_set()

    def wait(self, timeout_s: float | None = None) -> Entry:
        """The committed entry; re-raises the agent's error (AgentError, with its traceback)."""
        if not self.committed.wait(timeout_s):
            raise TimeoutError(f"async save of step {self.step} not committed within {timeout_s} s")
        return self.entry

    def __repr__(self) -> str:
        st = "failed" if self.error else "committed" if self.done() else "staged" if self.staged.is_set() else "new"
        return f"SaveHandle(step={self.step}, {st})"
