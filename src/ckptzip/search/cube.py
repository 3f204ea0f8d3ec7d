"""The config cube: a search space (search/spaces.py) laid out so that quality is monotone along every axis.

A space gives ordered axes, index 0 = most aggressive = lowest quality. DynaQuant's (paper Table 2
/ Inshrinkerator section 5), for example:

    bins              4, 6, 8, 12, 16, 32       ascending   (more bins: better)
    prune_fraction    .5, .4, .3, .2, .1, 0     descending  (less pruning: better)
    protect_fraction  .0005, .005, .01          ascending   (more protection: better)
    embedding_bins    16, 32                    ascending   (collapsed to its largest value when
                                                             the model has no embedding)

A group knob (DynaQuant's prune metric) is not an axis: the search runs once per group value.
A point is a tuple of axis indices; ``candidate(point, group)`` turns it into the knobs it sets.
"Monotone" means: if point a is feasible, every b >= a (componentwise) is feasible too. Nothing
here evaluates a model: ``guided_search`` asks a ``MonotoneOracle``, which answers what
monotonicity already implies and evaluates the rest.

Guided exhaustive search (paper Algorithm 4), on a box [lo, hi]:
  1. binary-search the box's diagonal (every step moves each axis by at most one index) for its
     first feasible point p; q, the diagonal point before p, was found infeasible;
  2. [p, hi] is feasible and p is its best point; [lo, p-1] <= q is infeasible: skip both;
  3. recurse into the other 2^d - 2 sub-boxes (low or high part on each axis).
Every minimal feasible point of the cube ends up in the returned list (tests check it against
brute force), at a small fraction of the cube's evaluations.

Parallel trials never change a result: ``speculate`` replays the sequential search with
hypothetical answers to list the points it may ask next (breadth-first over its decision tree,
across sub-boxes and metrics); m ranks evaluate m of them per round, and the real run then reads
cached answers in exactly the order a one-process run would have evaluated them.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .spaces import PRUNE_METRICS, DynaQuantSpace, Space  # noqa: F401  (re-exported)

Point = tuple[int, ...]


@dataclass(frozen=True)
class Candidate:
    """One quantizer configuration the search may pick: the knobs a cube point (and group) sets."""

    items: tuple[tuple[str, object], ...]   # (knob, value), group knob first, then axis order

    def knobs(self) -> dict:
        """The method config overrides (JSON-able)."""
        return dict(self.items)


class ConfigCube:
    """A search space as a grid of axis indices in quality order (see module docstring)."""

    def __init__(self, space: Space | None = None, *, embedding: bool = True):
        self.space = space = space if space is not None else DynaQuantSpace()
        axes = space.axes()
        self.knob_names: tuple[str, ...] = tuple(a.knob for a in axes)
        # an embedding-only axis is collapsed to its least aggressive value when nothing uses it
        self.collapsed: tuple[bool, ...] = tuple(a.embedding and not embedding for a in axes)
        self.axes: tuple[tuple, ...] = tuple((a.values[-1],) if c else a.values for a, c in zip(axes, self.collapsed))
        self.shape: tuple[int, ...] = tuple(len(a) for a in self.axes)
        self.bottom: Point = (0,) * len(self.axes)                      # most aggressive
        self.top: Point = tuple(n - 1 for n in self.shape)               # least aggressive

    def __len__(self) -> int:
        return math.prod(self.shape)

    def points(self) -> Iterator[Point]:
        return itertools.product(*(range(n) for n in self.shape))

    def candidate(self, p: Point, group=None) -> Candidate:
        knobs = {self.space.group_knob: group} if self.space.group_knob else {}
        knobs.update((k, ax[i]) for k, ax, i in zip(self.knob_names, self.axes, p))
        return Candidate(tuple(self.space.canonical(knobs).items()))

    def from_knobs(self, knobs: dict) -> Candidate | None:
        """The candidate for a knob dict (e.g. a saved previous best), None if it is not this space's."""
        names = ((self.space.group_knob,) if self.space.group_knob else ()) + self.knob_names
        if not isinstance(knobs, dict) or set(knobs) != set(names):
            return None
        return Candidate(tuple((k, knobs[k]) for k in names))

    def group(self, c: Candidate):
        return c.knobs().get(self.space.group_knob) if self.space.group_knob else None

    def label(self, c: Candidate) -> str:
        return self.space.label(c.knobs())

    def point(self, c: Candidate) -> Point | None:
        """The grid point of a candidate, or None when one of its values is not on the axes."""
        knobs = c.knobs()
        out = []
        for name, ax, collapsed in zip(self.knob_names, self.axes, self.collapsed):
            if collapsed:  # any value maps onto a collapsed axis
                out.append(0)
                continue
            v = knobs.get(name)
            hit = [j for j, a in enumerate(ax)
                   if isinstance(v, int | float) and math.isclose(a, v, rel_tol=1e-9, abs_tol=1e-12)]
            if not hit:
                return None
            out.append(hit[0])
        return tuple(out)

    def neighbourhood(self, p: Point, steps: int, *, monotone: bool) -> list[Point]:
        """Points at most ``steps`` axis steps (L1) from p, p first. ``monotone`` drops points
        more aggressive than p (q <= p componentwise, q != p): the paper's rule that the model
        only gets more sensitive as training goes on."""
        if steps < 0:
            raise ConfigError(f"SearchConfig.neighbourhood must be >= 0 steps, got {steps}")
        out = [p]
        ranges = [range(max(0, i - steps), min(n - 1, i + steps) + 1) for i, n in zip(p, self.shape)]
        for q in itertools.product(*ranges):
            if q == p or sum(abs(a - b) for a, b in zip(q, p)) > steps:
                continue
            if monotone and leq(q, p):
                continue
            out.append(q)
        return out


