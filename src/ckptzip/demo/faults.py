"""Fault-tolerant training with compressed checkpoints (the paper's main experiment, section 9.1).

A workload runs once uncompressed (no failures) and once per method with N simulated failures
evenly spaced over the run. At each failure the process state is discarded -- model, optimizer,
scheduler and Compressor are rebuilt from scratch with different random weights -- and training
resumes only from the compressed chain (latest committed step; the steps after it are redone).
Data order depends only on the step, and the RNG state is restored from the checkpoint, so the
lossless method must reproduce the uncompressed run exactly.
"""
from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field


from ..api import Compressor
from ..engine.options import EngineOptions
from .workloads import Workload


@dataclass
class RunResult:
    workload: str
    method: str                      # "uncompressed" for the reference run
    final_metric: float
    metric_name: str
    higher_is_better: bool
    losses: list = field(default_factory=list)        # [step, loss] per executed step (redone ones too)
    failures: list = field(default_factory=list)      # steps at which a failure was injected
    restores: list = field(default_factory=list)      # step each failure resumed from
    checkpoints: list = field(default_factory=list)   # per checkpoint: {step, keyframe, ratio, weights_ratio, ...}
    raw_bytes: int = 0
    stored_bytes: int = 0
    weights_raw: int = 0
    weights_stored: int = 0
    train_s: float = 0.0
    ckpt_s: float = 0.0
    restore_s: float = 0.0
    drain_s: float = 0.0             # waiting for queued saves: in close() at each failure (an async agent's
                                     # start-up included), and at the end

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else math.nan

    @property
    def weights_ratio(self) -> float:
        return self.weights_raw / self.weights_stored if self.weights_stored else math.nan

    @property
    def overhead(self) -> float:
        return self.ckpt_s / self.train_s if self.train_s else math.nan

    @property
    def drain(self) -> float:
        """Waiting for queued saves over the training time. Without failures (one wait, at the end): what
        an async agent left undone when training stopped; with failures, each close also waits for the
        agent it started (~1.5 s of imports), which the demo's short runs cannot hide."""
        return self.drain_s / self.train_s if self.train_s else math.nan

    def slowdown(self, reference: "RunResult") -> float:
        """Training time per executed step, save blocking included, over the reference's, minus 1: what
        the checkpoints cost the loop, a slower training step (an agent competing for the CPU) included."""
        mine, ref = len(self.losses), len(reference.losses)
        if not (mine and ref and reference.train_s):
            return math.nan
        return ((self.train_s + self.ckpt_s) / mine) / (reference.train_s / ref) - 1

    def degradation(self, reference: "RunResult") -> float:
        """Relative end-to-end degradation vs the reference run (positive = worse)."""
        b, x = reference.final_metric, self.final_metric
        d = (b - x) if self.higher_is_better else (x - b)
        return d / abs(b) if b else math.nan

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ratio=self.ratio, weights_ratio=self.weights_ratio, overhead=self.overhead, drain=self.drain)
        return d


def failure_steps(wl: Workload, n: int) -> list[int]:
    """n failure points evenly spaced, each after at least one checkpoint and between checkpoints."""
    if n <= 0:
        return []
    out = []
    for i in range(n):
        s = wl.ckpt_every + round((wl.total_steps - wl.ckpt_every) * (i + 0.5) / n)
        if s % wl.ckpt_every == 0:
            s += max(1, wl.ckpt_every // 2)  # fail between checkpoints, so some work is lost and redone
        out.append(min(s, wl.total_steps - 1))
    return sorted(set(out))


def run(wl: Workload, method: str | None, *, failures: int = 10, threshold: float = 0.01, url: str | None = None,
        progress=None, method_config=None, seed: int = 0, async_save: bool = False,
        search_in_agent: bool = True, base: bool = True) -> RunResult:
    """Train ``wl`` once. method=None: the uncompressed reference (no checkpoints, no failures).
    ``async_save``: through the agent; a searching method searches in the agent when the workload
    names an ``agent_eval`` and ``search_in_agent``, else on a thread of this process.
    ``base``: give the chain the workload's base weights (``Workload.base``)."""
    own_dir = url is None and method is not None
    if own_dir:
        url = tempfile.mkdtemp(prefix=f"ckptzip-{wl.name}-{method}-")
    res = RunResult(wl.name, method or "uncompressed", math.nan, wl.metric_name, wl.higher_is_better)
    if method_config is None and method is not None:
        method_config = wl.method_configs.get(method)
    model, opt, sched = wl.build(seed)
    base_sd = wl.base() if base and wl.base is not None and method is not None else None

    def compressor(m, o, s):
        if method is None:
            return None
        th = wl.threshold if wl.threshold is not None else threshold
        # async: the agent builds the workload's model and eval_fn and searches itself, where it can
        options = EngineOptions(agent_eval=wl.agent_eval) if async_save and search_in_agent else None
        return Compressor(m, o, url, method, config=method_config, threshold=th, restores=failures,
                          eval_fn=wl.eval_fn, scheduler=s, save_every=wl.ckpt_every, async_save=async_save,
                          engine_options=options, base=base_sd)

    ck = compressor(model, opt, sched)
    fail_at = set(failure_steps(wl, failures)) if method is not None else set()
    step = 0
    try:
        while step < wl.total_steps:
            step += 1
            t0 = time.perf_counter()
            model.train()
            loss = wl.train_step(model, opt, sched, step)
            res.train_s += time.perf_counter() - t0
            res.losses.append([step, loss])
            if ck is not None and step % wl.ckpt_every == 0:
                t0 = time.perf_counter()
                ck.save(step)
                res.ckpt_s += time.perf_counter() - t0
            if progress is not None:
                progress(step, wl.total_steps)
            if step in fail_at:
                fail_at.discard(step)
                res.failures.append(step)
                t0 = time.perf_counter()
                ck.close()
                res.drain_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                del model, opt, sched, ck
                model, opt, sched = wl.build(seed + 1000 + len(res.failures))  # wrong weights on purpose
                ck = compressor(model, opt, sched)
                step = ck.restore() or 0
                res.restores.append(step)
                res.restore_s += time.perf_counter() - t0
        if ck is not None:
            t0 = time.perf_counter()
            ck.wait()
            res.drain_s += time.perf_counter() - t0
        model.eval()
        res.final_metric = float(wl.metric(model))
        if ck is not None:
            _chain_figures(ck, res)
    finally:
        if ck is not None:
            ck.close()
        if own_dir:
            shutil.rmtree(url, ignore_errors=True)
    return res


def _chain_figures(ck: Compressor, res: RunResult) -> None:
    for e in ck.chain.entries(refresh=True):
        w = e.bytes_by_role.get("weight", [0, 0])
        res.raw_bytes += e.raw_bytes
        res.stored_bytes += e.nbytes
        res.weights_raw += w[0]
        res.weights_stored += w[1]
        res.checkpoints.append({"step": e.step, "keyframe": e.keyframe, "bytes": e.nbytes, "ratio": e.ratio,
                                "weights_ratio": (w[0] / w[1]) if w[1] else None, "summary": e.summary})
    if any(k == "shared" for e in ck.chain.entries() for k in e.bytes_by_role):
        res.weights_stored = 0  # a method that packs records together has no weights-only size
