"""Search spaces: which knob values the config search may choose, per method (Inshrinkerator Tables 9-12).

A space is a frozen dataclass whose fields are tuples of allowed values (any order; the user may
pass lists, e.g. from a manifest). It lays itself out as ordered ``Axis`` objects for the cube
(search/cube.py): every axis lists its values from most aggressive (lowest quality) to least, so
that quality is monotone along every axis. A categorical knob that is not ordered in quality
(DynaQuant's prune metric) is a *group*: the search runs once per group value.

    space           method       axes (quality order)                                  group
    DynaQuantSpace  dynaquant    bins, prune_fraction (desc), protect_fraction,        prune_metric
                                 embedding_bins*
    QDSpace         qd           min_bins, max_bins                                    -
    CNRSpace        cnr          bins, step_bins, range_ratio                          -
    GoboSpace       gobo         bins, embedding_bins*, outlier_log_prob               -

Each field of a space is named after the quantizer knob it sets and holds the values that knob may
take (``DynaQuantSpace(bins=(8, 16))`` lets the search choose ``DynaQuantConfig.bins`` among 8 and 16).

    * collapsed to its largest value when the state has no embedding weights.

Monotonicity is exact for bins, pruning, protection and QD's floor/ceiling (more levels never
hurt), and holds in the large for CNR's clipping search (a larger range ratio or a finer step
tries more clipping ranges; the greedy walk may still stop elsewhere) and GOBO's outlier threshold
(a higher log-density threshold keeps more values exact). The search only relies on it for speed:
every chosen config was evaluated for real.

QD pairs with min_bins > max_bins are not configs (UniformConfig refuses them); ``canonical`` maps
them to min_bins = max_bins, which keeps quality monotone over the whole grid and lets the trial
cache answer the duplicates for free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

from ..errors import ConfigError
from ..quant import adaptive, gobo, uniform

PRUNE_METRICS = ("magnitude", "sensitivity")


@dataclass(frozen=True)
class Axis:
    knob: str                 # the config field this axis sets
    values: tuple             # most aggressive first
    embedding: bool = False   # only matters when the state has embedding weights


class Space:
    """Base of every search space: tuple validation, ``from_any``, the default axis layout hooks."""

    group_knob: ClassVar[str | None] = None  # categorical knob searched one value at a time
    int_fields: ClassVar[dict[str, tuple[int, int]]] = {}      # field -> inclusive [lo, hi]
    fraction_fields: ClassVar[tuple[str, ...]] = ()           # fields holding values in [0, 1)
    presets: ClassVar[dict[str, dict]] = {}                    # name -> fields: named, measured variants

    def __post_init__(self):
        name = type(self).__name__
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, str | int | float) or v is None:
                raise ConfigError(f"{name}.{f.name} must be a sequence of values, got {v!r}")
            v = tuple(v)
            if not v:
                raise ConfigError(f"{name}.{f.name} is empty; give at least one value")
            if len(set(v)) != len(v):
                raise ConfigError(f"{name}.{f.name} repeats a value: {v}")
            object.__setattr__(self, f.name, v)
        for fname, (lo, hi) in self.int_fields.items():
            bad = [b for b in getattr(self, fname) if not isinstance(b, int) or isinstance(b, bool) or not lo <= b <= hi]
            if bad:
                raise ConfigError(f"{name}.{fname} must hold ints in [{lo}, {hi}], got {bad}")
        for fname in self.fraction_fields:
            bad = [x for x in getattr(self, fname) if not isinstance(x, int | float) or not 0.0 <= x < 1.0]
            if bad:
                raise ConfigError(f"{name}.{fname} must hold fractions in [0, 1), got {bad}")

    @classmethod
    def from_any(cls, obj) -> "Space":
        """None -> the default space; an instance as is; a dict (e.g. read from a manifest) -> fields;
        a name -> one of the class's ``presets``."""
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, str):
            if obj not in cls.presets:
                raise ConfigError(f"{cls.__name__} has no preset {obj!r}; choose from {sorted(cls.presets)} "
                                  "or give the space's fields as a dict")
            return cls(**cls.presets[obj])
        if isinstance(obj, dict):
            names = {f.name for f in fields(cls)}
            unknown = set(obj) - names
            if unknown:
                raise ConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}; valid: {sorted(names)}")
            return cls(**obj)
        raise ConfigError(f"search space must be a {cls.__name__}, a dict or a preset name, got {type(obj).__name__}")

    @classmethod
    def for_residuals(cls) -> "Space":
        """The default space of residual saves (the weights minus the parent's reconstruction)."""
        return cls()

    def axes(self) -> tuple[Axis, ...]:
        raise NotImplementedError

    def groups(self, gradients=None) -> tuple:
        """Values of ``group_knob`` to search one after the other ((None,) without a group knob)."""
        return (None,)

    def canonical(self, knobs: dict) -> dict:
        """The config a grid point stands for (identity unless some combinations are not configs)."""
        return knobs

    def label(self, knobs: dict) -> str:
        return "/".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in knobs.items())


