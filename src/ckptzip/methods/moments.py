"""Optimizer moments in the quantizing methods (dynaquant, qd, cnr, gobo): one recipe for all four.

Codec ``"normalized"`` (v0.1's recipe, the default): per parameter (``FlatState.params()``),
v = exp_avg_sq is quantized in the log domain (k-means on the log-sketch histogram, never pruned);
Adam's m = exp_avg is divided by the denominator sqrt(v_hat) + eps of the *decoded* v before it is
quantized, and the decoder multiplies it back, so the restored update direction carries only m's
own error (quant/dynaquant.py measures why); SGD momentum is quantized as it is. Tensors that are
small, non-finite or of a norm/bias layer stay exact. Codec ``"exact"`` keeps every moment exact.

Call order (methods/quantizing.py)::

    quantized = quantize_moments(state, config)                  # record -> QuantizedTensor
    ... the template stores them (qrecord.store, a cyclic delta against ``prev.codes`` if config.delta)
    ref = MomentReference(codes) if config.delta else None        # what the next save deltas against
    ...
    ref = decode_moments(encoded, records, prev, out, config)    # fills out[name] for every moment record

Record meta of a normalized exp_avg: ``adam`` = {"v": record of v, "step", "beta1", "beta2", "eps"}:
the decoder rebuilds m from the decoded v with these, so a file decodes without the skeleton.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from ..errors import ConfigError, CorruptCheckpointError
from ..quant import dynaquant as dq
from ..quant.base import MIN_NUMEL, QuantizedTensor
from ..state import FlatState, TensorRecord
from . import qrecord
from .base import Encoded

MOMENT_CODECS = ("normalized", "exact")
_QUANTIZED_ROLES = ("exp_avg_sq", "exp_avg", "momentum_buffer")  # v first: m is normalized by the decoded v


@dataclass(frozen=True)
class MomentConfig:
    codec: str = "normalized"        # see the module docstring; "exact": moments stored losslessly
    bins: int = 16                   # k-means levels per moment tensor
    delta: bool = False              # cyclic code deltas against the previous save (moments change wholesale)
    protect_fraction: float = 0.005  # largest values kept in bf16, as for weights
    alpha: float = 0.01              # LogSketch relative accuracy
    min_numel: int = MIN_NUMEL       # smaller moment tensors stay exact

    def __post_init__(self):
        if self.codec not in MOMENT_CODECS:
            raise ConfigError(f"MomentConfig.codec must be one of {MOMENT_CODECS}, got {self.codec!r}")
        self.quantizer("exp_avg")  # validates bins, protect_fraction, alpha, min_numel

    def quantizer(self, role: str) -> dq.DynaQuantConfig:
        """The DynaQuant quantizer config for one moment role (log domain for v, never pruned)."""
        cfg = dq.DynaQuantConfig(bins=self.bins, embedding_bins=self.bins, prune_fraction=0.0,
                                 protect_fraction=self.protect_fraction, alpha=self.alpha, min_numel=self.min_numel)
        return dq.config_for_role(cfg, "exp_avg" if role == "momentum_buffer" else role)


@dataclass(frozen=True)
class MomentReference:
    """The moment codes of the previous save (kept only when ``MomentConfig.delta``)."""

    codes: Mapping[str, qrecord.Codes]

    def tensors(self) -> Iterator[torch.Tensor]:
        return (c.codes for c in self.codes.values())


def quantize_moments(state: FlatState, config: MomentConfig) -> dict[str, QuantizedTensor]:
    """The moment records this codec quantizes (the rest of the optimizer state stays exact)."""
    out: dict[str, QuantizedTensor] = {}
    if config.codec == "exact":
        return out
    for view in state.params().values():
        for role in _QUANTIZED_ROLES:
            name = view.moments.get(role)
            if name is None:
                continue
            rec, t = state.records[name], state.tensors[name]
            if not (rec.is_float and t.numel() >= config.min_numel and bool(torch.isfinite(t).all())):
                continue
            x, adam = t, None
            vname = view.moments.get("exp_avg_sq")
            if role == "exp_avg" and vname in out and view.adam and view.step >= 1:
                (b1, b2), eps = view.hparams.betas, view.hparams.eps
                # normalize by the *decoded* v, as the decoder will
                x = t.float() / dq.adam_denominator(dq.dequantize(out[vname]), view.step, (b1, b2), eps)
                adam = {"v": vname, "step": view.step, "beta1": b1, "beta2": b2, "eps": eps}
            lt = rec.layer_type if rec.layer_type in dq.LAYER_TYPES else "other"
            plan = dq.fit_layer_thresholds({name: (x, lt, "exp_avg" if role == "momentum_buffer" else role)},
                                           config.quantizer(role))
            if name not in plan.tensors:
                continue  # a norm / bias parameter's moments: exact
            q = dq.quantize(x, name, plan)
            q.dtype = rec.dtype
            q.codes = qrecord.compact(q.codes, q.n_levels)
            if adam is not None:
                q.meta["adam"] = adam
            out[name] = q
    return out


def decode_moments(encoded: Encoded, records: Mapping[str, TensorRecord], prev: MomentReference | None,
                   out: dict[str, torch.Tensor], config: MomentConfig) -> MomentReference | None:
    """Decode every quantized moment record into ``out`` (v before the m normalized by it)."""
    codes, pending_m = {}, []
    for name, rec in records.items():
        meta = encoded.records[name]["meta"]
        # a normalized exp_avg decodes to u in fp32 first, then m = u * denominator(v)
        q = qrecord.load(encoded, name, rec.shape, "float32" if "adam" in meta else rec.dtype,
                         prev.codes.get(name) if prev is not None else None)
        try:
            out[name] = dq.dequantize(q)
        except ValueError as e:
            raise CorruptCheckpointError(f"record {name!r}: {e}") from None
        if "adam" in meta:
            pending_m.append((name, rec, meta["adam"]))
        codes[name] = qrecord.Codes(qrecord.compact(q.codes, q.n_levels), q.n_levels)
    for name, rec, a in pending_m:
        v = out.get(a.get("v")) if isinstance(a, dict) else None
        if v is None or v.shape != out[name].shape:
            raise CorruptCheckpointError(f"record {name!r} is normalized by {a.get('v') if isinstance(a, dict) else a!r}, "
                                         "which the file lacks or which has another shape")
        try:
            out[name] = dq.denormalize_exp_avg(out[name], v, a["step"], (a["beta1"], a["beta2"]), a["eps"],
                                               dtype=getattr(torch, rec.dtype))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"record {name!r} has malformed Adam metadata ({e})") from None
    return MomentReference(codes) if config.delta else None
