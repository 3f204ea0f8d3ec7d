"""Runtime knobs of the asynchronous engine (not written into checkpoints), and its warning."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from ..configcheck import OneOf, Range, check_fields
from ..errors import ConfigError


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
    # torch threads in the agent; None: half the cores (at least 1). An agent with as many threads as
    # the trainer stalls the trainer's intra-op pool (measured: GPT-2 demo training 7x slower on 2 cores)
    agent_threads: int | None = None
    agent_nice: int = 10                   # niceness added to the agent: training keeps the CPU it needs
    agent_log: str | None = None           # append the agent's stderr to this file (None: discard)
    checksum_by: str = "agent"             # who sums a staged slot: "agent" (before encoding, off the
                                           # blocking path) or "trainer" (inside save, ~1/3 more blocking)
    pin_cuda: bool = True                  # page-lock slots for direct device-to-host copies
    rank: int | None = None                # None: the torch.distributed rank if initialized, else 0
    # "module:function" (or "path/file.py:function") returning (model, eval_fn), as `ckptzip compress
    # --eval` takes: the agent builds them once and runs a searching method's config search itself,
    # so the trainer's process does none of it (no thread beside the training loop, no scratch model)
    agent_eval: str | None = None

    def __post_init__(self):
        if isinstance(self.agent_imports, str):
            raise ConfigError(f"EngineOptions.agent_imports must be a tuple of module names, e.g. ('mypkg.methods',), "
                              f"got {self.agent_imports!r}")
        if self.agent_eval is not None and (not isinstance(self.agent_eval, str) or ":" not in self.agent_eval):
            raise ConfigError(f"EngineOptions.agent_eval must be 'module:function' returning (model, eval_fn), "
                              f"e.g. 'mypkg.evals:make', got {self.agent_eval!r}")
        seconds = Range(ge=0)
        check_fields(self, redundancy=Range(ge=1), memory_budget_bytes=Range(gt=0), agent_start_timeout_s=seconds,
                     takeover_timeout_s=seconds, orphan_linger_s=seconds, max_agent_restarts=Range(ge=0),
                     agent_threads=Range(ge=1), checksum_by=OneOf(("agent", "trainer")), rank=Range(ge=0))

    @property
    def threads(self) -> int:
        """The agent's torch threads: ``agent_threads``, else half the cores (at least 1)."""
        return self.agent_threads or max(1, (os.cpu_count() or 2) // 2)


class BackpressureWarning(UserWarning):
    """A save waited for the agent: it is ``redundancy`` saves behind."""


class OversubscriptionWarning(UserWarning):
    """A trainer computing on the CPU leaves the agent no core of its own."""


def warn_if_oversubscribed(model, options: EngineOptions) -> None:
    """Warn when a CPU trainer's torch threads and the agent's exceed the cores: an OpenMP pool that
    loses a core to another process stalls at every barrier (demo steps 100x slower on 2 cores)."""
    import torch

    cores = os.cpu_count() or 1
    on_cpu = any(p.device.type == "cpu" for p in model.parameters())
    if on_cpu and torch.get_num_threads() + options.threads > cores:
        warnings.warn(OversubscriptionWarning(
            f"async saves: the trainer uses {torch.get_num_threads()} torch threads and the agent {options.threads} "
            f"on {cores} cores; call torch.set_num_threads({max(1, cores - options.threads)}) in the trainer "
            f"(or lower EngineOptions.agent_threads) so training keeps its speed"), stacklevel=3)
