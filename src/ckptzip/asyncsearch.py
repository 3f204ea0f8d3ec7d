"""The config search of asynchronous saves, on a background thread of the trainer.

(Where the user can name a factory of the model and eval_fn, ``EngineOptions.agent_eval``, the
agent searches instead and none of this runs: no GIL shared with the training loop.)

An async save (``Compressor(async_save=True)``) returns once the state is copied; the agent process
(engine/) encodes the copy. The agent cannot run ``eval_fn`` (a closure over the live model does not
cross processes), so for a method that searches its config the trainer runs the search itself, off
the training thread, and hands the agent the knobs it chose::

    training thread                        search thread (one, saves in order)
    save(step): copy the state to CPU  --> choose_knobs(copy) on a scratch model (search/)
                return a handle            engine.save(copy, ctx.search = {knobs, info, state})
                                             --> the agent encodes with those knobs and commits

What the user provides, and what it costs:

- ``eval_fn(model)`` must read only the model it is given (a private scratch copy, evaluated on the
  search thread) and must not need the global RNG: eval mode, fixed batches. The search thread leaves
  torch's, numpy's and python's global RNG states alone (restoring them would race the training loop),
  so an eval_fn that draws from them perturbs the training stream.
- A scratch copy of the model, made once on the training thread at the first search (GPU memory when
  the model is on a GPU), and CPU / GPU time beside training for the evaluations.
- One CPU copy of the state per save in flight; ``save`` blocks while ``max_pending`` searches wait.
- The search's reference is rebuilt here as the agent's encoder builds its own: the codes of the
  config chosen last time (quantized again here, off the training thread) and, once residuals
  follow (dynaquant's ``residual``), their reconstructions; after a restore, the decoded file
  (``resume``). The agent's keyframe policy is not known here, so a keyframe is estimated (and
  judged) as the delta it would otherwise have been.

Errors of the search thread (and of the agent) come back through the handle's ``wait`` and
``SearchingSaver.wait``; nothing is logged and forgotten.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from .methods.base import EncodeContext
from .parallel import serial_kernels
from .search.scratch import scratch_copy
from .state import FlatState, flatten_state

__all__ = ["SearchingSaver", "SearchHandle"]


class SearchHandle:
    """An async save whose config search runs in the background: ``staged`` is set at once (the state
    is copied), ``committed`` once the agent has committed the file (``wait`` re-raises failures)."""

    def __init__(self, step: int):
        self.step = step
        self.searched = threading.Event()
        self.engine_handle = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.error is not None or (self.engine_handle is not None and self.engine_handle.done())

    def wait(self, timeout_s: float | None = None):
        """The committed entry; re-raises the search's or the agent's error."""
        if not self.searched.wait(timeout_s):
            raise TimeoutError(f"the config search of step {self.step} did not finish within {timeout_s} s")
        if self.error is not None:
            raise self.error
        return self.engine_handle.wait(timeout_s)

    def __repr__(self) -> str:
        st = "failed" if self.error else "searched" if self.searched.is_set() else "searching"
        return f"SearchHandle(step={self.step}, {st})"


@dataclass
class _Job:
    flat: FlatState
    step: int
    gradients: dict | None
    handle: SearchHandle = field(default=None)


class SearchingSaver:
    """Async saves with the config search on a background thread (see the module docstring)."""

    def __init__(self, engine, method, model: torch.nn.Module, eval_fn, *, threshold: float = 0.01,
                 higher_is_better: bool = False, max_pending: int = 1):
        self.engine, self.method, self.model, self.eval_fn = engine, method, model, eval_fn
        self.threshold, self.higher_is_better = threshold, higher_is_better
        self._jobs: queue.Queue = queue.Queue(maxsize=max(1, int(max_pending)))
        self._scratch: torch.nn.Module | None = None
        self._reference = None       # what the agent's next save is coded against, as the search sees it
        self._errors: list[BaseException] = []
        self._handles: list[SearchHandle] = []
        self._thread = threading.Thread(target=self._run, name="ckptzip-search", daemon=True)
        self._thread.start()

    def save(self, state: dict, step: int, *, model=None, optimizer=None, gradients=None) -> SearchHandle:
        """Copy ``state`` (blocks only for the copy, and while ``max_pending`` searches wait) and queue
        its search and commit."""
        self._raise()
        if self._scratch is None:  # once, on the training thread: the search thread never touches the live model
            self._scratch = scratch_copy(self.model)
        flat = flatten_state(state, model, optimizer, step_records=self.method.step_records)
        flat = FlatState({n: t.detach().to("cpu", copy=True) for n, t in flat.tensors.items()}, flat.records,
                         flat.skeleton)
        grads = {k: v.detach().clone() for k, v in gradients.items()} if gradients else None
        h = SearchHandle(int(step))
        self._handles.append(h)
        self._jobs.put(_Job(flat, int(step), grads, h))
        return h

    def resume(self, reference) -> None:
        """After a restore: the reference the agent's next save is coded against (the decoded file)."""
        self._reference = reference

    def wait(self) -> None:
        """Block until every queued search is done and its save committed; re-raise the first error."""
        self._jobs.join()
        self._raise()
        self.engine.wait()
        for h in self._handles:
            h.wait()
        self._handles.clear()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._jobs.put(None)
            self._thread.join(timeout=60)

    def _raise(self) -> None:
        if self._errors:
            raise self._errors[0]

    def _run(self) -> None:
        serial_kernels()  # the trainer's OpenMP team keeps its cores (parallel.py says why)
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                try:
                    self._search_and_stage(job)
                except BaseException as e:  # noqa: BLE001 - handed back to the trainer, never dropped
                    job.handle.error = e
                    self._errors.append(e)
                finally:
                    job.handle.searched.set()
            finally:
                self._jobs.task_done()

    def _search_and_stage(self, job: _Job) -> None:
        base = self.engine.chain.base  # the agent codes keyframes against the same base weights
        ctx = EncodeContext(step=job.step, model=self._scratch, eval_fn=self.eval_fn, threshold=self.threshold,
                            higher_is_better=self.higher_is_better, gradients=job.gradients, base=base)
        t0 = time.perf_counter()
        knobs, info = self.method.search_knobs(job.flat, self._reference, ctx)
        # the search's seconds in the file's summary, as a synchronous save records them
        info = {**info, "search_s": round(time.perf_counter() - t0, 3)}
        # what the next search estimates deltas against: this checkpoint's codes under the chosen knobs
        self._reference = self.method.search_reference(job.flat, knobs, job.gradients, job.step, self._reference,
                                                       base=base)
        search = {"knobs": knobs, "info": info, "state": self.method.search_state}
        job.handle.engine_handle = self.engine.save(
            job.flat, job.step, ctx=EncodeContext(step=job.step, threshold=self.threshold,
                                                  higher_is_better=self.higher_is_better,
                                                  gradients=job.gradients, search=search))
