"""The config search over a sharded model: every rank quantizes its shards of each candidate.

With FSDP each rank holds one shard of every weight, so the search's parallel trials (one
candidate per rank, search/strategies.py) do not apply: a candidate is a property of the whole
model. Here every candidate is one collective trial:

    1. every rank quantizes its shards under the candidate (thresholds and codebooks merged across
       ranks, merge.converge) and estimates their coded size; sizes are summed over ranks
    2. every rank swaps the dequantized shards into the live model's local shards
    3. ``eval_fn(model)`` runs as the user runs it under FSDP (a collective forward); the score is
       averaged over ranks, so every rank judges the same number against the same baseline
    4. the exact shards are put back (always), RNG states and train/eval flags restored

The decision procedure is the single-process one (search_config with this runner), so every rank
takes the same decisions from the same numbers. Call order: ``search_knobs(...)`` from the writer
in a synchronous save only (an asynchronous save runs while the model trains on).
"""
from __future__ import annotations

import math

import torch

from .. import dist
from ..errors import ConfigError, NonFiniteError
from ..search.quality import Fill, QualityJudge, preserved_rng
from ..search.strategies import TrialRunner, estimate_bits, reconstruction, search_config
from . import merge
from .shardstate import ShardState


class ShardJudge(QualityJudge):
    """QualityJudge's contract (baseline, check, degradation, close) on the live sharded model."""

    def __init__(self, model: torch.nn.Module, eval_fn, shard: ShardState, *, threshold: float,
                 higher_is_better: bool, group):
        if not callable(eval_fn):
            raise ConfigError("eval_fn must be a callable eval_fn(model) -> float score")
        self.model, self.eval_fn, self.group = model, eval_fn, group
        self.threshold, self.higher_is_better = float(threshold), bool(higher_is_better)
        self._live: dict[str, torch.Tensor] = {}  # weight record -> the live local shard it came from
        params = dict(model.named_parameters())
        for name, rec in shard.flat.records.items():
            p = params.get(rec.param) if rec.role == "weight" else None
            if p is not None:
                t = p.to_local() if hasattr(p, "to_local") else p
                if tuple(t.shape) == tuple(shard.flat.tensors[name].shape):
                    self._live[name] = t
        self._modes = [(m, m.training) for m in model.modules()]
        self._outputs = None  # float scores only (output fidelity is judged in one process)
        self.evals = 0
        self.baseline = self.score({})
        self.evals = 0
        if not math.isfinite(self.baseline):
            raise NonFiniteError(f"eval_fn returned {self.baseline} for the uncompressed state; the config "
                                 "search needs a finite score")

    def score(self, replacements: dict[str, torch.Tensor]) -> float:
        exact = {n: self._live[n].detach().clone() for n in replacements if n in self._live}
        err, score = None, math.nan
        try:
            with torch.no_grad():
                for n, t in exact.items():
                    r = replacements[n]
                    if isinstance(r, Fill):  # written in place: no temporary of the shard's size
                        r.write(self._live[n].detach())
                    else:
                        self._live[n].copy_(r)
            with preserved_rng():
                out = self.eval_fn(self.model)
            score = _float_score(out)
        except Exception as e:  # noqa: BLE001 - every rank must reach the gather below
            err = e
        finally:
            with torch.no_grad():
                for n, t in exact.items():
                    self._live[n].copy_(t)
            for m, training in self._modes:
                m.training = training
        self.evals += 1
        # the mean over ranks: equal scores stay equal, per-rank validation shards average
        row = dist.all_gather_rows([float(err is not None), score], self.group) if self.group is not None \
            else [[float(err is not None), score]]
        if err is not None:
            raise err
        if any(r[0] for r in row):
            raise RuntimeError("eval_fn failed on another rank; see its traceback")
        return sum(r[1] for r in row) / len(row)

    def covers(self, name: str) -> bool:
        """Whether record ``name`` is a weight this judge can swap into the live model."""
        return name in self._live

    def close(self) -> None:
        self._live, self._modes = {}, []


def _float_score(out) -> float:
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return float(out.item())
    if isinstance(out, int | float) and not isinstance(out, bool):
        return float(out)
    raise ConfigError(f"the sharded config search needs eval_fn(model) to return a float score, got "
                      f"{type(out).__name__}{tuple(out.shape) if isinstance(out, torch.Tensor) else ''}")


class ShardedTrialRunner(TrialRunner):
    """Trials in which every rank evaluates every candidate on its shards (the module docstring)."""

    def __init__(self, method, shard: ShardState, reference, judge: ShardJudge, *, group):
        self.method, self.state, self.reference = method, shard.flat, reference
        self.gradients = None            # gradient EMAs of a sharded model: not supported (magnitude)
        self.prepared = None             # shards share their sketches across ranks: no per-rank sketch reuse
        self.group = None                # no parallel trials: the candidates run one at a time ...
        self.shard_group = group         # ... on every rank of this group
        self.rank, self.size = 0, 1
        self.judge = judge
        self._trials, self._estimates = {}, {}
        self.evals = self.local_evals = self.rounds = self.n_estimates = 0

    def _quantize(self, c) -> dict:
        return merge.converge(lambda: self.method.search_quantize(self.state, c.knobs(), None), self.shard_group,
                              what="a search trial")[0]

    def _estimate(self, q: dict) -> tuple[float, float]:
        est, raw = estimate_bits(q, self.reference, coding=self.method.search_coding)
        if self.shard_group is None:
            return est, raw
        rows = dist.all_gather_rows([est, raw], self.shard_group)
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    def _replacements(self, q: dict) -> dict:
        # this shard's judge covers its own records; the estimates were gathered, the same on every rank
        return {n: reconstruction(self.method, qt) for n, qt in q.items() if self.judge.covers(n)}


def search_knobs(method, shard: ShardState, reference, *, model, eval_fn, threshold: float,
                 higher_is_better: bool, step: int, search_state: dict | None, group):
    """(knobs, info, new search state) chosen collectively; every rank returns the same."""
    from ..methods.base import EncodeContext

    recs = method.search_records(shard.flat)
    has, emb = bool(recs), any(r.layer_type == "embedding" for r in recs.values())
    flags = dist.all_reduce_max([float(not has), float(emb), -float(emb)], group) if group is not None \
        else [float(not has), float(emb), -float(emb)]
    if flags[0] or flags[1] != -flags[2]:
        return {}, {"search": "none", "reason": "some rank holds no quantizable shard, or ranks disagree on "
                                                "the search space (an embedding shard on only some ranks)"}, \
            search_state
    ctx = EncodeContext(step=step, model=model, eval_fn=eval_fn, threshold=threshold,
                        higher_is_better=higher_is_better)
    judge = ShardJudge(model, eval_fn, shard, threshold=threshold, higher_is_better=higher_is_better, group=group)
    runner = ShardedTrialRunner(method, shard, reference, judge, group=group)
    try:
        knobs, info, state = search_config(method, shard.flat, reference, ctx, search_state, runner=runner)
    finally:
        runner.close()
    info["ranks"] = group.size() if group is not None else 1
    return knobs, info, state
