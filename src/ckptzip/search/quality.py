"""The quality check: does a candidate's reconstruction score within the threshold of the exact state?

The user gives ``eval_fn(model) -> float`` (lower is better unless ``higher_is_better``) and a
relative ``threshold`` per checkpoint (default 0.01). A candidate is feasible when

    degradation = (score - baseline) / |baseline|      (lower is better)
                  (baseline - score) / |baseline|      (higher is better)
                  <= threshold

where ``baseline`` is the score of the *state being saved* loaded exactly (not the live model,
which may already have moved on) and ``score`` that of the same state with the quantized weights
replaced by their dequantized values. A baseline of exactly 0 makes the difference absolute.
A non-finite score is infinitely degraded. Only model weights are judged: optimizer moments do
not change what ``eval_fn`` sees.

**Output fidelity.** ``eval_fn`` may instead return the model's *outputs* (a tensor of more than
one element, e.g. logits or hidden states on a fixed validation batch). The judge then keeps the
exact state's outputs y0 and scores a candidate by its relative output error

    score = degradation = ||y - y0|| / ||y0||      (baseline = 0; ``higher_is_better`` must be False)

so ``threshold=0.05`` allows 5 % output error. Use it where a task score cannot see the damage:
early in fine-tuning the task loss sits at chance whatever happens to the pretrained encoder, so
a loss-based search passes configs that erase what the fine-tuning still needs
(docs/BENCHMARKS.md, MiniLM).

Several outputs, or another distance: ``eval_fn`` may return ``Outputs(tensors, distance)``
(e.g. every layer's hidden states); the degradation is then the mean over the tensors of

    "relative"   ||y - y0|| / ||y0||
    "cosine"     mean over rows (all dims but the last) of 1 - cos(y_row, y0_row)

A bare tensor is ``Outputs((tensor,), "relative")``. ``Outputs(..., scale=c)`` reports ``c`` times
that distance: a calibration into the units the threshold is meant in (search/pretrained.py's
default check: points of fine-tuned accuracy). search/pretrained.py builds such checks for
pretrained encoders.

Evaluation happens on a scratch copy of the model (one per search, reused for every trial, and
kept for the next search where a deep copy would give the same: search/scratch.py) loaded with
``load_state_dict`` of the state_dict rebuilt from the state's skeleton, as ``restore`` rebuilds
it: a tied weight (GPT-2's lm_head = wte) gets the same reconstruction. After the exact state, a
plain scratch (no load hooks, no ``_load_from_state_dict`` of its own) only gets the tensors that
differ from what it holds, and a ``Fill`` replacement (the search's trials) is written straight
into the scratch's tensor: no model-sized temporary per trial.
Around each ``eval_fn`` call the torch (CPU and CUDA), numpy and python RNG states are saved and
restored, and the scratch's train/eval flags are put back; the live model is never touched.

    judge = QualityJudge(model, eval_fn, flat_state, threshold=0.01)
    v = judge.check({"model/fc1.weight": w_hat})   # -> Verdict(feasible, degradation, score)
    judge.close()
"""
from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError, NonFiniteError
from ..state import FlatState, unflatten_state
from . import scratch as _scratch
from .scratch import unwrap

DISTANCES = ("relative", "cosine")


