"""The paper's three baselines as chain methods: ``qd``, ``cnr``, ``gobo`` (Inshrinkerator §8.2, A.2).

- ``qd`` (QD-Compressor, "Uniform"): entropy-based variable bit-width uniform quantization, cyclic
  deltas of the codes with B = the larger level count of the two checkpoints (the paper's fix for
  bins that change between checkpoints), Huffman coding. No rearrangement, no run-length stage.
- ``cnr`` (Check-N-Run, "Adaptive"): greedy clipping-range search + uniform codes; no delta.
- ``gobo`` (GOBO, "KMeans"): Gaussian outliers kept in fp32, L1 k-means on the rest; no delta.

Weights the quantizer covers are chosen exactly as for ``dynaquant`` (linear / conv / embedding /
other weights with at least ``min_numel`` elements); everything else is exact. So that the
comparison is about the weight quantizers, optimizer moments go through the same moment recipe as
``dynaquant`` (``optimizer="quantize"``) or stay exact (``"lossless"``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..errors import ConfigError
from ..quant import adaptive, gobo, uniform
from ..quant import dynaquant as dq
from ..state import FlatState, TensorRecord
from . import qrecord
from .base import DecodeContext, EncodeContext, Encoded, Method, Reference, encode_exact, register
from .dynaquant import decode_quantized, quantize_moments, weight_records


@dataclass(frozen=True)
class _BaselineConfig:
    """Knobs every baseline shares; subclasses add their quantizer's knobs and ``quantizer()``."""

    moment_bins: int = 16         # optimizer moments: DynaQuant's moment recipe at this many bins
    optimizer: str = "quantize"   # "quantize" | "lossless"
    min_numel: int = 1024         # smaller tensors are stored exact

    def __post_init__(self):
        if self.optimizer not in ("quantize", "lossless"):
            raise ConfigError(f"optimizer must be 'quantize' or 'lossless', got {self.optimizer!r}")
        self.quantizer()  # validates the quantizer's knobs


@dataclass(frozen=True)
class QDConfig(_BaselineConfig):
    min_bins: int = 8             # Table 10: entropy picks the bins between these
    max_bins: int = 256

    def quantizer(self):
        return uniform.UniformConfig(min_bins=self.min_bins, max_bins=self.max_bins)


@dataclass(frozen=True)
class CNRConfig(_BaselineConfig):
    n_bins: int = 16              # Table 11 knobs
    n_step_bins: int = 100
    range_ratio: float = 0.2

    def quantizer(self):
        return adaptive.AdaptiveConfig(n_bins=self.n_bins, n_step_bins=self.n_step_bins, range_ratio=self.range_ratio)


@dataclass(frozen=True)
class GoboMethodConfig(_BaselineConfig):
    n_bins: int = 8               # Table 12 knobs
    n_bins_embedding: int = 16
    outlier_log_prob: float = -4.0

    def quantizer(self):
        return gobo.GoboConfig(n_bins=self.n_bins, n_bins_embedding=self.n_bins_embedding,
                               outlier_log_prob=self.outlier_log_prob)


class _BaselineMethod(Method):
    """Shared encode/decode; subclasses say how to quantize one weight and whether to delta."""

    delta: bool = False
    module = None

    def quantize_weight(self, x: torch.Tensor, rec: TensorRecord):
        return self.module.quantize(x, self.config.quantizer())

    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        cfg = self.config
        prev = reference.data if (reference is not None and self.delta) else {}
        enc = Encoded(keyframe=reference is None or not self.delta)
        sel = dq.DynaQuantConfig(min_numel=cfg.min_numel)
        quantized = {n: self.quantize_weight(state.tensors[n], r) for n, r in weight_records(state, sel).items()}
        if cfg.optimizer == "quantize":
            quantized.update(quantize_moments(state, sel, cfg.moment_bins))
        codes_ref = {}
        for name, rec in state.records.items():
            q = quantized.get(name)
            if q is None:
                encode_exact(enc, name, state.tensors[name])
                continue
            p = prev.get(name) if rec.role == "weight" else None
            meta = {"adam": q.meta["adam"]} if "adam" in q.meta else {}
            codes_ref[name] = qrecord.store(enc, name, q, p, method=self.descriptor, rearrange=False, rle=False,
                                            meta=meta)
        enc.meta["summary"] = {k: v for k, v in asdict(cfg).items() if k not in ("optimizer", "min_numel")}
        return enc, Reference(ctx.step, codes_ref)

    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        return decode_quantized(records, encoded, reference, ctx, self.module.dequantize)


@register
class QDMethod(_BaselineMethod):
    name, version, config_cls, module, delta = "qd", 1, QDConfig, uniform, True


@register
class CNRMethod(_BaselineMethod):
    name, version, config_cls, module = "cnr", 1, CNRConfig, adaptive


@register
class GoboMethod(_BaselineMethod):
    name, version, config_cls, module = "gobo", 1, GoboMethodConfig, gobo

    def quantize_weight(self, x, rec):
        return gobo.quantize(x, self.config.quantizer(), embedding=rec.layer_type == "embedding")
