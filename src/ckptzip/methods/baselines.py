"""The paper's three baselines as chain methods: ``qd``, ``cnr``, ``gobo`` (Inshrinkerator §8.2, A.2).

- ``qd`` (QD-Compressor, "Uniform"): entropy-based variable bit-width uniform quantization, cyclic
  deltas of the codes with B = the larger level count of the two checkpoints (the paper's fix for
  bins that change between checkpoints), Huffman coding. No rearrangement, no run-length stage.
- ``cnr`` (Check-N-Run, "Adaptive"): greedy clipping-range search + uniform codes; no delta.
- ``gobo`` (GOBO, "KMeans"): Gaussian outliers kept in fp32, L1 k-means on the rest; no delta.

All three run on the quantizing-method template (methods/quantizing.py): weights are chosen exactly
as for ``dynaquant`` (linear / conv / embedding / other weights with at least ``min_numel``
elements), everything else is exact, and so that the comparison is about the weight quantizers,
optimizer moments go through the same recipe as ``dynaquant`` (methods/moments.py). Their codes are
coded by their own papers' encoders (``PAPER_BASELINE_CODES``: Huffman, no rearrangement or RLE).

Like ``dynaquant``, each runs the config search (search/) when the caller gives ``eval_fn``, over the
space of its Table 10-12 (search/spaces.py: ``QDSpace``, ``CNRSpace``, ``GoboSpace``); the config's
own quantizer knobs are then only the defaults used without ``eval_fn``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..quant import adaptive, gobo, uniform
from ..search.spaces import CNRSpace, GoboSpace, QDSpace
from .base import register
from .quantizing import PAPER_BASELINE_CODES, CodesConfig, QuantizingMethod, QuantizingMethodConfig, upgrade_v1_config


@dataclass(frozen=True)
class QDMethodConfig(QuantizingMethodConfig):
    quantizer: uniform.UniformConfig = field(default_factory=uniform.UniformConfig)
    codes: CodesConfig = PAPER_BASELINE_CODES


@dataclass(frozen=True)
class CNRMethodConfig(QuantizingMethodConfig):
    quantizer: adaptive.AdaptiveConfig = field(default_factory=adaptive.AdaptiveConfig)
    codes: CodesConfig = PAPER_BASELINE_CODES


@dataclass(frozen=True)
class GoboMethodConfig(QuantizingMethodConfig):
    quantizer: gobo.GoboConfig = field(default_factory=gobo.GoboConfig)
    codes: CodesConfig = PAPER_BASELINE_CODES


class _Baseline(QuantizingMethod):
    version = 2
    module = None  # the quantizer module: quantize(x, config) / dequantize(q)

    def quantize_weights(self, state, records, qconfig, gradients):
        return ((n, self.module.quantize(state.tensors[n], qconfig)) for n in records)

    def dequantize_weight(self, q):
        return self.module.dequantize(q)

    @classmethod
    def upgrade_config(cls, config: dict, version: int) -> dict:
        return upgrade_v1_config(config)


@register
class QDMethod(_Baseline):
    name, config_cls, space_cls, module, delta_weights = "qd", QDMethodConfig, QDSpace, uniform, True


@register
class CNRMethod(_Baseline):
    name, config_cls, space_cls, module, delta_weights = "cnr", CNRMethodConfig, CNRSpace, adaptive, False


@register
class GoboMethod(_Baseline):
    name, config_cls, space_cls, module, delta_weights = "gobo", GoboMethodConfig, GoboSpace, gobo, False

    def quantize_weights(self, state, records, qconfig, gradients):
        return ((n, gobo.quantize(state.tensors[n], qconfig, embedding=r.layer_type == "embedding"))
                for n, r in records.items())