@dataclass(frozen=True)
class Fill:
    """A replacement the judge writes straight into its scratch model: ``write(out)`` fills ``out``
    (``shape``, any float dtype) with the reconstruction. Where the scratch takes plain copies
    (``QualityJudge._load``) no model-sized temporary is made per trial; elsewhere it is made
    here (``tensor``)."""

    shape: tuple
    dtype: torch.dtype
    write: Callable[[torch.Tensor], None]

    def tensor(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.write(out)
        return out


@dataclass(frozen=True)
class Outputs:
    """What an output-fidelity ``eval_fn`` may return: tensors compared one by one with the exact
    state's, and how (see the module docstring)."""

    tensors: tuple
    distance: str = "relative"
    scale: float = 1.0  # the degradation is scale x the distance (a calibration; see the module docstring)

    def __post_init__(self):
        t = tuple(self.tensors) if isinstance(self.tensors, list | tuple) else (self.tensors,)
        if not t or not all(isinstance(x, torch.Tensor) and x.numel() > 0 for x in t):
            raise ConfigError("Outputs holds one or more non-empty tensors, got "
                              f"{[type(x).__name__ for x in t] or 'none'}")
        if self.distance not in DISTANCES:
            raise ConfigError(f"Outputs.distance must be one of {DISTANCES}, got {self.distance!r}")
        if not (isinstance(self.scale, int | float) and math.isfinite(self.scale) and self.scale > 0):
            raise ConfigError(f"Outputs.scale must be a finite number > 0, got {self.scale!r}")
        object.__setattr__(self, "tensors", t)

    def shapes(self) -> list[tuple]:
        return [tuple(x.shape) for x in self.tensors]


def output_distance(out: Outputs, ref: Outputs) -> float:
    """``out.scale`` x the mean over tensors of ``out.distance`` between ``out`` and the reference outputs."""
    ds = []
    for y, y0 in zip(out.tensors, ref.tensors):
        y = y.detach().to(y0)
        if out.distance == "relative":
            ds.append(float((y - y0).norm() / y0.norm()))
        else:
            rows = y.reshape(-1, y.shape[-1]) if y.dim() > 1 else y.reshape(1, -1)
            rows0 = y0.reshape(-1, y0.shape[-1]) if y0.dim() > 1 else y0.reshape(1, -1)
            ds.append(float((1 - torch.nn.functional.cosine_similarity(rows, rows0, dim=-1)).clamp(min=0).mean()))
    d = out.scale * sum(ds) / len(ds)
    return d if math.isfinite(d) else math.inf


@dataclass(frozen=True)
class Verdict:
    feasible: bool
    degradation: float   # relative (see module docstring); may be negative (the candidate scores better)
    score: float


@contextmanager
def preserved_rng():
    """Restore the torch (CPU, CUDA), numpy and python RNG states on exit."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    np_state = np.random.get_state()
    py_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        np.random.set_state(np_state)
        random.setstate(py_state)


def _plain_targets(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The tensors ``load_state_dict`` copies into, by key, when copying is all it does: no load
    hooks, every module's ``_load_from_state_dict`` nn.Module's own, plain tensors (no DTensor,
    no lazy parameter). None otherwise."""
    for m in model.modules():
        if type(m)._load_from_state_dict is not nn.Module._load_from_state_dict or \
                m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks:
            return None
    targets = model.state_dict(keep_vars=True)
    if not all(type(v) in (torch.Tensor, nn.Parameter) for v in targets.values()):
        return None
    return dict(targets)


def model_skeleton(state: FlatState):
    """The skeleton of the state's ``model`` entry (None if the state has none)."""
    sk = state.skeleton
    return sk.get("model") if isinstance(sk, dict) and isinstance(sk.get("model"), dict) else None


def _as_outputs(out):
    """A tensor of more than one element is outputs; anything else stays (a score, or Outputs)."""
    if isinstance(out, torch.Tensor) and out.numel() > 1:
        return Outputs((out,), "relative")
    return out


def _scalar(s) -> float:
    if isinstance(s, torch.Tensor):
        if s.numel() != 1:
            raise ConfigError(f"eval_fn returned a tensor of shape {tuple(s.shape)} where a score was expected; "
                              "return a float score, or the same outputs (more than one element) every call")
        return float(s.item())
    try:
        return float(s)
    except (TypeError, ValueError):
        raise ConfigError(f"eval_fn must return a float score or a tensor of outputs, got {type(s).__name__}") \
            from None


class QualityJudge:
    """Scores candidate reconstructions of one state against its exact score (see module docstring)."""

    def __init__(self, model: nn.Module, eval_fn: Callable[[nn.Module], float], state: FlatState, *,
                 threshold: float = 0.01, higher_is_better: bool = False):
        if not isinstance(model, nn.Module):
            raise ConfigError(f"the config search needs the live nn.Module as model, got {type(model).__name__}")
        if not callable(eval_fn):
            raise ConfigError("eval_fn must be a callable eval_fn(model) -> float score or tensor of outputs")
        if not (isinstance(threshold, int | float) and math.isfinite(threshold) and threshold >= 0):
            raise ConfigError(f"threshold is a relative degradation >= 0 (0.01 = 1%), got {threshold!r}")
        self.eval_fn = eval_fn
        self.threshold = float(threshold)
        self.higher_is_better = bool(higher_is_better)
        self.evals = 0
        _, self._prefix = unwrap(model)
        self._state = state
        self._skeleton = model_skeleton(state)
        if self._skeleton is None:
            raise ConfigError("the config search found no model weights in the state; save the model's "
                              "state_dict under the key 'model'")
        self._model_records = {n for n, r in state.records.items() if n.startswith("model/")}
        self._model = model
        self._scratch = _scratch.take(model)  # kept between searches of this model (search/scratch.py)
        self._modes = [(m, m.training) for m in self._scratch.modules()]
        self._targets = _plain_targets(self._scratch)  # key -> scratch tensor, None: load_state_dict only
        self._base: dict | None = None                 # the exact state_dict, loaded by the first run
        self._dirty: set[str] = set()                  # keys the scratch holds a replacement of
        self._outputs: Outputs | None = None  # the exact state's outputs (output-fidelity mode)
        first = _as_outputs(self._run({}))
        if isinstance(first, Outputs):
            if self.higher_is_better:
                raise ConfigError("eval_fn returned outputs (tensors), which are judged by their distance to the "
                                  "exact outputs (lower is better); drop higher_is_better=True")
            ref = [x.detach().to(torch.float64) for x in first.tensors]
            if not all(bool(torch.isfinite(x).all()) and float(x.norm()) > 0.0 for x in ref):
                raise NonFiniteError("eval_fn's outputs for the uncompressed state are all zero or not finite; "
                                     "the config search needs outputs to compare against")
            self._outputs = Outputs(tuple(ref), first.distance, first.scale)
            self.baseline = 0.0
        else:
            self.baseline = _scalar(first)
        self.evals = 0  # the baseline is not a trial
        if not math.isfinite(self.baseline):
            raise NonFiniteError(f"eval_fn returned {self.baseline} for the uncompressed state; the config "
                                 "search needs a finite score")

    @property
    def judges_outputs(self) -> bool:
        return self._outputs is not None

    def state_dict(self, replacements: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model state_dict of the state with ``replacements`` (record name -> tensor) swapped
        in, rebuilt through the skeleton as restore does (tied weights share the replacement)."""
        unknown = set(replacements) - self._model_records
        if unknown:
            raise ConfigError(f"replacement(s) for {sorted(unknown)[:3]} are not model records of the state")
        sd = unflatten_state(self._skeleton, {**self._state.tensors, **replacements})
        if self._prefix:
            sd = {k[len(self._prefix):] if k.startswith(self._prefix) else k: v for k, v in sd.items()}
        return sd

    def _load(self, sd: dict, exact: bool) -> None:
        """load_state_dict(sd); once the exact state is in, a plain module (no load hooks, no
        ``_load_from_state_dict`` of its own) only gets the tensors that differ from what it holds,
        a ``Fill`` written in place."""
        t, base = self._targets, self._base
        if base is None or t is None or sd.keys() != t.keys() or \
                any(tuple(v.shape) != tuple(t[k].shape) for k, v in sd.items() if v is not base[k]):
            self._scratch.load_state_dict({k: v.tensor() if isinstance(v, Fill) else v for k, v in sd.items()})
            self._base, self._dirty = (sd, set()) if exact else (base, set(sd))
            return
        written: set[tuple[int, int]] = set()  # a tied weight's keys share one scratch tensor
        with torch.no_grad():
            for k, v in sd.items():
                same = v is base[k]
                if not same or k in self._dirty:
                    if not isinstance(v, Fill):
                        t[k].copy_(v)
                    elif (id(v), id(t[k])) not in written:
                        v.write(t[k].detach())
                        written.add((id(v), id(t[k])))
                (self._dirty.discard if same else self._dirty.add)(k)

    def _run(self, replacements: Mapping[str, torch.Tensor]):
        self._load(self.state_dict(replacements), not replacements)
        try:
            # off the main thread (async saves' search thread) the global RNG belongs to the training
            # loop: restoring it would rewind the loop's stream, so it is left alone (asyncsearch.py)
            with preserved_rng() if threading.current_thread() is threading.main_thread() else nullcontext():
                out = self.eval_fn(self._scratch)
        finally:
            for m, training in self._modes:
                m.training = training
        self.evals += 1
        return out

    def score(self, replacements: Mapping[str, torch.Tensor]) -> float:
        """eval_fn on the state with ``replacements`` (record name, e.g. ``model/fc1.weight``); in
        output-fidelity mode, the relative error of its outputs."""
        out = _as_outputs(self._run(replacements))
        if self._outputs is None:
            return _scalar(out)
        ref = self._outputs
        kind = (ref.shapes(), ref.distance, ref.scale)
        if not isinstance(out, Outputs) or (out.shapes(), out.distance, out.scale) != kind:
            got = f"{out.distance} x{out.scale:g} {out.shapes()}" if isinstance(out, Outputs) else type(out).__name__
            raise ConfigError(f"eval_fn returned {ref.distance} x{ref.scale:g} outputs of shape(s) {ref.shapes()} "
                              f"for the exact state but {got} for a candidate; return the same outputs every call")
        return output_distance(out, ref)

    def degradation(self, score: float) -> float:
        if not math.isfinite(score):
            return math.inf
        diff = (self.baseline - score) if self.higher_is_better else (score - self.baseline)
        return diff / abs(self.baseline) if self.baseline != 0 else diff

    def check(self, replacements: Mapping[str, torch.Tensor]) -> Verdict:
        s = self.score(replacements)
        d = self.degradation(s)
        return Verdict(d <= self.threshold, d, s)

    def close(self) -> None:
        if self._scratch is not None:
            _scratch.give(self._model, self._scratch)
        self._scratch = None
        self._modes = []
