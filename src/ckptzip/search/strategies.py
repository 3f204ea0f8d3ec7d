"""The config search: guided exhaustive search, then delta-neighbourhood search, for any searching method.

Per checkpoint (Inshrinkerator section 5), with a user ``eval_fn`` and ``threshold``:

- **exhaustive** (first checkpoint): for each group value (DynaQuant's prune metric; one pass for
  spaces without a group), ``cube.guided_search`` over the config cube finds the feasible
  frontier; of all feasible configs it evaluated, the one with the highest *estimated* compression
  ratio wins. Sensitivity without gradient EMAs is the same as magnitude, so it is skipped when
  ``ctx.gradients`` is None.
- **neighbourhood** (steady state): with a group knob, every ``METRIC_CHECK_EVERY``-th steady
  checkpoint first evaluates the previous best under both group values and switches when the other
  one's degradation is lower by more than ``METRIC_SWITCH_MARGIN`` x threshold (the paper checks at
  every save; a switch is rare and each check costs an evaluation). Then the points within
  ``search.neighbourhood`` cube steps of the previous best (minus the more aggressive ones under
  ``search.policy="monotone"``), ordered by estimated ratio, are evaluated until the first
  feasible one: one evaluation while the previous best stays feasible.
- **fallback**: nothing in the neighbourhood is feasible -> the exhaustive search again; under the
  monotone policy only over the box between the previous best and the top corner (the paper
  re-searches the whole cube; a config more aggressive than one that just failed is not what the
  monotone rule would pick). If no config at all passes, the least aggressive one (the cube's top
  corner, best group) is chosen and the info says ``infeasible: True``.

The paper extends this search to its baselines (section 8.2, Tables 10-12), each with its own
space: DynaQuant, QD, CNR and GOBO all run through this module. What a method must provide
(methods/quantizing.py, ``QuantizingMethod``): ``space()`` (search/spaces.py),
``search_records(state)`` (the weights the search judges), ``search_quantize(state, knobs,
gradients)`` -> {name: QuantizedTensor}, ``search_dequantize(q, name, out=None)`` (what the decoder
rebuilds: a residual's base added; written into ``out``, the judge's scratch tensor, where the
judge copies plainly), and ``search_coding``: how its encoder codes the codes, for the ratio
estimate. Optionally ``search_prepare(state, reference,
gradients)`` -> an object with ``quantize(knobs)`` and ``estimate(knobs) -> (est_bits,
raw_bits)`` (or None), and optionally ``estimate_many(knobs_list)``, the same for a list at once:
the work shared by every candidate of one checkpoint, done once (DynaQuant's quant/dqsearch.py
sketches each weight once and estimates candidates from the histograms without quantizing, a
neighbourhood in one batch; without it each estimate quantizes).

Ratio estimate (for ordering and for picking among feasible configs): per quantized weight,
``search_coding`` = "conditional": the order-0 entropy of its codes (keyframe) or the conditional
entropy H(delta | previous code) of its cyclic delta against the reference codes, which is what
the rearranged delta encoder exploits (its groups are the previous code's buckets); "delta":
H(delta) (QD: Huffman on the plain cyclic delta); "plain": H(codes) (no delta). Plus the side
tensors' raw bits (protected values, outliers, per-row ranges) and 32 bits per codebook entry.
bench/search.py measures its rank correlation with the real encoded sizes. A candidate keeps the
estimate it was first given: the neighbourhood's histogram estimates (``estimate_many``) stay
those of its evaluated trials; the exhaustive search estimates each trial from its quantized codes.

Call order (methods/quantizing.py ``QuantizingMethod.choose_knobs``)::

    knobs, info, search_state = search_config(method, state, reference, ctx, search_state)
    # knobs: the method config overrides for this checkpoint ({} when nothing is quantizable);
    # info -> manifest summary; search_state: keep for the next call (None on the first)

Parallel trials: pass ``group`` (or set ``ctx.process_group``): m data-parallel ranks evaluate m
candidates per round and agree through one all_gather (dist.py); every rank must call
``search_config`` with the same state. The chosen config is the sequential one (see cube.py).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial

import torch

from .. import dist
from ..codec.entropy import conditional_bits, entropy_bits
from ..errors import ConfigError
from ..tensorbytes import torch_dtype
from .cube import Candidate, ConfigCube, MonotoneOracle, guided_search, speculate
from .quality import Fill, QualityJudge

CODINGS = ("conditional", "delta", "plain")

# "clearly better": the other prune metric must free more than this share of the quality budget.
# Each switch re-prunes different weights, so every code moves against the reference (bench/search.py:
# a switch on a quality difference of 0.1x the threshold, i.e. noise, cost ~10 % of that checkpoint's
# ratio, and the switch back the same again).
METRIC_SWITCH_MARGIN = 0.25
# steady-state checkpoints between two comparisons of the prune metrics (1: at every save, the paper)
METRIC_CHECK_EVERY = 4


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


def estimate_bits(quantized: dict, reference=None, *, coding: str = "conditional") -> tuple[float, float]:
    """(estimated encoded bits, raw bits) of quantized weights (name -> QuantizedTensor), coded
    against ``reference.weights[name]`` (a qrecord.Codes) where the reference has them (see the
    module docstring for ``coding``)."""
    if coding not in CODINGS:
        raise ConfigError(f"coding must be one of {CODINGS}, got {coding!r}")
    ref = getattr(reference, "weights", {}) if (reference is not None and coding != "plain") else {}
    est = raw = 0.0
    for name, q in quantized.items():
        codes = q.codes.reshape(-1)
        n = codes.numel()
        raw += n * torch_dtype(q.dtype).itemsize * 8
        p = ref.get(name)
        if p is not None and p.codes.numel() == n:
            B = max(int(q.n_levels), int(p.n_levels))
            if coding == "conditional":  # H(delta | prev code)
                est += conditional_bits(p.codes.reshape(-1).to(codes.device), codes, B)
            else:
                prev = p.codes.reshape(-1).to(codes.device, torch.int64)
                est += entropy_bits(torch.remainder(codes.long() - prev, B))
        else:
            est += entropy_bits(codes)
        est += sum(8.0 * v.numel() * v.element_size() for v in q.side.values()) + 32.0 * q.n_levels
    return est, raw


def reconstruction(method, q, name: str | None = None) -> Fill:
    """What the decoder rebuilds from ``q`` (``method.search_dequantize``), for the judge to write
    straight into its model."""
    return Fill(tuple(q.shape), torch_dtype(q.dtype), partial(method.search_dequantize, q, name))


class TrialRunner:
    """Evaluates candidates (quantize -> estimate -> dequantize -> eval), caches the results, and
    spreads rounds of candidates over a process group when one is given."""

    def __init__(self, method, state, reference, ctx, *, group=None):
        self.method, self.state, self.reference = method, state, reference
        self.gradients = ctx.gradients
        prepare = getattr(method, "search_prepare", None)
        self.prepared = prepare(state, reference, ctx.gradients) if prepare is not None else None
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
    def _quantize(self, c: Candidate) -> dict:
        if self.prepared is None:
            return self.method.search_quantize(self.state, c.knobs(), self.gradients)
        q = self.prepared.quantize(c.knobs())
        remember = getattr(self.method, "remember_trial", None)  # the save may store what was evaluated
        if remember is not None:
            remember(self.state, c.knobs(), self.gradients, q)
        return q

    def _estimate(self, q: dict) -> tuple[float, float]:
        return estimate_bits(q, self.reference, coding=self.method.search_coding)

    def _estimate_row(self, c: Candidate) -> list[float]:
        if self.prepared is not None:
            return list(self.prepared.estimate(c.knobs()))
        return list(self._estimate(self._quantize(c)))

    def _trial_estimate(self, c: Candidate, q: dict) -> tuple[float, float]:
        """A candidate estimated for the ordering keeps that estimate (one figure per candidate)."""
        return self._estimates[c] if c in self._estimates else self._estimate(q)

    def _trial_row(self, c: Candidate) -> list[float]:
        q = self._quantize(c)
        est, raw = self._trial_estimate(c, q)
        v = self.judge.check(self._replacements(q))
        self.local_evals += 1
        return [float(v.feasible), v.degradation, v.score, est, raw]

    def _replacements(self, q: dict) -> dict:
        """The judge's replacements for one trial's quantized weights."""
        return {n: reconstruction(self.method, qt, n) for n, qt in q.items()}

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
        many = getattr(self.prepared, "estimate_many", None)
        if many is not None and self.size == 1 and todo:  # one batch: histograms only, no rounds
            for c, er in zip(todo, many([c.knobs() for c in todo])):
                self._estimates[c] = er
            self.n_estimates += len(todo)
            todo = []
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


def _frontier(cube: ConfigCube, groups, answer, lo=None) -> list[Candidate]:
    """The sequential exhaustive search as a pure function of the feasibility answers: the
    feasible candidates it evaluated, per group in order (over the box [lo, top])."""
    out: list[Candidate] = []
    for g in groups:
        oracle = MonotoneOracle(lambda p, g=g: answer(cube.candidate(p, g)))
        guided_search(cube.bottom if lo is None else lo, cube.top, oracle)
        out += [cube.candidate(p, g) for p in oracle.feasible]
    return out


def exhaustive_search(runner: TrialRunner, cube: ConfigCube, groups, *, lo=None) -> tuple[Trial, bool]:
    """Guided exhaustive search per group over the box [lo, top] (the whole cube by default);
    (best feasible trial by estimated ratio, infeasible?)."""
    def procedure(answer):
        return _frontier(cube, groups, answer, lo)

    if runner.size > 1:  # rounds of speculative trials until the search can run from the cache
        while spec := speculate(procedure, lambda c: getattr(runner.cached(c), "feasible", None), runner.size):
            runner.evaluate(spec)
    asked = [runner.trial(c) for c in procedure(lambda c: runner.trial(c).feasible)]
    if asked:
        return max(asked, key=lambda t: t.est_ratio), False
    # nothing passes: the least aggressive config, with the group that degrades least
    tops = [runner.trial(cube.candidate(cube.top, g)) for g in groups]
    return min(tops, key=lambda t: t.degradation), True


def neighbourhood_search(runner: TrialRunner, cube: ConfigCube, prev: Candidate, groups, *,
                         steps: int = 1, monotone: bool = True, threshold: float = 0.01,
                         switch_margin: float = METRIC_SWITCH_MARGIN,
                         check_groups: bool = True) -> tuple[Trial | None, dict]:
    """The first feasible config near ``prev`` in decreasing estimated ratio (None if none).
    ``check_groups``: compare the group values (prune metrics) at ``prev`` first."""
    p = cube.point(prev)
    if p is None:
        return None, {"reason": "previous config is not in the search space"}
    groups = list(groups)
    cur = cube.group(prev) if cube.group(prev) in groups else groups[0]
    switched = False
    if len(groups) > 1 and check_groups:
        other = next(g for g in groups if g != cur)
        a, b = cube.candidate(p, cur), cube.candidate(p, other)
        runner.evaluate([a, b])  # one round on two or more ranks
        if runner.trial(b).degradation < runner.trial(a).degradation - switch_margin * threshold:
            cur, switched = other, True
    points = cube.neighbourhood(p, steps, monotone=monotone)
    cands = list(dict.fromkeys(cube.candidate(q, cur) for q in points))  # canonical duplicates once
    est = runner.estimates(cands)
    ratio = {c: (r / e if e > 0 else math.inf) for c, (e, r) in est.items()}
    order = sorted(range(len(cands)), key=lambda i: (-ratio[cands[i]], i))
    extra = {"neighbours": len(cands)}
    if cube.space.group_knob:
        extra["metric_switched"] = switched
        extra["metric_checked"] = bool(len(groups) > 1 and check_groups)
    return runner.first_feasible([cands[i] for i in order]), extra


def _json_float(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def search_config(method, state, reference, ctx, search_state, *, group=None, runner: TrialRunner | None = None):
    """Choose this checkpoint's quantizer knobs. Returns (knobs, info, new search_state).

    ``method.config.search`` supplies ``policy`` (``method.search_policy`` when the method has one)
    and ``neighbourhood``, ``method.space()`` the method's search space; the method itself the quantizer (see the module docstring).
    ``search_state`` is what the previous call returned (None at first).
    ``runner``: a TrialRunner to use instead of the default (dcp/search.py: sharded trials in which
    every rank quantizes its shards of each candidate); the search closes it.
    """
    t0 = time.perf_counter()
    mcfg = method.config
    group = group if group is not None else getattr(ctx, "process_group", None)
    recs = method.search_records(state)
    if not recs:
        return {}, {"search": "none", "reason": "no quantizable weights"}, search_state
    space = method.space()
    monotone = getattr(method, "search_policy", mcfg.search.policy) == "monotone"
    cube = ConfigCube(space, embedding=any(r.layer_type == "embedding" for r in recs.values()))
    groups = space.groups(ctx.gradients)
    st = dict(search_state or {})
    runner = runner or TrialRunner(method, state, reference, ctx, group=group)
    try:
        best, extra, infeasible = None, {}, False
        kind = "exhaustive"
        prev = cube.from_knobs(st.get("best"))
        if prev is not None:
            since = int(st.get("since_metric_check", METRIC_CHECK_EVERY))
            best, extra = neighbourhood_search(
                runner, cube, prev, groups, steps=int(mcfg.search.neighbourhood),
                monotone=monotone, threshold=ctx.threshold,
                check_groups=since + 1 >= METRIC_CHECK_EVERY)
            kind = "neighbourhood" if best is not None else "fallback"
        if best is None:
            # under the monotone policy a fallback never goes below the previous best: it searches
            # the box above it (fewer evaluations; the whole cube for "free" or without a previous best)
            lo = cube.point(prev) if prev is not None and monotone else None
            best, infeasible = exhaustive_search(runner, cube, groups, lo=lo)
    finally:
        runner.close()
    info = {"search": kind, "evals": runner.evals, "rounds": runner.rounds, "estimates": runner.n_estimates,
            "ranks": runner.size, "cube_size": len(cube) * len(groups),
            "judge": "outputs" if runner.judge.judges_outputs else "score",
            "baseline": runner.judge.baseline, "score": _json_float(best.score),
            "degradation": _json_float(best.degradation), "threshold": ctx.threshold,
            "higher_is_better": bool(ctx.higher_is_better), "est_ratio": round(best.est_ratio, 3),
            "infeasible": infeasible, **extra, "search_s": round(time.perf_counter() - t0, 3)}
    checked = kind != "neighbourhood" or extra.get("metric_checked", False)  # exhaustive tries every group
    new_state = {"best": best.candidate.knobs(), "checkpoints": st.get("checkpoints", 0) + 1,
                 "exhaustive": st.get("exhaustive", 0) + (kind != "neighbourhood"),
                 "since_metric_check": 0 if checked else int(st.get("since_metric_check", METRIC_CHECK_EVERY)) + 1}
    return best.candidate.knobs(), info, new_state
