"""The shared shape of every quantizer's output.

A quantizer maps a float tensor to integer codes over ``n_levels`` levels plus what is needed to
map them back. Call order for every quantizer module in this package::

    q = quantize(x, config, ...)   # -> QuantizedTensor
    y = dequantize(q)              # -> float tensor with x's shape and dtype

Codes are kept separate from the codebook so that the delta encoder (codec/delta.py) can work on
the codes of consecutive checkpoints alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..configcheck import Range
from ..errors import ConfigError, NonFiniteError
from ..tensorbytes import FLOAT_DTYPES, narrowest_int

MIN_NUMEL = 1024  # every quantizer config's default ``min_numel``: smaller tensors are left exact
MIN_NUMEL_RANGE = Range(ge=1, note=" (the methods store smaller tensors exact)")


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


def flat32(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached as a flat, contiguous fp32 tensor: a view of the usual fp32 state, where
    detach, to and contiguous are no-ops that still cost ~1 us each (a save asks for every tensor)."""
    if x.dtype is torch.float32 and not x.requires_grad and x.is_contiguous():
        return x.view(-1)
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def flat_float32(x: torch.Tensor, who: str) -> torch.Tensor:
    """x detached, flattened to (n,) fp32 on its device; rejects non-float and non-finite input."""
    if not isinstance(x, torch.Tensor):
        raise ConfigError(f"{who}: expected a torch.Tensor, got {type(x).__name__}")
    if str(x.dtype).removeprefix("torch.") not in FLOAT_DTYPES:
        raise ConfigError(f"{who} quantizes float tensors only, got {x.dtype}; store integer tensors losslessly")
    xf = x.detach().reshape(-1).to(torch.float32)
    if not all_finite(xf):
        raise NonFiniteError(
            f"tensor of shape {tuple(x.shape)} holds inf/NaN (or overflows fp32); {who} needs finite values "
            f"(store it losslessly)"
        )
    return xf


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of float tensor ``x`` is finite once cast to fp32 (an fp64 value beyond
    fp32's range is not). One min/max reduction -- NaN and inf propagate to its result -- which
    costs a tenth of ``isfinite(x).all()`` on CPU (that builds a bool tensor, then reduces it)."""
    if not x.numel():
        return True
    return all(map(math.isfinite, torch.stack(torch.aminmax(x.detach().reshape(-1))).float().tolist()))


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of fp32 ``x`` (a new tensor): the same bits on every machine.
    torch's CPU fp32 sqrt is not correctly rounded and differs by CPU vendor (on an AMD EPYC 20 % of
    values are a last bit off, others on the Intel host that wrote tests/data's golden files), so a
    restored Adam state depended on the machine. numpy's fp32 sqrt is the hardware instruction
    (IEEE: correctly rounded), as is CUDA's sqrtf."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.sqrt(x.detach().to(torch.float32).contiguous().numpy()))
    return torch.sqrt(x.to(torch.float32))


def apply_codebook(codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """codebook[codes] as float32 (plain-torch reference used by every dequantizer)."""
    return codebook.to(torch.float32)[codes.long()]


def compact(codes: torch.Tensor, n_levels: int) -> torch.Tensor:
    """Codes in the narrowest dtype that holds every level (the reference is the method's memory).

    Chosen by ``n_levels``, not by the largest code present: a dequantizer compares codes with its
    top level (protected, outlier), which a narrower dtype could not represent."""
    dtype = narrowest_int(int(n_levels) - 1)
    if codes.dtype == dtype and codes.dim() == 1 and codes.is_cpu and not codes.requires_grad:
        return codes  # the usual case (a save compacts each record's codes more than once): ~1 us
    return codes.detach().reshape(-1).cpu().to(dtype)
