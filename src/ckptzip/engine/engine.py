"""``AsyncCheckpointEngine``: training blocks only for a copy into shared memory (BitSnap, sec. 3.2).

    engine = AsyncCheckpointEngine("runs/ckpt", "lossless")
    h = engine.save(state, step, model=model, optimizer=opt)   # returns once the copy is done
    h.staged.is_set()          # True: safe to mutate the weights
    h.committed.wait(60)       # durable in the chain (re-raises the agent's error with its traceback)
    found = engine.restore()   # (state, step) or None: newest complete in-memory copy first
    engine.close()             # flush, stop the agent, unlink shared memory

The path of one save::

    trainer                                        agent process (agent.py)
    flatten_state -> pick a free slot (waits,      ... compressing the previous slot ...
      with a BackpressureWarning, while the agent
      is R-1 saves behind) -> copy tensors into
      the slot, checksum, COMPLETE marker
    -> handle.staged; send {"commit", slot, seq} -> verify slot, chain.save(views), mark COMMITTED,
                                                     {"committed", entry} -> handle.committed

Design decisions:

Modules, one job each: ``options.py`` (EngineOptions), ``ownership.py`` (one trainer per chain and
rank, hand-over from a dead trainer's agent), ``slots.py`` (the slot pool), ``supervisor.py`` (the
agent's lives, commands and events), ``handle.py`` (SaveHandle), ``distributed.py`` (the step ranks
agree on), ``staging.py`` (the slot format), ``agent.py`` (the agent process); this module ties
them into save / wait / restore / close.

- **Slots** (staging.py, slots.py): ``R`` (``redundancy``, default 2) shared-memory segments named from a hash
  of the chain URL and the rank, reused round robin; the newest R staged checkpoints stay in memory,
  each with a complete marker written last and a checksum (summed by the agent unless
  ``checksum_by="trainer"``). A slot is rewritten only after the agent
  has settled its commit (committed or failed), so the agent reads the slot in place: no second copy.
- **Agent** (agent.py, supervisor.py): a ``python -m ckptzip.engine.agent`` subprocess in its own session, fed JSON
  lines. Only names, numbers, the skeleton JSON and record dicts cross. The EncodeContext crosses
  without ``model`` and ``eval_fn`` (a live module and a closure cannot): a method that searches its
  config against ``eval_fn`` (dynaquant, qd, cnr, gobo) needs the search run in the trainer --
  ``Compressor(async_save=True, eval_fn=...)`` does that on a background thread (asyncsearch.py) and
  passes the chosen knobs as ``EncodeContext.search`` (JSON), which the agent's method uses; given
  ``eval_fn`` here directly, it runs its fixed config. Tensor fields of the context (gradients for
  the sensitivity metric) are staged beside the state.
- **Agent death**: the engine's reader thread sees the pipe close, starts a new agent and resubmits
  every unsettled commit (the agent skips steps the chain already has), so nothing staged is lost;
  after ``max_agent_restarts`` deaths on one step that step fails with :class:`AgentError`.
- **Trainer death**: the agent notices (stdin EOF, parent pid change), commits what was staged,
  then keeps the segments ``orphan_linger_s`` for a restarted trainer; the new engine asks it to
  hand over (the control block's takeover field), so ``restore()`` reads memory, not storage.
  If nobody comes, the agent unlinks the segments and exits: no /dev/shm leak after a SIGKILL.
- **Restore**: the newest step found in a complete slot whose checksum verifies, or in the chain;
  a torn slot (trainer died mid-copy) is skipped. With several ranks (a torch.distributed group,
  gloo is enough) the ranks all-gather their available steps and resume from the newest step that
  every rank has (the paper's Fig. 4); newer slots are discarded and newer committed steps are
  truncated from that rank's chain, so training continues from the agreed step. With a world size
  above 1 each rank writes its own chain at ``<url>/rank-<rank:05d>``.
- **Base weights** (``base=``, basestate.py: keyframes coded against a fine-tuning run's start): the
  trainer writes them once into a safetensors file in a private temporary folder, which the agent
  (each life) reads and checks against their digest; ``close()`` removes it.
- **Exit paths**: ``close()`` (and an atexit hook, which covers exceptions) flushes, stops the agent
  and unlinks every segment; after a SIGKILL the orphaned agent does it once its work is committed.
- **Memory**: ``memory_budget_bytes`` caps the engine's shared memory; when R slots do not fit, fewer
  are used (with a warning); when one does not fit, save raises ConfigError. Without a budget the
  free space of /dev/shm is checked before a slot is created (allocated and pre-faulted at once:
  the first R saves pay for it, later ones reuse the pages).
- **What training waits for**: flatten (pointers only), one memmove per CPU tensor into the slot (or
  a device-to-host copy into the page-locked slot on CUDA), the header and the marker. The
  command to the agent leaves from a thread. The agent runs at ``agent_nice`` (10) with
  ``agent_threads`` torch threads, both set before it imports anything: compression takes the idle
  time instead of slowing the steps, and a save waits (BackpressureWarning) only when the agent is
  ``redundancy`` saves behind. A trainer computing on the CPU must leave the agent its cores (an
  OpenMP pool that loses a core stalls at every barrier): ``Compressor`` warns
  (OversubscriptionWarning) when its torch threads and the agent's exceed the cores.
- **Failures in the agent** are re-raised by ``handle.wait()``, ``handle.committed.wait()`` and
  ``engine.wait()`` as :class:`AgentError` carrying the agent's traceback (``.agent_traceback``,
  ``.exc_type``, ``.errno``, ``.step``). A failed step is not retried in this life; it stays
  restorable from shared memory until its slot is reused, the chain keeps every committed step,
  and the next save is encoded against the last committed one. A restarted trainer retries
  uncommitted slots newer than the chain.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
import weakref

import torch

from ..chain import CheckpointChain, KeyframePolicy, RetentionPolicy
from ..errors import ConfigError, StepNotFoundError, StepOrderError
from ..format import DEFAULT_CHECKSUM
from ..methods.base import EncodeContext, Method, searches
from ..state import FlatState, flatten_state, unflatten_state
from . import staging
from .distributed import all_gather, newest_common_step, rank_world, use_distributed
from .handle import SaveHandle
from .options import BackpressureWarning, EngineOptions
from .ownership import take_ownership
from .slots import Slot, SlotPool, slots_for_budget
from .supervisor import Supervisor

# the names below were defined here before the engine was split by job; they stay importable from here
__all__ = ["AsyncCheckpointEngine", "EngineOptions", "SaveHandle", "BackpressureWarning", "newest_common_step",
           "slots_for_budget"]

_LIVE: "weakref.WeakSet[AsyncCheckpointEngine]" = weakref.WeakSet()
_ACTIVE: set[tuple[str, int]] = set()
_ACTIVE_LOCK = threading.Lock()


class AsyncCheckpointEngine:
    """Asynchronous saves into a :class:`CheckpointChain` through shared memory and an agent process."""

    def __init__(self, url, method: str | Method = "lossless", config=None, *, options: EngineOptions | None = None,
                 keyframe: KeyframePolicy | None = None, retention: RetentionPolicy | None = None,
                 storage_options: dict | None = None, takeover: bool = False, checksum: str = DEFAULT_CHECKSUM,
                 base=None):
        options = options if options is not None else EngineOptions()
        if not isinstance(options, EngineOptions):
            raise ConfigError(f"options must be an EngineOptions, got {type(options).__name__}")
        self.options = options
        where = str(url)
        if where.startswith("memory://"):
            raise ConfigError("memory:// storage lives inside one process and the agent is another; "
                              "use a local path or an object store with async saves")
        if "://" not in where and "::" not in where:
            where = os.path.abspath(where)  # the agent may be restarted after the trainer changed folder
        self.rank, self.world = rank_world(options)
        per_rank = self.world > 1 or options.rank is not None
        self.url = f"{where.rstrip('/')}/rank-{self.rank:05d}" if per_rank else where
        self.chain = CheckpointChain(self.url, method, config, keyframe=keyframe, retention=retention,
                                     storage_options=storage_options, takeover=takeover,
                                     checksum=checksum, base=base)  # the trainer only reads it; the agent writes
        self.key = staging.chain_key(self.url, storage_options)
        spec = self._agent_spec(method, config, keyframe, retention, storage_options, takeover, checksum)
        self._base_dir = None

        with _ACTIVE_LOCK:
            if (self.key, self.rank) in _ACTIVE:
                raise ConfigError(f"an AsyncCheckpointEngine for {self.url} (rank {self.rank}) is already open in "
                                  "this process; close it first (one writer per chain)")
            _ACTIVE.add((self.key, self.rank))
        try:
            self._ctl = staging.Control(self.key, self.rank)
            try:
                take_ownership(self._ctl, self.url, self.rank, options.takeover_timeout_s)
                self.chain.check_writer()  # the chain's own fence: a live writer elsewhere owns it
                self.chain.release()  # a claim of this process (a synchronous writer here) passes to the agent
                self._pid = os.getpid()  # a forked child (DataLoader worker) must not close the parent's engine
                self._cond = threading.Condition(threading.RLock())
                self._pool = SlotPool(self.key, self.rank, self._ctl, options, self._cond)
                self._base_dir = _stage_base(self.chain.base, spec)
                self._agents = Supervisor(spec, options, self._cond, self._pool)
                self._seq = 0
                self._last_step = -1
                self._scanned = self._resumed = self._closed = False
                self._warned: set[str] = set()
                self.recovered: list[SaveHandle] = []   # commits of slots a previous trainer left staged
                self.last_restore: tuple[int, str] | None = None  # (step, "memory" | "storage")
                with self._cond:
                    self._agents.start()  # early: its start-up (importing torch) overlaps the trainer's
            except BaseException:
                self._ctl.close()
                raise
        except BaseException:
            with _ACTIVE_LOCK:
                _ACTIVE.discard((self.key, self.rank))
            _unstage_base(self._base_dir)
            raise
        _LIVE.add(self)

    def _agent_spec(self, method, config, keyframe, retention, storage_options, takeover, checksum) -> dict:
        if isinstance(method, Method):
            name, cfg = method.descriptor, method.config_dict()
        else:
            name = str(method)
            cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
        spec = {"url": self.url, "method": name, "config": cfg,
                "keyframe": dataclasses.asdict(keyframe) if keyframe else None,
                "retention": dataclasses.asdict(retention) if retention else None,
                "storage_options": storage_options, "takeover": takeover, "checksum": checksum,
                "key": self.key, "rank": self.rank,
                "trainer_pid": os.getpid(), "options": dataclasses.asdict(self.options),
                "sys_path": [p for p in sys.path if p and os.path.isdir(p)]}
        try:
            json.dumps(spec)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"async saves send the method config and storage_options to the agent as JSON: {e}; "
                              "use plain values") from None
        return spec

    @property
    def agent_pid(self) -> int | None:
        """Process id of the current agent (None between lives)."""
        a = self._agents.agent
        return a.pid if a is not None else None

    @property
    def _slots(self) -> dict[int, Slot]:
        return self._pool.slots

    def segment_names(self) -> list[str]:
        """This engine's shared-memory names (control block and slots present in /dev/shm)."""
        return staging.list_segments(self.key)

    # --- what a previous trainer left ---------------------------------------------------------
    def _scan(self) -> None:
        """Map the slots a previous trainer left (once); they are what restore() reads first."""
        if self._scanned:
            return
        self._scanned = True
        self._seq = max(self._seq, self._pool.scan())
        mem = [s.step for s in self._slots.values() if s.step >= 0]
        steps = self.chain.steps()
        self._last_step = max([self._last_step, *mem, *(steps[-1:] or [])])

    def _resume(self, up_to: int | None) -> None:
        """Hand the agent the staged slots a previous trainer left uncommitted (once)."""
        if self._resumed:
            return
        self._resumed = True
        steps = self.chain.steps()
        latest = steps[-1] if steps else -1
        pending = []
        for i, s in self._slots.items():
            if s.step <= latest or (up_to is not None and s.step > up_to):
                continue
            if staging.read_header(s.seg).state != staging.COMMITTED:
                pending.append((s.step, i))
        for step, i in sorted(pending):
            s = self._slots[i]
            h = SaveHandle(step, s.seq)
            h.staged.set()
            s.busy = s.seq
            self.recovered.append(h)
            self._agents.submit(s.seq, h, i)

    # --- save -------------------------------------------------------------------------------
    def save(self, state: dict | FlatState, step: int, *, model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, ctx: EncodeContext | None = None) -> SaveHandle:
        """Stage ``state`` in shared memory and queue its commit. Blocks only for the copy."""
        self._check_open()
        step = int(step)
        flat = state if isinstance(state, FlatState) else \
            flatten_state(state, model, optimizer, step_records=self.chain.method.step_records)
        ctx_json, aux = self._context(ctx)
        with self._cond:
            self._scan()
            self._resume(None)
            if step <= self._last_step:
                raise StepOrderError(f"step {step} is not after the latest staged or committed step {self._last_step}; "
                                 "save increasing steps (or start a new chain)")
            seq = self._seq
            self._seq += 1
            layout = staging.plan(flat, step=step, seq=seq, url=self.url, rank=self.rank, ctx=ctx_json, aux=aux)
            i = self._pool.acquire(layout.total, step, self._waiting)
            slot = self._slots[i]
            slot.busy, slot.step, slot.seq = seq, -1, -1  # torn until the marker is written
            try:
                staging.write_slot(slot.seg, layout, step=step, seq=seq, pin_cuda=self.options.pin_cuda,
                                   checksum=self.options.checksum_by == "trainer")
            except BaseException:
                slot.busy = None
                raise
            slot.step, slot.seq = step, seq
            h = SaveHandle(step, seq)
            h.staged.set()
            self._last_step = step
            self._agents.submit(seq, h, i)
        return h

    def _waiting(self) -> list[int]:
        """While a save waits for a free slot: the engine is open, an agent runs; the steps behind."""
        self._check_open()
        self._agents.ensure()
        return self._agents.pending_steps()

    def _context(self, ctx: EncodeContext | None) -> tuple[dict, dict[str, torch.Tensor]]:
        """The JSON-able part of an EncodeContext, and its tensor dicts (staged beside the state)."""
        if ctx is None:
            return {}, {}
        out, aux = {}, {}
        for f in dataclasses.fields(ctx):
            v = getattr(ctx, f.name)
            if f.name in ("step", "model"):
                continue
            if f.name == "eval_fn":
                searches_here = searches(self.chain.method) and not self.options.agent_eval
                if v is not None and searches_here and "eval_fn" not in self._warned:
                    self._warned.add("eval_fn")
                    warnings.warn("async saves cannot run eval_fn (the agent has no live model): "
                                  f"{self.chain.method.name} uses its fixed config; give the agent its own "
                                  "(EngineOptions.agent_eval) or save through Compressor(async_save=True, "
                                  "eval_fn=...), which searches on a thread", stacklevel=4)
                continue
            if v is None or isinstance(v, bool | int | float | str) or f.name == "search":
                out[f.name] = v  # ``search``: JSON (knobs chosen by the trainer's search thread)
            elif isinstance(v, dict) and all(isinstance(t, torch.Tensor) for t in v.values()):
                names = {str(k): f"{f.name}/{k}" for k in v}
                aux.update({names[str(k)]: t for k, t in v.items()})
                out[f.name] = {"__aux__": names}
            elif f.name not in self._warned:
                self._warned.add(f.name)
                warnings.warn(f"EncodeContext.{f.name} ({type(v).__name__}) cannot reach the agent; "
                              "async saves drop it", stacklevel=4)
        return out, aux

    # --- wait / restore ---------------------------------------------------------------------
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every staged save is settled; re-raise the first failure (AgentError)."""
        with self._cond:
            self._agents.settle(timeout_s)
            errs = self._agents.take_errors()
            if errs:
                if len(errs) > 1 and hasattr(errs[0], "add_note"):  # Python >= 3.11
                    errs[0].add_note(f"{len(errs) - 1} more async saves failed: steps "
                                     f"{[getattr(e, 'step', None) for e in errs[1:]]}")
                raise errs[0]

    def restore(self, step: int | None = None, *, group=None) -> tuple[dict, int] | None:
        """(state, step) of ``step`` (newest when None), from shared memory if a complete, verified copy
        is there, else from the chain; None when there is nothing.

        With a torch.distributed ``group`` (default: the world, when initialized with more than one
        rank) the ranks agree on the newest step every rank has; see the module docstring.
        """
        self._check_open()
        with self._cond:
            self._agents.settle()  # this life's saves first (their errors stay for wait())
            self._scan()
            mem = self._pool.in_memory()
            chain_steps = self.chain.steps()
            mine = sorted(set(mem) | set(chain_steps))
            distributed = use_distributed(group)
            if distributed:
                target = newest_common_step(all_gather(mine, group), step)
            elif step is not None:
                if step not in mine:
                    raise StepNotFoundError(f"step {step} is neither in shared memory nor in the chain at {self.url}; "
                                            f"available: {mine}")
                target = step
            else:
                target = mine[-1] if mine else None
            if target is None:
                self._resume(None)
                return None
            if distributed and target < mine[-1]:
                self._rollback(target, chain_steps)
            if target in mem:
                s = self._slots[mem[target]]
                flat, _, _ = staging.load_slot(s.seg, staging.read_header(s.seg), clone=True)
                source = "memory"
            else:
                flat = self.chain.restore(target).flat
                source = "storage"
            self._resume(target if distributed else None)
            self.last_restore = (target, source)
            return unflatten_state(flat.skeleton, flat.tensors), target

    def _rollback(self, target: int, chain_steps: list[int]) -> None:
        """Forget everything newer than ``target`` (other ranks lack it): slots, then chain steps."""
        self._pool.discard_newer(target)
        self._last_step = target
        if chain_steps and chain_steps[-1] > target:
            deadline = time.monotonic() + self.options.agent_start_timeout_s + self.options.takeover_timeout_s
            self._agents.truncate(self.url, target, deadline)

    # --- close ------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush every staged save, stop the agent, unlink the shared memory. Re-raises failures
        that no ``wait`` reported."""
        if self._closed or os.getpid() != self._pid:
            return
        err = None
        try:
            self.wait()
        except BaseException as e:
            err = e
        finally:
            self._agents.stop(timeout_s=30.0)
            self._pool.close()
            self._ctl.close()
            self._closed = True
            with _ACTIVE_LOCK:
                _ACTIVE.discard((self.key, self.rank))
            _LIVE.discard(self)
            self.chain.close()
            _unstage_base(self._base_dir)
        if err is not None:
            raise err

    def _check_open(self) -> None:
        if self._closed or self._agents.closing:
            raise RuntimeError("this AsyncCheckpointEngine is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _stage_base(base, spec: dict) -> str | None:
    """Base weights (basestate.py) for the agent: a safetensors file in a private temporary folder,
    named with its digest in ``spec`` (the agent checks it). Returns the folder, None without a base."""
    if base is None:
        return None
    folder = tempfile.mkdtemp(prefix="ckptzip-base-")
    try:
        path = os.path.join(folder, "base.safetensors")
        base.to_file(path)
    except BaseException:
        _unstage_base(folder)
        raise
    spec["base"] = {"file": path, "digest": base.digest}
    return folder


def _unstage_base(folder: str | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@atexit.register
def _close_all() -> None:
    """An exiting trainer (normal end or an exception) flushes and cleans up its engines."""
    for eng in list(_LIVE):
        try:
            eng.close()
        except BaseException as e:  # nothing else can report it at exit
            print(f"ckptzip: async engine for {eng.url}: {type(e).__name__}: {e}", file=sys.stderr)
