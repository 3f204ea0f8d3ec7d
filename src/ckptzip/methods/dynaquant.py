"""Method ``dynaquant``: DynaQuant / Inshrinkerator (quantizer + quantization-aware delta encoder).

Per checkpoint:
1. choose a quantizer config: the user's fixed one, or (with ``eval_fn``) the config search of
   search/ against the quality threshold;
2. weights: partition per layer type (prune / quantize / protect, thresholds from merged
   LogSketches), approximate weighted k-means codes (quant/dynaquant.py);
3. Adam moments (``optimizer="quantize"``): v = exp_avg_sq in the log domain; m = exp_avg
   normalized by Adam's denominator sqrt(v_hat)+eps before quantization and rebuilt from the
   *decoded* v, so the restored update direction carries only m's own error (measured in
   bench/table7.py); SGD momentum as is. Moments are never pruned;
4. codes: cyclic delta against the previous checkpoint's codes (B = the larger level count),
   rearranged by source bucket, run-length + Huffman (codec/entropy.py); keyframes without delta;
5. everything else (biases, norms, small tensors, buffers, step counts) exact.

Record layout (quantized): methods/qrecord.py -- ``codes`` (self-describing code stream),
``codebook`` (fp32: 0, centers..., NaN for the protected level), ``side.protected`` (bf16 values in
index order); meta ``n_levels``, ``domain``, the layer type's thresholds, and for normalized
exp_avg ``adam`` = {"v": record of v, "step", "beta1", "beta2", "eps"}.
The reference kept between saves is the integer codes of every quantized record.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, replace

import torch

from ..errors import ConfigError, CorruptCheckpointError
from ..quant import dynaquant as dq
from ..quant.base import QuantizedTensor
from ..search.spaces import SearchSpace
from ..state import FlatState, TensorRecord
from . import qrecord
from .base import DecodeContext, EncodeContext, Encoded, Reference, decode_exact, encode_exact, is_exact, register
from .searching import SearchConfig, SearchingMethod

_OPT_RE = re.compile(r"^optimizer/state/(\d+)/(\w+)$")


@dataclass(frozen=True)
class DynaQuantMethodConfig(SearchConfig):
    # quantizer knobs (the config search overrides these per checkpoint when eval_fn is given)
    bins: int = 16                   # k for non-embedding layers
    embedding_bins: int = 32         # k for embedding layers (never pruned)
    prune_fraction: float = 0.1      # F_prun per layer type
    prune_metric: str = "magnitude"  # "magnitude" | "sensitivity"
    protect_fraction: float = 0.005  # F_prot (half by magnitude, half by sensitivity)
    alpha: float = 0.01              # LogSketch relative accuracy
    sigma: float = 0.2               # k-means weight: sigma*frequency + (1-sigma)*magnitude
    min_numel: int = 1024            # smaller tensors are stored exact
    # optimizer state
    optimizer: str = "quantize"      # "quantize" (Adam m/v, momentum) | "lossless"
    moment_bins: int = 16            # k for optimizer moments
    # delta encoder
    coder: str = "auto"              # "auto" (per tensor, see methods/qrecord.choose_coder) | "huffman" | "ans" | "zstd"
    rearrange: bool = True           # group deltas by source bucket before RLE (paper section 6.3); fixed coders only
    rle: bool = True                 # fixed coders only; coder="huffman" with both is the paper's encoder
    delta_moments: bool = False      # moments change wholesale between saves: delta only helps weights
    # config search (SearchConfig's fields: search, search_policy, search_neighbourhood, search_space)

    space_cls = SearchSpace

    def __post_init__(self):
        super().__post_init__()
        if self.optimizer not in ("quantize", "lossless"):
            raise ConfigError(f"optimizer must be 'quantize' or 'lossless', got {self.optimizer!r}")
        if self.coder not in ("auto", "huffman", "ans", "zstd"):
            raise ConfigError(f"coder must be 'auto', 'huffman', 'ans' or 'zstd', got {self.coder!r}")
        self.quantizer()  # validates the quantizer knobs

    def quantizer(self, **overrides) -> dq.DynaQuantConfig:
        q = dq.DynaQuantConfig(bins=self.bins, embedding_bins=self.embedding_bins,
                               prune_fraction=self.prune_fraction, prune_metric=self.prune_metric,
                               protect_fraction=self.protect_fraction, alpha=self.alpha, sigma=self.sigma,
                               min_numel=self.min_numel)
        return replace(q, **overrides) if overrides else q


QUANTIZER_KNOBS = ("bins", "embedding_bins", "prune_fraction", "prune_metric", "protect_fraction")


def weight_records(state: FlatState, cfg: dq.DynaQuantConfig) -> dict[str, TensorRecord]:
    """The weight records DynaQuant quantizes (float, quantizable layer type, large enough)."""
    return {n: r for n, r in state.records.items()
            if r.role == "weight" and r.is_float and dq.is_quantizable(r.layer_type, "weight", r.numel,
                                                                        min_numel=cfg.min_numel)
            and bool(torch.isfinite(state.tensors[n]).all())}


def quantize_weights(state: FlatState, cfg: dq.DynaQuantConfig, gradients=None) -> dict[str, QuantizedTensor]:
    """Quantize every DynaQuant-quantizable weight of ``state`` under ``cfg`` (used by the search too)."""
    recs = weight_records(state, cfg)
    if not recs:
        return {}
    grads = None
    if gradients:
        grads = {n: gradients[r.param] for n, r in recs.items() if r.param in gradients}
    _, qs = dq.quantize_tensors({n: (state.tensors[n], r.layer_type, "weight") for n, r in recs.items()}, cfg, grads)
    return {n: _narrow(q) for n, q in qs.items()}


def _narrow(q: QuantizedTensor) -> QuantizedTensor:
    """Keep codes in the narrowest dtype between quantizing and encoding: int64 codes for the
    whole state at once would peak at 2x the state's size (measured at 100M params)."""
    q.codes = qrecord.compact(q.codes)
    return q