def leq(a: Point, b: Point) -> bool:
    """a <= b componentwise (b is at least as conservative as a on every axis)."""
    return all(x <= y for x, y in zip(a, b))


def diagonal(lo: Point, hi: Point) -> list[Point]:
    """lo .. hi with every axis advancing by at most one index per step (monotone in quality)."""
    n = [h - l for l, h in zip(lo, hi)]
    L = max(n)
    return [tuple(l + (t * k) // L if L else l for l, k in zip(lo, n)) for t in range(L + 1)]


class MonotoneOracle:
    """Feasibility of cube points (one prune metric), asked one point at a time.

    ``evaluate(p) -> bool`` runs a real trial; answers implied by monotonicity from points asked
    before (p >= a known feasible point, or p <= a known infeasible one) cost nothing.
    """

    def __init__(self, evaluate: Callable[[Point], bool]):
        self._evaluate = evaluate
        self.feasible: list[Point] = []      # asked and found feasible by a trial, in order
        self.infeasible: list[Point] = []    # asked and found infeasible by a trial
        self.asked: dict[Point, bool] = {}   # every answer given, inferred ones included

    def implied(self, p: Point) -> bool | None:
        if p in self.asked:
            return self.asked[p]
        if any(leq(f, p) for f in self.feasible):
            return True
        if any(leq(p, i) for i in self.infeasible):
            return False
        return None

    def __call__(self, p: Point) -> bool:
        v = self.implied(p)
        if v is None:
            v = bool(self._evaluate(p))
            (self.feasible if v else self.infeasible).append(p)
        self.asked[p] = v
        return v


def first_feasible_on(diag: Sequence[Point], oracle: MonotoneOracle) -> int:
    """Index of the first feasible point of a monotone chain (len(diag) if none), by bisection."""
    a, b = 0, len(diag)
    while a < b:
        mid = (a + b) // 2
        if oracle(diag[mid]):
            b = mid
        else:
            a = mid + 1
    return a


def guided_search(lo: Point, hi: Point, oracle: MonotoneOracle) -> list[Point]:
    """Divide-and-conquer over the box [lo, hi] (paper Algorithm 4); returns the feasible points
    found on the diagonals, a superset of the box's minimal feasible points, in discovery order."""
    found: list[Point] = []

    def box(lo: Point, hi: Point) -> None:
        if not leq(lo, hi):
            return
        if oracle.implied(hi) is False:      # even the box's most conservative point fails
            return
        if oracle.implied(lo) is True:       # the box's most aggressive point passes: it wins
            found.append(lo)
            return
        diag = diagonal(lo, hi)
        t = first_feasible_on(diag, oracle)
        if t == len(diag):
            return
        p = diag[t]
        found.append(p)
        if t == 0:
            return
        for mask in itertools.product((0, 1), repeat=len(lo)):
            if all(mask) or not any(mask):   # [p, hi] is dominated by p; [lo, p-1] <= q fails
                continue
            sub_lo = tuple(p[i] if m else lo[i] for i, m in enumerate(mask))
            sub_hi = tuple(hi[i] if m else p[i] - 1 for i, m in enumerate(mask))
            box(sub_lo, sub_hi)

    try:
        box(tuple(lo), tuple(hi))
    finally:
        del box  # a recursive closure is a reference cycle: it would hold the oracle until a gc pass
    return list(dict.fromkeys(found))


# ---------------------------------------------------------------------------------------------
# speculation: what a sequential search will ask next, for parallel rounds

class _Need(Exception):
    def __init__(self, key):
        self.key = key


def speculate(procedure: Callable[[Callable[[Hashable], bool]], object], known: Callable[[Hashable], bool | None],
              width: int, *, max_replays: int = 64) -> list:
    """Up to ``width`` distinct keys a sequential ``procedure`` may ask next, breadth-first over
    its decision tree; the first is the key it needs now. [] when it can finish from ``known``.

    ``procedure(answer)`` must be a pure function of the answers (``answer(key) -> bool``): it is
    replayed with hypothetical answers for the keys ``known`` (the trial cache) cannot answer.
    Evaluating the returned keys and replaying changes nothing but speed: the real run reads the
    same answers in the same order as a one-process run.
    """
    out: list = []
    queue: list[dict] = [{}]
    replays = 0
    while queue and len(out) < width and replays < max_replays:
        hyp = queue.pop(0)
        replays += 1

        def answer(key, hyp=hyp):
            v = known(key)
            if v is None:
                v = hyp.get(key)
            if v is None:
                raise _Need(key)
            return v

        try:
            procedure(answer)
        except _Need as e:
            if e.key not in out:
                out.append(e.key)
            queue += [{**hyp, e.key: True}, {**hyp, e.key: False}]
    return out
