"""Method ``dynaquant``: DynaQuant / Inshrinkerator (quantizer + quantization-aware delta encoder).

Per checkpoint (the loop is methods/quantizing.py, shared with the baselines):
1. choose a quantizer config: the user's fixed one, or (with ``eval_fn``) the config search of
   search/ against the quality threshold, over ``DynaQuantSpace`` (the paper's Table 9);
2. weights: partition per layer type (prune / quantize / protect, thresholds from merged
   LogSketches), approximate weighted k-means codes (quant/dynaquant.py);
3. optimizer moments: methods/moments.py;
4. codes: cyclic delta against the previous checkpoint's codes (B = the larger level count),
   rearranged by source bucket, run-length + Huffman or ANS (``codes.coder="auto"`` picks per
   tensor, methods/qrecord.py); keyframes without delta;
5. everything else (biases, norms, small tensors, buffers, step counts) exact.

Record layout (quantized): methods/qrecord.py -- ``codes`` (self-describing code stream),
``codebook`` (fp32: 0, centers..., NaN for the protected level), ``side.protected`` (bf16 values in
index order); meta ``n_levels``, ``domain``, the layer type's thresholds.

Versions: 2 nests the quantizer's config (``{"quantizer": {...}, "moments": ..., "codes": ...,
"search": ...}``); files of version 1 (v0.1, flat config) decode unchanged (``upgrade_config``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..quant import dynaquant as dq
from ..search.spaces import DynaQuantSpace
from .base import register
from .quantizing import QuantizingMethod, QuantizingMethodConfig, upgrade_v1_config


@dataclass(frozen=True)
class DynaQuantMethodConfig(QuantizingMethodConfig):
    quantizer: dq.DynaQuantConfig = field(default_factory=dq.DynaQuantConfig)
    residual: str = "restored"  # "never": the paper's re-quantization (methods/quantizing.py)


@register
class DynaQuantMethod(QuantizingMethod):
    name = "dynaquant"
    version = 2
    config_cls = DynaQuantMethodConfig
    space_cls = DynaQuantSpace
    delta_weights = True
    uses_gradients = True  # the search tries both prune metrics
    finds_nonfinite = True  # quantize_tensors' sketch pass raises NonFiniteError

    def quantize_weights(self, state, records, qconfig, gradients):
        tensors, grads = _weights(state, records, gradients)
        return iter(dq.quantize_tensors(tensors, qconfig, grads)[1].items())  # one batched pass

    def search_prepare(self, state, reference, gradients):
        """The search's per-checkpoint batch: every weight sketched once, candidates estimated from
        the histograms, only evaluated ones quantized (quant/dqsearch.py)."""
        from ..quant.dqbatch import fast_path
        from ..quant.dqsearch import SearchSketch

        tensors, grads = _weights(self.targets(state), self.search_records(state), gradients)
        if not fast_path(t for t, _, _ in tensors.values()):
            return None  # CUDA, or shards sharing sketches (dcp): quantize per candidate
        return SearchSketch(tensors, self.config.quantizer, grads, getattr(reference, "weights", None),
                            self.search_coding)

    def dequantize_weight(self, q):
        return dq.dequantize(q)

    def dequantize_weight_into(self, q, out):
        dq.dequantize(q, out=out)

    @classmethod
    def upgrade_config(cls, config: dict, version: int) -> dict:
        return upgrade_v1_config(config)


def _weights(state, records, gradients):
    """(name -> (tensor, layer type, "weight"), name -> gradient EMA or None) for the quantizer."""
    grads = {n: gradients[r.param] for n, r in records.items() if r.param in gradients} if gradients else None
    return {n: (state.tensors[n], r.layer_type, "weight") for n, r in records.items()}, grads