@dataclass(frozen=True)
class DynaQuantSpace(Space):
    """DynaQuant's space (defaults: the paper's Table 2 / Table 9)."""

    bins: tuple[int, ...] = (4, 6, 8, 12, 16, 32)                       # k, non-embedding layers
    embedding_bins: tuple[int, ...] = (16, 32)                          # k, embedding layers (never pruned)
    prune_fraction: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)  # F_prun per layer type
    prune_metric: tuple[str, ...] = PRUNE_METRICS                       # searched one after the other
    protect_fraction: tuple[float, ...] = (0.0005, 0.005, 0.01)         # F_prot

    group_knob: ClassVar[str] = "prune_metric"
    int_fields: ClassVar[dict] = {"bins": (2, 65533), "embedding_bins": (2, 65533)}
    # "wide": the paper's space plus 2-3 bins and 60-80 % pruning. On the 20-checkpoint GPT-2 chain
    # at 1 %: weights 42.7x against 32.0x, worst checkpoint 0.67 % against 0.38 % (docs/BENCHMARKS.md)
    presets: ClassVar[dict] = {"wide": {"bins": (2, 3, 4, 6, 8, 12, 16, 32),
                                        "prune_fraction": (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)}}
    fraction_fields: ClassVar[tuple] = ("prune_fraction", "protect_fraction")

    def __post_init__(self):
        super().__post_init__()
        bad = [m for m in self.prune_metric if m not in PRUNE_METRICS]
        if bad:
            raise ConfigError(f"DynaQuantSpace.prune_metric may hold {PRUNE_METRICS}, got {bad}")
        if max(self.prune_fraction) + max(self.protect_fraction) >= 1.0:
            raise ConfigError("DynaQuantSpace: max(prune_fraction) + max(protect_fraction) must be < 1")

    @classmethod
    def for_residuals(cls) -> "DynaQuantSpace":
        """A residual is mostly sub-level drift: prune most of it, as ExCP does (up to 95 %; on a
        restored digits run 90 % pruned with 2-4 bins cost under 0.3 % of the loss). A pruned
        residual element is not lost: the next residual, taken against this reconstruction, still
        holds it (error feedback)."""
        return cls(bins=(2, 4, 8, 16, 32), prune_fraction=(0.0, 0.5, 0.8, 0.9, 0.95))

    def axes(self):
        return (Axis("bins", tuple(sorted(self.bins))),
                Axis("prune_fraction", tuple(sorted(self.prune_fraction, reverse=True))),
                Axis("protect_fraction", tuple(sorted(self.protect_fraction))),
                Axis("embedding_bins", tuple(sorted(self.embedding_bins)), embedding=True))

    def groups(self, gradients=None):
        # without gradient EMAs, sensitivity falls back to magnitude: the same configs twice
        return ("magnitude",) if not gradients else self.prune_metric

    def label(self, knobs):
        return (f"k{knobs['bins']}/e{knobs['embedding_bins']}/prune{knobs['prune_fraction']:g}-"
                f"{knobs['prune_metric'][:4]}/prot{knobs['protect_fraction']:g}")


_LEVELS = (2, 1 << 16)


@dataclass(frozen=True)
class QDSpace(Space):
    """QD-Compressor's space (Table 10): the floor and ceiling of the entropy-chosen level count."""

    min_bins: tuple[int, ...] = uniform.SEARCH_SPACE["min_bins"]
    max_bins: tuple[int, ...] = uniform.SEARCH_SPACE["max_bins"]

    int_fields: ClassVar[dict] = {"min_bins": _LEVELS, "max_bins": _LEVELS}

    def __post_init__(self):
        super().__post_init__()
        if min(self.min_bins) > max(self.max_bins):
            raise ConfigError(f"QDSpace: every min_bins exceeds every max_bins ({self.min_bins} vs {self.max_bins})")

    def axes(self):
        return Axis("min_bins", tuple(sorted(self.min_bins))), Axis("max_bins", tuple(sorted(self.max_bins)))

    def canonical(self, knobs):
        return {**knobs, "min_bins": min(knobs["min_bins"], knobs["max_bins"])}


@dataclass(frozen=True)
class CNRSpace(Space):
    """Check-N-Run's space (Table 11): levels, clipping-search step, how far the range may shrink."""

    bins: tuple[int, ...] = adaptive.SEARCH_SPACE["bins"]
    step_bins: tuple[int, ...] = adaptive.SEARCH_SPACE["step_bins"]
    range_ratio: tuple[float, ...] = adaptive.SEARCH_SPACE["range_ratio"]

    int_fields: ClassVar[dict] = {"bins": _LEVELS, "step_bins": (1, 1 << 20)}
    fraction_fields: ClassVar[tuple] = ("range_ratio",)

    def axes(self):
        return (Axis("bins", tuple(sorted(self.bins))), Axis("step_bins", tuple(sorted(self.step_bins))),
                Axis("range_ratio", tuple(sorted(self.range_ratio))))


@dataclass(frozen=True)
class GoboSpace(Space):
    """GOBO's space (Table 12; its max-iteration cap of 1000 is the quantizer's fixed default)."""

    bins: tuple[int, ...] = gobo.SEARCH_SPACE["bins"]
    embedding_bins: tuple[int, ...] = gobo.SEARCH_SPACE["embedding_bins"]
    outlier_log_prob: tuple[float, ...] = gobo.SEARCH_SPACE["outlier_log_prob"]

    int_fields: ClassVar[dict] = {"bins": (1, (1 << 16) - 1), "embedding_bins": (1, (1 << 16) - 1)}

    def __post_init__(self):
        super().__post_init__()
        bad = [x for x in self.outlier_log_prob if not isinstance(x, int | float) or not math.isfinite(x)]
        if bad:
            raise ConfigError(f"GoboSpace.outlier_log_prob must hold finite floats, got {bad}")

    def axes(self):
        return (Axis("bins", tuple(sorted(self.bins))),
                Axis("embedding_bins", tuple(sorted(self.embedding_bins)), embedding=True),
                # a higher log-density threshold keeps more values exact: better quality
                Axis("outlier_log_prob", tuple(sorted(float(x) for x in self.outlier_log_prob))))


def preset_names() -> set[str]:
    """Every preset name of every space class (``SearchConfig.space`` may name one)."""
    found, todo = set(), [Space]
    while todo:
        cls = todo.pop()
        found |= set(cls.presets)
        todo += cls.__subclasses__()
    return found