def _adam_hparams(state: FlatState) -> dict[int, tuple[float, float, float]]:
    """optimizer param index -> (beta1, beta2, eps) from the skeleton's param_groups (Adam family)."""
    out = {}
    opt = state.skeleton.get("optimizer") if isinstance(state.skeleton, dict) else None
    for g in (opt or {}).get("param_groups", []) if isinstance(opt, dict) else []:
        betas = g.get("betas") if isinstance(g, dict) else None
        if isinstance(betas, dict) and betas.get("__t") == "tuple":
            betas = betas["v"]
        if isinstance(betas, list) and len(betas) == 2 and isinstance(g.get("eps"), float | int):
            for i in g.get("params", []):
                out[int(i)] = (float(betas[0]), float(betas[1]), float(g["eps"]))
    return out


def quantize_moments(state: FlatState, qcfg: dq.DynaQuantConfig, moment_bins: int) -> dict[str, QuantizedTensor]:
    """Quantize optimizer moments: v in the log domain, Adam's m normalized by the decoded v's
    denominator (rebuilt by the decoder), SGD momentum as is; never pruned."""
    hp = _adam_hparams(state)
    by_param: dict[int, dict[str, str]] = {}
    for name in state.records:
        m = _OPT_RE.match(name)
        if m:
            by_param.setdefault(int(m.group(1)), {})[m.group(2)] = name
    out: dict[str, QuantizedTensor] = {}
    mcfg = replace(qcfg, bins=moment_bins, embedding_bins=moment_bins,
                   prune_fraction=0.0)
    for idx, names in by_param.items():
        for role in ("exp_avg_sq", "exp_avg", "momentum_buffer"):
            name = names.get(role)
            if name is None:
                continue
            rec, t = state.records[name], state.tensors[name]
            if not (rec.is_float and t.numel() >= qcfg.min_numel and bool(torch.isfinite(t).all())):
                continue
            cfg = dq.config_for_role(mcfg, role if role != "momentum_buffer" else "exp_avg")
            x = t
            adam = None
            vname, sname = names.get("exp_avg_sq"), names.get("step")
            if role == "exp_avg" and vname in out and sname and idx in hp:
                step = float(state.tensors[sname])
                if step >= 1:
                    b1, b2, eps = hp[idx]
                    # normalize by the *decoded* v, as the decoder will
                    v_q = dq.dequantize(out[vname])
                    x = t.float() / dq.adam_denominator(v_q, step, (b1, b2), eps)
                    adam = {"v": vname, "step": step, "beta1": b1, "beta2": b2, "eps": eps}
            plan = dq.fit_layer_thresholds({name: (x, rec.layer_type if rec.layer_type in dq.LAYER_TYPES
                                                    else "other", role if role != "momentum_buffer"
                                                    else "exp_avg")}, cfg)
            if name not in plan.tensors:
                continue
            q = dq.quantize(x, name, plan)
            q.dtype = rec.dtype
            if adam is not None:
                q.meta["adam"] = adam
            out[name] = _narrow(q)
    return out


