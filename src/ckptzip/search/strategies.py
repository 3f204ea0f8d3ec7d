"""DynaQuant's config search: guided exhaustive search, then delta-neighbourhood search.

Per checkpoint (Inshrinkerator section 5), with a user ``eval_fn`` and ``threshold``:

- **exhaustive** (first checkpoint): for each prune metric, ``cube.guided_search`` over the
  config cube finds the feasible frontier; of all feasible configs it evaluated, the one with
  the highest *estimated* compression ratio wins. Sensitivity without gradient EMAs is the same
  as magnitude, so it is skipped when ``ctx.gradients`` is None.
- **neighbourhood** (steady state): first the previous best with both metrics; switch metric
  when the other one's degradation is lower by more than ``METRIC_SWITCH_MARGIN`` x threshold.
  Then the points within ``search_neighbourhood`` cube steps of the previous best (minus the
  more aggressive ones under ``search_policy="monotone"``), ordered by estimated ratio, are
  evaluated until the first feasible one.
- **fallback**: nothing in the neighbourhood is feasible -> the exhaustive search again. If no
  config at all passes, the least aggressive one (the cube's top corner, best metric) is chosen
  and the info says ``infeasible: True``.

Embedding bins are the cube's 4th axis (present only when the state has embedding weights):
searching it costs a few evaluations more than fixing it, and it lets the search trade
embedding precision against the other knobs like any other axis.

Ratio estimate (for ordering and for picking among feasible configs): per quantized weight, the
order-0 entropy of its codes (keyframe) or the conditional entropy H(delta | previous code) of
its cyclic delta against the reference codes, which is what the rearranged delta encoder
exploits (its groups are the previous code's buckets), plus 16 bits per protected value and 32
per codebook entry. bench/search.py measures its rank correlation with the real encoded sizes.

Call order (methods/dynaquant.py ``_choose``)::

    qcfg, info, search_state = search_config(method, state, reference, ctx, search_state)
    # qcfg: DynaQuantConfig for this checkpoint; info -> manifest summary; search_state: keep for
    # the next call (None on the first)

Parallel trials: pass ``group`` (or set ``ctx.process_group``): m data-parallel ranks evaluate m
candidates per round and agree through one all_gather (dist.py); every rank must call
``search_config`` with the same state. The chosen config is the sequential one (see cube.py).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from .. import dist
from ..codec.entropy import entropy_bits
from ..quant import dynaquant as dq
from ..tensorbytes import torch_dtype
from .cube import Candidate, ConfigCube, MonotoneOracle, SearchSpace, guided_search, speculate
from .quality import QualityJudge

# "clearly better": the other prune metric must free more than this share of the quality budget.
# Each switch re-prunes different weights, so every code moves against the reference (bench/search.py:
# a switch on a quality difference of 0.1x the threshold, i.e. noise, cost ~10 % of that checkpoint's
# ratio, and the switch back the same again).
METRIC_SWITCH_MARGIN = 0.25


@dataclass(frozen=True)
class Trial:
    """One evaluated candidate."""

    candidate: Candidate
    feasible: bool
    degradation: float
    score: float
    est_bits: float    # estimated encoded size of the quantized weights
    raw_bits: float    # their uncompressed size

    @property
    def est_ratio(self) -> float:
        return self.raw_bits / self.est_bits if self.est_bits > 0 else math.inf


def estimate_bits(quantized: dict, reference=None) -> tuple[float, float]:
    """(estimated encoded bits, raw bits) of quantized weights (name -> QuantizedTensor), coded
    against ``reference.data[name] = (codes, n_levels)`` where the reference has them."""
    ref = reference.data if reference is not None else {}
    est = raw = 0.0
    for name, q in quantized.items():
        codes = q.codes.reshape(-1)
        n = codes.numel()
        raw += n * torch_dtype(q.dtype).itemsize * 8
        p = ref.get(name)
        if p is not None and p[0].numel() == n:
            B = max(int(q.n_levels), int(p[1]))
            prev = p[0].reshape(-1).to(codes.device, torch.int64)
            delta = torch.remainder(codes.long() - prev, B)
            est += entropy_bits(prev * B + delta) - entropy_bits(prev)  # H(delta | prev code)
        else:
            est += entropy_bits(codes)
        est += 16.0 * q.side["protected"].numel() + 32.0 * q.n_levels
    return est, raw


class TrialRunner:
    """Evaluates candidates (quantize -> estimate -> dequantize -> eval), caches the results, and
    spreads rounds of candidates over a process group when one is given."""

    def __init__(self, state, reference, ctx, base: dq.DynaQuantConfig, *, group=None):
        from ..methods.dynaquant import quantize_weights  # the method module imports this one lazily

        self._quantize_weights = quantize_weights
        self.state, self.reference, self.base = state, reference, base
        self.gradients = ctx.gradients
        self.group = group
        self.rank, self.size = dist.world(group)
        self.judge = QualityJudge(ctx.model, ctx.eval_fn, state, threshold=ctx.threshold,
                                  higher_is_better=ctx.higher_is_better)
        # every rank judges against rank 0's baseline, so all ranks take identical decisions
        self.judge.baseline = dist.broadcast_floats([self.judge.baseline], group)[0]
        self._trials: dict[Candidate, Trial] = {}
        self._estimates: dict[Candidate, tuple[float, float]] = {}
        self.evals = 0          # trials run, all ranks together
        self.local_evals = 0    # trials run by this rank
        self.rounds = 0         # evaluation rounds (a sequential run: one trial each)
        self.n_estimates = 0    # quantize-and-estimate-only runs, all ranks together

    # --- one candidate, on this rank --------------------------------------------------------
    def config(self, c: Candidate) -> dq.DynaQuantConfig:
        return replace(self.base, **c.knobs())

    def _quantize(self, c: Candidate) -> dict:
        return self._quantize_weights(self.state, self.config(c), self.gradients)

    def _estimate_row(self, c: Candidate) -> list[float]:
        return list(estimate_bits(self._quantize(c), self.reference))

    def _trial_row(self, c: Candidate) -> list[float]:
        q = self._quantize(c)
        est, raw = estimate_bits(q, self.reference)
        v = self.judge.check({n: dq.dequantize(qt) for n, qt in q.items()})
        self.local_evals += 1
        return [float(v.feasible), v.degradation, v.score, est, raw]

    # --- rounds ------------------------------------------------------------------------------
    def cached(self, c: Candidate) -> Trial | None:
        return self._trials.get(c)

    def evaluate(self, cands: list[Candidate]) -> None:
        """Run every not yet evaluated candidate, ``size`` per round, in order."""
        todo = list(dict.fromkeys(c for c in cands if c not in self._trials))
        for i in range(0, len(todo), self.size):
            chunk = todo[i:i + self.size]
            rows = dist.gather_round(chunk, self._trial_row, width=5, group=self.group)
            for c, (f, d, s, e, r) in zip(chunk, rows):
                self._trials[c] = Trial(c, f > 0.5, d, s, e, r)
                self._estimates[c] = (e, r)
            self.evals += len(chunk)
            self.rounds += 1 if self.size > 1 else len(chunk)

    def trial(self, c: Candidate) -> Trial:
        if c not in self._trials:
            self.evaluate([c])
        return self._trials[c]

    def estimates(self, cands: list[Candidate]) -> dict[Candidate, tuple[float, float]]:
        """(est_bits, raw_bits) of each candidate (quantize only, ``size`` per round)."""
        todo = list(dict.fromkeys(c for c in cands if c not in self._estimates))
        for i in range(0, len(todo), self.size):
            chunk = todo[i:i + self.size]
            rows = dist.gather_round(chunk, self._estimate_row, width=2, group=self.group)
            for c, (e, r) in zip(chunk, rows):
                self._estimates[c] = (e, r)
            self.n_estimates += len(chunk)
        return {c: self._estimates[c] for c in cands}

    def first_feasible(self, cands: list[Candidate]) -> Trial | None:
        """The first feasible candidate in order; rounds of ``size``, exiting early."""
        i = 0
        while i < len(cands):
            t = self._trials.get(cands[i])
            if t is None:
                self.evaluate([c for c in cands[i:] if c not in self._trials][:self.size])
                continue
            if t.feasible:
                return t
            i += 1
        return None

    def close(self) -> None:
        self.judge.close()


def _metrics(space: SearchSpace, gradients) -> list[str]:
    # without gradient EMAs, sensitivity falls back to magnitude: the same configs twice
    if not gradients:
        return ["magnitude"]
    return list(space.prune_metrics)


def _frontier(cube: ConfigCube, metrics: list[str], answer) -> list[Candidate]:
    """The sequential exhaustive search as a pure function of the feasibility answers: the
    feasible candidates it evaluated, per metric in order."""
    out: list[Candidate] = []
    for m in metrics:
        oracle = MonotoneOracle(lambda p, m=m: answer(cube.candidate(p, m)))
        guided_search(cube.bottom, cube.top, oracle)
        out += [cube.candidate(p, m) for p in oracle.feasible]
    return out


def exhaustive_search(runner: TrialRunner, cube: ConfigCube, metrics: list[str]) -> tuple[Trial, bool]:
    """Guided exhaustive search per metric; (best feasible trial by estimated ratio, infeasible?)."""
    def procedure(answer):
        return _frontier(cube, metrics, answer)

    if runner.size > 1:  # rounds of speculative trials until the search can run from the cache
        while spec := speculate(procedure, lambda c: getattr(runner.cached(c), "feasible", None), runner.size):
            runner.evaluate(spec)
    asked = [runner.trial(c) for c in procedure(lambda c: runner.trial(c).feasible)]
    if asked:
        return max(asked, key=lambda t: t.est_ratio), False
    # nothing passes: the least aggressive config, with the metric that degrades least
    tops = [runner.trial(cube.candidate(cube.top, m)) for m in metrics]
    return min(tops, key=lambda t: t.degradation), True


def neighbourhood_search(runner: TrialRunner, cube: ConfigCube, prev: Candidate, metrics: list[str], *,
                         steps: int = 1, monotone: bool = True, threshold: float = 0.01,
                         switch_margin: float = METRIC_SWITCH_MARGIN) -> tuple[Trial | None, dict]:
    """The first feasible config near ``prev`` in decreasing estimated ratio (None if none)."""
    p = cube.point(prev)
    if p is None:
        return None, {"reason": "previous config is not in the search space"}
    cur = prev.prune_metric if prev.prune_metric in metrics else metrics[0]
    switched = False
    if len(metrics) > 1:
        other = next(m for m in metrics if m != cur)
        a, b = cube.candidate(p, cur), cube.candidate(p, other)
        runner.evaluate([a, b])  # one round on two or more ranks
        if runner.trial(b).degradation < runner.trial(a).degradation - switch_margin * threshold:
            cur, switched = other, True
    points = cube.neighbourhood(p, steps, monotone=monotone)
    cands = [cube.candidate(q, cur) for q in points]
    est = runner.estimates(cands)
    ratio = {c: (r / e if e > 0 else math.inf) for c, (e, r) in est.items()}
    order = sorted(range(len(cands)), key=lambda i: (-ratio[cands[i]], i))
    return runner.first_feasible([cands[i] for i in order]), {"metric_switched": switched,
                                                               "neighbours": len(cands)}


def _json_float(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def search_config(method, state, reference, ctx, search_state, *, group=None):
    """Choose this checkpoint's DynaQuant config. Returns (DynaQuantConfig, info, new search_state).

    ``method.config`` supplies the fixed quantizer knobs (alpha, sigma, min_numel),
    ``search_policy``, ``search_neighbourhood`` and optionally ``search_space`` (a SearchSpace or
    dict). ``search_state`` is what the previous call returned (None at first).
    """
    from ..methods.dynaquant import weight_records

    t0 = time.perf_counter()
    mcfg = method.config
    space = SearchSpace.from_any(getattr(mcfg, "search_space", None))
    base = mcfg.quantizer()
    group = group if group is not None else getattr(ctx, "process_group", None)
    recs = weight_records(state, base)
    if not recs:
        return base, {"search": "none", "reason": "no quantizable weights"}, search_state
    cube = ConfigCube(space, embedding=any(r.layer_type == "embedding" for r in recs.values()))
    metrics = _metrics(space, ctx.gradients)
    st = dict(search_state or {})
    runner = TrialRunner(state, reference, ctx, base, group=group)
    try:
        best, extra, infeasible = None, {}, False
        kind = "exhaustive"
        if st.get("best") is not None:
            best, extra = neighbourhood_search(
                runner, cube, Candidate(**st["best"]), metrics,
                steps=int(getattr(mcfg, "search_neighbourhood", 1)),
                monotone=getattr(mcfg, "search_policy", "monotone") == "monotone", threshold=ctx.threshold)
            kind = "neighbourhood" if best is not None else "fallback"
        if best is None:
            best, infeasible = exhaustive_search(runner, cube, metrics)
    finally:
        runner.close()
    info = {"search": kind, "evals": runner.evals, "rounds": runner.rounds, "estimates": runner.n_estimates,
            "ranks": runner.size, "cube_size": len(cube) * len(metrics),
            "baseline": runner.judge.baseline, "score": _json_float(best.score),
            "degradation": _json_float(best.degradation), "threshold": ctx.threshold,
            "higher_is_better": bool(ctx.higher_is_better), "est_ratio": round(best.est_ratio, 3),
            "infeasible": infeasible, **extra, "search_s": round(time.perf_counter() - t0, 3)}
    new_state = {"best": best.candidate.knobs(), "checkpoints": st.get("checkpoints", 0) + 1,
                 "exhaustive": st.get("exhaustive", 0) + (kind != "neighbourhood")}
    return replace(base, **best.candidate.knobs()), info, new_state
