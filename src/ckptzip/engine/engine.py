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

- **Slots** (staging.py): ``R`` (``redundancy``, default 2) shared-memory segments named from a hash
  of the chain URL and the rank, reused round robin; the newest R staged checkpoints stay in memory,
  each with a complete marker written last and a checksum (summed by the agent unless
  ``checksum_by="trainer"``). A slot is rewritten only after the agent
  has settled its commit (committed or failed), so the agent reads the slot in place: no second copy.
- **Agent** (agent.py): a ``python -m ckptzip.engine.agent`` subprocess in its own session, fed JSON
  lines. Only names, numbers, the skeleton JSON and record dicts cross. The EncodeContext crosses
  without ``model`` and ``eval_fn`` (a live module and a closure cannot): methods that search configs
  against ``eval_fn`` (dynaquant, qd, cnr, gobo with ``search=True``) run with their fixed config in
  async mode -- the same as a synchronous save without ``eval_fn``. Run the search synchronously (``async_save=False``)
  or choose the config in the trainer and pass it in. Tensor fields of the context (gradients for
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
- **Exit paths**: ``close()`` (and an atexit hook, which covers exceptions) flushes, stops the agent
  and unlinks every segment; after a SIGKILL the orphaned agent does it once its work is committed.
- **Memory**: ``memory_budget_bytes`` caps the engine's shared memory; when R slots do not fit, fewer
  are used (with a warning); when one does not fit, save raises ConfigError. Without a budget the
  free space of /dev/shm is checked before a slot is created (allocated and pre-faulted at once:
  the first R saves pay for it, later ones reuse the pages).
- **What training waits for**: flatten (pointers only), one memmove per CPU tensor into the slot (or
  a device-to-host copy into the page-locked slot on CUDA), the header and the marker. The
  command to the agent leaves from a thread. The agent runs at ``agent_nice`` (10): on a machine
  whose cores all train, compression takes the idle time instead of slowing the steps, and a save
  waits (BackpressureWarning) only when the agent is ``redundancy`` saves behind.
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
import queue
import subprocess
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..chain import CheckpointChain, Entry, KeyframePolicy, RetentionPolicy
from ..errors import AgentError, ConfigError, StepNotFoundError
from ..methods.base import EncodeContext, Method
from ..state import FlatState, flatten_state, unflatten_state
from . import staging

_MiB = 1 << 20


@dataclass(frozen=True)
class EngineOptions:
    """Runtime knobs of the asynchronous engine (not written into checkpoints)."""

    redundancy: int = 2                    # R: newest staged checkpoints kept in shared memory
    memory_budget_bytes: int | None = None  # cap on this engine's shared memory (None: R slots, checked
                                           # against the free space of /dev/shm)
    agent_start_timeout_s: float = 120.0   # a started agent that says nothing for this long is killed
    takeover_timeout_s: float = 600.0      # wait for a crashed trainer's agent to finish its current commit
    orphan_linger_s: float = 60.0          # an agent whose trainer died keeps the slots this long
    warn_on_backpressure: bool = True      # warnings.warn when a save waits for the agent
    max_agent_restarts: int = 3            # agent deaths while committing one step before it fails
    agent_imports: tuple[str, ...] = ()    # modules the agent imports first (custom methods, filesystems)
    agent_threads: int | None = None       # torch threads in the agent (None: torch's default)
    agent_nice: int = 10                   # niceness added to the agent: training keeps the CPU it needs
    agent_log: str | None = None           # append the agent's stderr to this file (None: discard)
    checksum_by: str = "agent"             # who sums a staged slot: "agent" (before encoding, off the
                                           # blocking path) or "trainer" (inside save, ~1/3 more blocking)
    pin_cuda: bool = True                  # page-lock slots for direct device-to-host copies
    rank: int | None = None                # None: the torch.distributed rank if initialized, else 0

    def __post_init__(self):
        if self.redundancy < 1:
            raise ConfigError(f"EngineOptions.redundancy must be >= 1, got {self.redundancy}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ConfigError(f"EngineOptions.memory_budget_bytes must be > 0 or None, got {self.memory_budget_bytes}")
        for f in ("agent_start_timeout_s", "takeover_timeout_s", "orphan_linger_s"):
            if getattr(self, f) < 0:
                raise ConfigError(f"EngineOptions.{f} must be >= 0, got {getattr(self, f)}")
        if self.max_agent_restarts < 0:
            raise ConfigError(f"EngineOptions.max_agent_restarts must be >= 0, got {self.max_agent_restarts}")
        if isinstance(self.agent_imports, str):
            raise ConfigError("EngineOptions.agent_imports is a tuple of module names, e.g. ('mypkg.methods',)")
        if self.checksum_by not in ("agent", "trainer"):
            raise ConfigError(f"EngineOptions.checksum_by must be 'agent' or 'trainer', got {self.checksum_by!r}")
        if self.rank is not None and self.rank < 0:
            raise ConfigError(f"EngineOptions.rank must be >= 0 or None, got {self.rank}")


class BackpressureWarning(UserWarning):
    """A save waited for the agent: it is ``redundancy`` saves behind."""


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


@dataclass
class _Slot:
    seg: staging.Segment
    step: int = -1            # step it holds (-1: nothing restorable: new, torn, discarded, corrupt)
    seq: int = -1
    busy: int | None = None   # seq of the unsettled commit reading it


class _AgentProc:
    """One life of the agent subprocess, with the thread that reads its events."""

    def __init__(self, engine: "AsyncCheckpointEngine", spec: dict):
        opts = engine.options
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self._log = open(opts.agent_log, "ab") if opts.agent_log else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptzip.engine.agent"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log or subprocess.DEVNULL, env=env, close_fds=True,
            start_new_session=True)  # its own session: signals to the trainer's group do not reach it
        self.ready = threading.Event()
        self.fatal: dict | None = None
        self.truncated: dict[int, dict] = {}
        # commands go out from a thread: writing to the pipe wakes the agent, and on a busy machine
        # the scheduler may then run it before the trainer (5 ms per save measured on 2 cores)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sender = threading.Thread(target=self._send_loop, daemon=True, name="ckptzip-agent-commands")
        self.sender.start()
        self.send(spec)
        self.reader = threading.Thread(target=engine._read_events, args=(self,), daemon=True,
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


_LIVE: "weakref.WeakSet[AsyncCheckpointEngine]" = weakref.WeakSet()
_ACTIVE: set[tuple[str, int]] = set()
_ACTIVE_LOCK = threading.Lock()


class AsyncCheckpointEngine:
    """Asynchronous saves into a :class:`CheckpointChain` through shared memory and an agent process."""

    def __init__(self, url, method: str | Method = "lossless", config=None, *, options: EngineOptions | None = None,
                 keyframe: KeyframePolicy | None = None, retention: RetentionPolicy | None = None,
                 storage_options: dict | None = None):
        options = options if options is not None else EngineOptions()
        if not isinstance(options, EngineOptions):
            raise ConfigError(f"options must be an EngineOptions, got {type(options).__name__}")
        self.options = options
        base = str(url)
        if base.startswith("memory://"):
            raise ConfigError("memory:// storage lives inside one process and the agent is another; "
                              "use a local path or an object store with async saves")
        if "://" not in base and "::" not in base:
            base = os.path.abspath(base)  # the agent may be restarted after the trainer changed folder
        self.rank, self.world = _rank_world(options)
        per_rank = self.world > 1 or options.rank is not None
        self.url = f"{base.rstrip('/')}/rank-{self.rank:05d}" if per_rank else base
        self.chain = CheckpointChain(self.url, method, config, keyframe=keyframe, retention=retention,
                                     storage_options=storage_options)  # the trainer only reads it
        self.key = staging.chain_key(self.url, storage_options)
        self._spec = self._agent_spec(method, config, keyframe, retention, storage_options)

        with _ACTIVE_LOCK:
            if (self.key, self.rank) in _ACTIVE:
                raise ConfigError(f"an AsyncCheckpointEngine for {self.url} (rank {self.rank}) is already open in "
                                  "this process; close it first (one writer per chain)")
            _ACTIVE.add((self.key, self.rank))
        try:
            self._ctl = staging.Control(self.key, self.rank)
            self._take_ownership()
        except BaseException:
            with _ACTIVE_LOCK:
                _ACTIVE.discard((self.key, self.rank))
            raise
        self._pid = os.getpid()  # a forked child (DataLoader worker) must not close the parent's engine
        self._cond = threading.Condition(threading.RLock())
        self._slots: dict[int, _Slot] = {}
        self._outstanding: dict[int, SaveHandle] = {}   # seq -> handle, in submission order
        self._slot_of: dict[int, int] = {}
        self._deaths: dict[int, int] = {}
        self._errors: list[AgentError] = []
        self._seq = 0
        self._last_step = -1
        self._scanned = self._resumed = False
        self._closing = self._closed = False
        self._warned: set[str] = set()
        self.recovered: list[SaveHandle] = []   # commits of slots a previous trainer left staged
        self.last_restore: tuple[int, str] | None = None  # (step, "memory" | "storage")
        self._agent: _AgentProc | None = None
        try:
            with self._cond:
                self._start_agent()  # early: its start-up (importing torch) overlaps the trainer's
        except BaseException:
            self._ctl.close()
            with _ACTIVE_LOCK:
                _ACTIVE.discard((self.key, self.rank))
            raise
        _LIVE.add(self)

    # --- ownership --------------------------------------------------------------------------
    def _take_ownership(self) -> None:
        ctl = self._ctl
        while True:
            if not ctl.try_lock(staging.TRAINER_BYTE):
                pid = ctl.trainer_pid
                ctl.close()
                raise ConfigError(f"{self.url} (rank {self.rank}) is being saved asynchronously by process {pid}; "
                                  "one writer per chain and rank")
            if ctl.reopen_if_unlinked():
                continue  # we locked a removed name; lock the current one
            if ctl.held_elsewhere(staging.AGENT_BYTE):
                # the agent of a trainer that died: it finishes its current commit, then hands over
                ctl.takeover_pid = os.getpid()
                deadline = time.monotonic() + self.options.takeover_timeout_s
                while ctl.held_elsewhere(staging.AGENT_BYTE):
                    if time.monotonic() > deadline:
                        pid = ctl.agent_pid
                        ctl.close()
                        raise AgentError(f"the agent (pid {pid}) of a previous trainer of {self.url} did not hand "
                                         f"over within {self.options.takeover_timeout_s} s; kill it or wait")
                    time.sleep(0.02)
                if ctl.reopen_if_unlinked():
                    continue  # it cleaned up just before we asked: start afresh
            break
        ctl.takeover_pid = 0
        ctl.trainer_pid = os.getpid()

    def _agent_spec(self, method, config, keyframe, retention, storage_options) -> dict:
        if isinstance(method, Method):
            name, cfg = method.descriptor, method.config_dict()
        else:
            name = str(method)
            cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
        spec = {"url": self.url, "method": name, "config": cfg,
                "keyframe": dataclasses.asdict(keyframe) if keyframe else None,
                "retention": dataclasses.asdict(retention) if retention else None,
                "storage_options": storage_options, "key": self.key, "rank": self.rank,
                "trainer_pid": os.getpid(), "options": dataclasses.asdict(self.options),
                "sys_path": [p for p in sys.path if p and os.path.isdir(p)]}
        try:
            json.dumps(spec)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"async saves send the method config and storage_options to the agent as JSON: {e}; "
                              "use plain values") from None
        return spec

    # --- agent ------------------------------------------------------------------------------
    def _start_agent(self) -> None:
        self._agent = _AgentProc(self, self._spec)

    @property
    def agent_pid(self) -> int | None:
        """Process id of the current agent (None between lives)."""
        a = self._agent
        return a.pid if a is not None else None

    def _read_events(self, agent: _AgentProc) -> None:
        for line in agent.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                self._on_event(agent, ev)
                self._cond.notify_all()
        rc = agent.proc.wait()
        with self._cond:
            self._on_agent_exit(agent, rc)
            self._cond.notify_all()

    def _on_event(self, agent: _AgentProc, ev: dict) -> None:
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
            h = self._outstanding.pop(seq, None)
            self._release(seq)
            if h is None:
                return
            if kind == "committed":
                h.entry = Entry(**ev["entry"])
                h.committed.set()
            else:
                err = AgentError(f"async save of step {h.step} failed in the agent: {ev['error']}\n\n"
                                 f"agent traceback:\n{ev.get('traceback', '')}")
                err.step, err.exc_type, err.errno = h.step, ev.get("exc_type"), ev.get("errno")
                err.agent_traceback = ev.get("traceback", "")
                self._settle_error(h, err)

    def _settle_error(self, h: SaveHandle, err: AgentError) -> None:
        h.committed.set(err)
        self._errors.append(err)

    def _on_agent_exit(self, agent: _AgentProc, rc: int) -> None:
        agent.timer.cancel()
        if agent is not self._agent:
            return
        self._agent = None
        if self._closing:
            return
        if agent.fatal is not None:  # it could not start: every pending save fails with the reason
            f = agent.fatal
            for seq in list(self._outstanding):
                h = self._outstanding.pop(seq)
                self._release(seq)
                err = AgentError(f"the agent could not start: {f['error']}\n\nagent traceback:\n{f['traceback']}")
                err.step, err.exc_type, err.errno, err.agent_traceback = h.step, f.get("exc_type"), None, f["traceback"]
                self._settle_error(h, err)
            return
        if self._outstanding:
            seq = next(iter(self._outstanding))
            self._deaths[seq] = self._deaths.get(seq, 0) + 1
            if self._deaths[seq] > self.options.max_agent_restarts:
                h = self._outstanding.pop(seq)
                i = self._release(seq)
                if i is not None:
                    staging.set_state(self._slots[i].seg, staging.FAILED)
                err = AgentError(f"the agent died (exit code {rc}) {self._deaths[seq]} times while committing step "
                                 f"{h.step}; the step stays in shared memory but is not committed")
                err.step, err.exc_type, err.errno, err.agent_traceback = h.step, None, None, ""
                self._settle_error(h, err)
        if self._outstanding:
            self._start_agent()
            for seq in self._outstanding:  # the new agent commits them again; steps already in the chain
                self._send_commit(seq)     # are reported committed without re-encoding

    def _release(self, seq: int) -> int | None:
        i = self._slot_of.pop(seq, None)
        if i is not None and i in self._slots and self._slots[i].busy == seq:
            self._slots[i].busy = None
        return i

    def _ensure_agent(self) -> None:
        """Start an agent if there is none; a new one gets every unsettled commit."""
        if self._agent is None:
            self._start_agent()
            for seq in self._outstanding:
                self._send_commit(seq)

    def _submit(self, seq: int) -> None:
        if self._agent is None:
            self._ensure_agent()  # sends seq with the others
        else:
            self._send_commit(seq)

    def _send_commit(self, seq: int) -> None:
        self._agent.send({"op": "commit", "slot": self._slot_of[seq], "seq": seq,
                          "step": self._outstanding[seq].step})

    # --- slots ------------------------------------------------------------------------------
    def segment_names(self) -> list[str]:
        """This engine's shared-memory names (control block and slots present in /dev/shm)."""
        return staging.list_segments(self.key)

    def _scan(self) -> None:
        """Map the slots a previous trainer left (once); they are what restore() reads first."""
        if self._scanned:
            return
        self._scanned = True
        top = 0
        for i in range(max(self._ctl.n_slots, self.options.redundancy)):
            try:
                seg = staging.Segment(staging.slot_name(self.key, self.rank, i), populate=True)
            except FileNotFoundError:
                continue
            info = staging.read_header(seg)
            ok = info.usable and staging.verify_slot(seg, info)
            self._slots[i] = _Slot(seg, info.step if ok else -1, info.seq if ok else -1)
            self._seq = max(self._seq, info.seq + 1)
            top = i + 1
        self._ctl.n_slots = max(self._ctl.n_slots, top)
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
            self._outstanding[s.seq], self._slot_of[s.seq] = h, i
            self.recovered.append(h)
            self._submit(s.seq)

    def _slot_count(self, cap: int) -> int:
        r, budget = self.options.redundancy, self.options.memory_budget_bytes
        n = slots_for_budget(cap, r, budget)
        if n < r and "budget" not in self._warned:
            self._warned.add("budget")
            warnings.warn(f"memory_budget_bytes={budget} holds {n} of the {r} redundant in-memory checkpoints "
                          f"({cap} bytes each); raise it to keep {r}", stacklevel=4)
        return n

    def _acquire_slot(self, total: int, step: int) -> int:
        cap = -(-total // _MiB) * _MiB
        n = self._slot_count(cap)
        for i in [i for i in self._slots if i >= n and self._slots[i].busy is None]:
            self._drop_slot(i)  # a budget that now fits fewer slots: free the extra ones
        warned = False
        while True:
            self._check_open()
            free = [i for i in range(n) if i not in self._slots or self._slots[i].busy is None]
            if free:
                i = min(free, key=lambda j: (0, 0) if j not in self._slots else (1, self._slots[j].step))
                self._ensure_capacity(i, total, cap)
                return i
            if not warned and self.options.warn_on_backpressure:
                warned = True
                behind = [h.step for h in self._outstanding.values()]
                warnings.warn(BackpressureWarning(
                    f"async save of step {step} waits for the agent, which is still committing steps {behind}; "
                    "save less often, raise EngineOptions.redundancy (memory), or use a faster method"),
                    stacklevel=3)
            if self._agent is None:
                self._ensure_agent()
            self._cond.wait(0.05)

    def _ensure_capacity(self, i: int, total: int, cap: int) -> None:
        s = self._slots.get(i)
        if s is not None and s.seg.size >= total and not s.seg.stale():
            return
        grow = cap - (s.seg.size if s is not None else 0)
        free = staging.shm_free_bytes()
        if free is not None and grow > free:
            raise ConfigError(f"shared memory ({staging.SHM_DIR}) has {free} bytes free, an async save needs {grow} "
                              "more; lower EngineOptions.redundancy, enlarge /dev/shm (docker: --shm-size) "
                              "or use async_save=False")
        if s is not None:
            s.seg.close()
        seg = staging.Segment(staging.slot_name(self.key, self.rank, i), size=cap, create=True, populate=True)
        self._slots[i] = _Slot(seg)
        self._ctl.n_slots = max(self._ctl.n_slots, i + 1)

    def _drop_slot(self, i: int) -> None:
        s = self._slots.pop(i)
        s.seg.close()
        staging.unlink(s.seg.name)

    # --- save -------------------------------------------------------------------------------
    def save(self, state: dict | FlatState, step: int, *, model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, ctx: EncodeContext | None = None) -> SaveHandle:
        """Stage ``state`` in shared memory and queue its commit. Blocks only for the copy."""
        self._check_open()
        step = int(step)
        flat = state if isinstance(state, FlatState) else flatten_state(state, model, optimizer)
        ctx_json, aux = self._context(ctx)
        with self._cond:
            self._scan()
            self._resume(None)
            if step <= self._last_step:
                raise ValueError(f"step {step} is not after the latest staged or committed step {self._last_step}; "
                                 "save increasing steps (or start a new chain)")
            seq = self._seq
            self._seq += 1
            layout = staging.plan(flat, step=step, seq=seq, url=self.url, rank=self.rank, ctx=ctx_json, aux=aux)
            i = self._acquire_slot(layout.total, step)
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
            self._outstanding[seq], self._slot_of[seq] = h, i
            self._submit(seq)
        return h

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
                cfg = getattr(self.chain.method, "config", None)
                if v is not None and getattr(cfg, "search", False) and "eval_fn" not in self._warned:
                    self._warned.add("eval_fn")
                    warnings.warn("async saves cannot run eval_fn (the agent has no live model): "
                                  f"{self.chain.method.name} uses its fixed config; use async_save=False "
                                  "for the per-checkpoint config search", stacklevel=4)
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
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._outstanding:
                if self._agent is None and not self._closing:
                    self._ensure_agent()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{len(self._outstanding)} async saves not committed within {timeout_s} s")
                self._cond.wait(0.05)
            if self._errors:
                errs, self._errors = self._errors, []
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
            while self._outstanding:  # settle this life's saves first (their errors stay for wait())
                if self._agent is None:
                    self._ensure_agent()
                self._cond.wait(0.05)
            self._scan()
            for s in self._slots.values():  # re-check: a slot may have been damaged since it was written
                if s.step >= 0 and s.busy is None and not staging.verify_slot(s.seg, staging.read_header(s.seg)):
                    s.step = -1
            mem = {s.step: i for i, s in self._slots.items() if s.step >= 0}  # complete and verified
            chain_steps = self.chain.steps()
            mine = sorted(set(mem) | set(chain_steps))
            distributed = _use_distributed(group)
            if distributed:
                target = newest_common_step(_all_gather(mine, group), step)
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
        for s in self._slots.values():
            if s.step > target and s.busy is None:
                staging.set_discarded(s.seg)
                s.step = -1
        self._last_step = target
        if not chain_steps or chain_steps[-1] <= target:
            return
        deadline = time.monotonic() + self.options.agent_start_timeout_s + self.options.takeover_timeout_s
        sent_to = None
        while True:
            self._ensure_agent()
            a = self._agent
            if a is not sent_to:
                a.send({"op": "truncate", "step": target})
                sent_to = a
            ev = a.truncated.get(target)
            if ev is not None:
                if ev.get("error"):
                    raise AgentError(f"rolling {self.url} back to step {target} failed in the agent: {ev['error']}\n\n"
                                     f"agent traceback:\n{ev.get('traceback', '')}")
                return
            if time.monotonic() > deadline:
                raise AgentError(f"the agent did not roll {self.url} back to step {target} in time")
            self._cond.wait(0.05)

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
            with self._cond:
                self._closing = True
                agent, self._agent = self._agent, None
            if agent is not None:
                agent.stop(timeout_s=30.0)
            for s in self._slots.values():
                s.seg.close()
            staging.unlink_chain(self.key, self.rank, max(self._ctl.n_slots, self.options.redundancy))
            self._ctl.close()
            self._closed = True
            with _ACTIVE_LOCK:
                _ACTIVE.discard((self.key, self.rank))
            _LIVE.discard(self)
            self.chain.close()
        if err is not None:
            raise err

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise RuntimeError("this AsyncCheckpointEngine is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def slots_for_budget(slot_bytes: int, redundancy: int, budget_bytes: int | None) -> int:
    """How many slots of ``slot_bytes`` to keep: ``redundancy``, fewer if the budget holds fewer."""
    if budget_bytes is None:
        return redundancy
    n = budget_bytes // slot_bytes
    if n < 1:
        raise ConfigError(f"a staged checkpoint needs {slot_bytes} bytes of shared memory, over "
                          f"memory_budget_bytes={budget_bytes}; raise the budget or use async_save=False")
    return min(n, redundancy)


# --- distributed ---------------------------------------------------------------------------

def newest_common_step(per_rank: list[list[int]], step: int | None = None) -> int | None:
    """The step to resume from: ``step`` if every rank has it, else the newest step all ranks have.

    Fig. 4 of BitSnap: ranks hold {60, 80, 100} except rank 1, whose copy of 100 is torn: {60, 80}
    -> 80. None when no rank has anything; StepNotFoundError when ranks have steps but none in common.
    """
    sets = [set(s) for s in per_rank]
    if not any(sets):
        return None
    common = set.intersection(*sets)
    if step is not None:
        if step not in common:
            raise StepNotFoundError(f"step {step} is not available on every rank; per rank: {per_rank}")
        return step
    if not common:
        raise StepNotFoundError(f"no checkpoint step is available on every rank; per rank: {per_rank}")
    return max(common)


def _rank_world(options: EngineOptions) -> tuple[int, int]:
    init = False
    try:
        import torch.distributed as dist

        init = dist.is_available() and dist.is_initialized()
    except ImportError:
        pass
    world = dist.get_world_size() if init else 1
    rank = options.rank if options.rank is not None else (dist.get_rank() if init else 0)
    return rank, world


def _use_distributed(group) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ConfigError("restore(group=...) needs torch.distributed to be initialized")
        return False
    return group is not None or dist.get_world_size() > 1


def _all_gather(steps: list[int], group) -> list[list[int]]:
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, list(steps), group=group)
    return out


@atexit.register
def _close_all() -> None:
    """An exiting trainer (normal end or an exception) flushes and cleans up its engines."""
    for eng in list(_LIVE):
        try:
            eng.close()
        except BaseException as e:  # nothing else can report it at exit
            print(f"ckptzip: async engine for {eng.url}: {type(e).__name__}: {e}", file=sys.stderr)