def decode_moment(out: dict, name: str, rec: TensorRecord, adam: dict) -> None:
    """m = u * (sqrt(v_hat) + eps) with the decoded v (see quantize_moments)."""
    v = out.get(adam["v"])
    if v is None:
        raise CorruptCheckpointError(f"record {name!r} needs {adam['v']!r}, which the file lacks")
    out[name] = dq.denormalize_exp_avg(out[name], v, adam["step"], (adam["beta1"], adam["beta2"]), adam["eps"],
                                       dtype=getattr(torch, rec.dtype))


@register
class DynaQuantMethod(SearchingMethod):
    name = "dynaquant"
    version = 1
    config_cls = DynaQuantMethodConfig
    uses_gradients = True  # the search tries both prune metrics

    # ----------------------------------------------------------------------------------------
    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        c = self.config
        prev = reference.data if reference is not None else {}
        enc = Encoded(keyframe=reference is None)
        t0 = time.perf_counter()
        knobs, search_info = self.choose_knobs(state, reference, ctx)
        qcfg = c.quantizer(**knobs)
        search_s = time.perf_counter() - t0
        quantized = quantize_weights(state, qcfg, ctx.gradients)
        if c.optimizer == "quantize":
            quantized.update(quantize_moments(state, qcfg, c.moment_bins))
        codes_ref: dict[str, qrecord.CodesRef] = {}
        for name, rec in state.records.items():
            q = quantized.get(name)
            if q is None:
                encode_exact(enc, name, state.tensors[name])
                continue
            is_moment = rec.role != "weight"
            p = prev.get(name) if (not is_moment or c.delta_moments) else None
            meta = {k: v for k, v in q.meta.items() if k in ("domain", "k", "n_pruned", "n_protected", "adam",
                                                             "prune_threshold", "sensitivity_fallback")}
            codes_ref[name] = qrecord.store(enc, name, q, p, method="dynaquant/1", coder=c.coder,
                                            rearrange=c.rearrange, rle=c.rle, meta=meta)
        enc.meta["summary"] = {**{k: getattr(qcfg, k) for k in QUANTIZER_KNOBS}, **search_info,
                               "search_s": round(search_s, 3)}
        self.remember_search(enc.meta)
        return enc, Reference(ctx.step, codes_ref)

    # --- config search hooks (methods/searching.py) --------------------------------------------
    def search_records(self, state: FlatState) -> dict[str, TensorRecord]:
        return weight_records(state, self.config.quantizer())

    def search_quantize(self, state: FlatState, knobs: dict, gradients) -> dict[str, QuantizedTensor]:
        return quantize_weights(state, self.config.quantizer(**knobs), gradients)

    def search_dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        return dq.dequantize(q)

    # ----------------------------------------------------------------------------------------
    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        return decode_quantized(records, encoded, reference, ctx, dq.dequantize)


def decode_quantized(records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
                     ctx: DecodeContext, dequantize_weight) -> tuple[dict[str, torch.Tensor], Reference]:
    """Decode a file of exact and quantized records (dynaquant and the baselines): weights with
    ``dequantize_weight``, moments with DynaQuant's recipe (v first, then m from the decoded v)."""
    prev = reference.data if reference is not None else {}
    out: dict[str, torch.Tensor] = {}
    codes_ref = {}
    pending_m = []
    for name, rec in records.items():
        if is_exact(encoded, name):
            out[name] = decode_exact(encoded, name, rec)
            continue
        meta = encoded.records[name]["meta"]
        # a normalized exp_avg decodes to u in fp32 first, then m = u * denominator(v)
        q = qrecord.load(encoded, name, rec.shape, "float32" if "adam" in meta else rec.dtype, prev.get(name))
        try:
            out[name] = (dequantize_weight if rec.role == "weight" else dq.dequantize)(q)
        except ValueError as e:
            raise CorruptCheckpointError(f"record {name!r}: {e}") from None
        if "adam" in meta:
            pending_m.append((name, rec, meta["adam"]))
        codes_ref[name] = (qrecord.compact(q.codes), q.n_levels)
    for name, rec, a in pending_m:
        decode_moment(out, name, rec, a)
    return {n: t.to(ctx.device) for n, t in out.items()}, Reference(ctx.step, codes_ref)
