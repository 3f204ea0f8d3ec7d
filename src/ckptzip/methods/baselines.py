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

Like ``dynaquant``, each baseline runs the config search (search/) when the caller gives
``eval_fn``: the paper extends Inshrinkerator's search to all baselines (section 8.2), over the
spaces of its Tables 10-12 (search/spaces.py: ``QDSpace``, ``CNRSpace``, ``GoboSpace``). The
config's own quantizer knobs are then only the defaults used without ``eval_fn``.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields, replace

import torch

from ..errors import ConfigError
from ..quant import adaptive, gobo, uniform
from ..quant import dynaquant as dq
from ..quant.base import QuantizedTensor
from ..search.spaces import CNRSpace, GoboSpace, QDSpace
from ..state import FlatState, TensorRecord
from . import qrecord
from .base import DecodeContext, EncodeContext, Encoded, Reference, encode_exact, register
from .dynaquant import decode_quantized, quantize_moments, weight_records
from .searching import SearchConfig, SearchingMethod


@dataclass(frozen=True)
class _BaselineConfig(SearchConfig):
    """Knobs every baseline shares; subclasses add their quantizer's knobs, ``space_cls`` and
    ``quantizer()``."""

    moment_bins: int = 16         # optimizer moments: DynaQuant's moment recipe at this many bins
    optimizer: str = "quantize"   # "quantize" | "lossless"
    min_numel: int = 1024         # smaller tensors are stored exact

    def __post_init__(self):
        super().__post_init__()
        if self.optimizer not in ("quantize", "lossless"):
            raise ConfigError(f"optimizer must be 'quantize' or 'lossless', got {self.optimizer!r}")
        self.quantizer()  # validates the quantizer's knobs


@dataclass(frozen=True)
class QDConfig(_BaselineConfig):
    min_bins: int = 8             # Table 10: entropy picks the bins between these
    max_bins: int = 256

    space_cls = QDSpace

    def quantizer(self):
        return uniform.UniformConfig(min_bins=self.min_bins, max_bins=self.max_bins)


@dataclass(frozen=True)
class CNRConfig(_BaselineConfig):
    n_bins: int = 16              # Table 11 knobs
    n_step_bins: int = 100
    range_ratio: float = 0.2

    space_cls = CNRSpace

    def quantizer(self):
        return adaptive.AdaptiveConfig(n_bins=self.n_bins, n_step_bins=self.n_step_bins, range_ratio=self.range_ratio)


@dataclass(frozen=True)
class GoboMethodConfig(_BaselineConfig):
    n_bins: int = 8               # Table 12 knobs
    n_bins_embedding: int = 16
    outlier_log_prob: float = -4.0

    space_cls = GoboSpace

    def quantizer(self):
        return gobo.GoboConfig(n_bins=self.n_bins, n_bins_embedding=self.n_bins_embedding,
                               outlier_log_prob=self.outlier_log_prob)


_SEARCH_FIELDS = {f.name for f in fields(SearchConfig)}


class _BaselineMethod(SearchingMethod):
    """Shared encode/decode; subclasses say how to quantize one weight and whether to delta."""

    delta: bool = False
    module = None

    def quantize_weight(self, x: torch.Tensor, rec: TensorRecord, cfg: _BaselineConfig) -> QuantizedTensor:
        return self.module.quantize(x, cfg.quantizer())

    def _quantize(self, state: FlatState, cfg: _BaselineConfig) -> dict[str, QuantizedTensor]:
        return {n: self.quantize_weight(state.tensors[n], r, cfg) for n, r in self.search_records(state).items()}

    # --- config search hooks (methods/searching.py) --------------------------------------------
    def search_records(self, state: FlatState) -> dict[str, TensorRecord]:
        return weight_records(state, dq.DynaQuantConfig(min_numel=self.config.min_numel))

    def search_quantize(self, state: FlatState, knobs: dict, gradients) -> dict[str, QuantizedTensor]:
        return self._quantize(state, replace(self.config, **knobs))

    def search_dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        return self.module.dequantize(q)

    # --------------------------------------------------------------------------------------------
    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        t0 = time.perf_counter()
        knobs, search_info = self.choose_knobs(state, reference, ctx)
        search_s = time.perf_counter() - t0
        cfg = replace(self.config, **knobs) if knobs else self.config
        prev = reference.data if (reference is not None and self.delta) else {}
        enc = Encoded(keyframe=reference is None or not self.delta)
        quantized = self._quantize(state, cfg)
        if cfg.optimizer == "quantize":
            quantized.update(quantize_moments(state, dq.DynaQuantConfig(min_numel=cfg.min_numel), cfg.moment_bins))
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
        enc.meta["summary"] = {**{k: v for k, v in asdict(cfg).items()
                                  if k not in ("optimizer", "min_numel") and k not in _SEARCH_FIELDS},
                               **search_info, "search_s": round(search_s, 3)}
        self.remember_search(enc.meta)
        return enc, Reference(ctx.step, codes_ref)

    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        return decode_quantized(records, encoded, reference, ctx, self.module.dequantize)


@register
class QDMethod(_BaselineMethod):
    name, version, config_cls, module, delta = "qd", 1, QDConfig, uniform, True
    search_coding = "delta"  # Huffman on the plain cyclic delta (no rearrangement)


@register
class CNRMethod(_BaselineMethod):
    name, version, config_cls, module = "cnr", 1, CNRConfig, adaptive
    search_coding = "plain"


@register
class GoboMethod(_BaselineMethod):
    name, version, config_cls, module = "gobo", 1, GoboMethodConfig, gobo
    search_coding = "plain"

    def quantize_weight(self, x, rec, cfg):
        return gobo.quantize(x, cfg.quantizer(), embedding=rec.layer_type == "embedding")
