"""The shared shape of every quantizer's output.

A quantizer maps a float tensor to integer codes over ``n_levels`` levels plus what is needed to
map them back. Call order for every quantizer module in this package::

    q = quantize(x, config, ...)   # -> QuantizedTensor
    y = dequantize(q)              # -> float tensor with x's shape and dtype

Codes are kept separate from the codebook so that the delta encoder (codec/delta.py) can work on
the codes of consecutive checkpoints alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError

MIN_NUMEL = 1024  # every quantizer config's default ``min_numel``: smaller tensors are left exact


@dataclass
class QuantizedTensor:
    codes: torch.Tensor                 # (n,) int64 in [0, n_levels), flat row-major order
    n_levels: int                       # number of distinct code values this tensor may use
    codebook: torch.Tensor              # (n_levels,) float32 value of each level; NaN where a level has
                                        # no single value (e.g. DynaQuant's "protected" level)
    shape: tuple[int, ...]              # original shape
    dtype: str                          # original dtype name ("float32", "bfloat16", ...)
    side: dict[str, torch.Tensor] = field(default_factory=dict)  # extra tensors (protected values, ...)
    meta: dict = field(default_factory=dict)                      # JSON-able facts (thresholds used, ...)

    @property
    def numel(self) -> int:
        return int(self.codes.numel())


def apply_codebook(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """codebook[codes] as float32 (plain-torch reference used by every dequantizer)."""
    return codebook.to(torch.float32)[codes.long()]


def check_min_numel(config) -> None:
    """Validate a quantizer config's ``min_numel`` (the methods store smaller tensors exact)."""
    v = config.min_numel
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{type(config).__name__}.min_numel must be an int >= 1, got {v!r}")
