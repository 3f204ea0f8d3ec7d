"""DynaQuant quantizer: prune / quantize (approximate k-means) / protect (Inshrinkerator §4).

Every element of a quantizable tensor lands in one of three groups:

- **protected** (kept in bfloat16): the top F_prot/2 by magnitude |theta| UNION the top F_prot/2
  by sensitivity |theta * g_ema| (paper §4.2, tau^m_prot = Q(|Theta|, F_prot/2),
  tau^s_prot = Q(Sens(Theta), F_prot/2)). Protection wins over pruning.
- **pruned** (set to 0): metric < tau_prun = Q(metric, F_prun), metric = magnitude or
  sensitivity. Exact zeros always go here too (they cost nothing and keep log-domain safe).
  Embedding layers are never pruned (paper §5.1).
- **quantized**: the rest, mapped to the nearest of k centers from approximate k-means on a
  log-sketch histogram (sketch.py / kmeans.py, paper Alg. 1-3, sigma-weighted).

Thresholds are quantiles of LogSketches MERGED PER LAYER TYPE (one pruning threshold for all
linear weights, one for all conv weights, ...), as the paper prescribes: per tensor would let
each layer keep a different share, global would cut one layer type's weights for another's
distribution. In a sharded save (ckptzip.dcp) every sketch passes through ``dist.shared_sketch``
keyed by layer type or tensor name, so each shard gets the whole tensor's thresholds and codebook
(dcp/merge.py runs the collectives). Hence two phases::

    plan = fit_layer_thresholds({name: (tensor, layer_type), ...}, DynaQuantConfig(), grads)
    q = quantize(x, name, plan)          # -> QuantizedTensor
    y = dequantize(q)                    # x's shape and dtype

or, the same result for every tensor at once (quant/dqbatch.py: three kernel passes over one
buffer of all the tensors, batched k-means; the per-tensor calls above are its plain-torch
reference and give identical codes, codebooks and side values)::

    plan, qs = quantize_tensors({name: (tensor, layer_type[, role]), ...}, DynaQuantConfig(), grads)

Codes of a value in the quantized group: the nearest center in the config's domain, found by
comparing x with the level boundaries mapped back to x's domain, f^-1((c_j + c_{j+1}) / 2) computed in
float64 and rounded down to float32 (``level_bounds``), so "x > boundary" is exact and the same
compare in every implementation; a value on a boundary takes the lower level.

k-means centers are fitted PER TENSOR by default (``center_scope="tensor"``). The paper applies
Alg. 1 to "the input data points" and notes it uses "the same number of bins across all layers"
(§5.1): the knob shared across layers is k, not the centers. Per-tensor centers cost k floats per
tensor and follow each layer's own scale (layer scales within one type differ several-fold, e.g.
GPT-2's attention vs MLP projections). ``center_scope="layer_type"`` fits one codebook per
layer type from the merged sketch; on our small runs both need the same bins within about one
(bench/table7.py), so per tensor stays the default as the robust choice for models whose layers
of one type differ more.

Codes: 0 = pruned / exact zero, 1..k = bins ordered by value, k+1 = protected; n_levels = k+2.
codebook[0] = 0, codebook[1..k] = centers (fp32, original domain), codebook[k+1] = NaN; the
protected values are side["protected"] (bf16) in index order.

What is not quantized (``is_quantizable``): biases and norm parameters (a tiny share of the
parameters and the most sensitive to error), buffers and step counters, and any tensor with fewer
than ``min_numel`` elements (default 1024: below that, the codebook and side data cost about as
much as the codes save and such tensors are a negligible share of a model). Callers keep those
exact; ``fit_layer_thresholds`` lists them in ``plan.skipped``.

Optimizer state (Adam): the same machinery runs in a value *domain*: k-means and nearest-center
assignment happen on f(x) and the codebook stores f^-1(centers), so dequantize is a plain lookup.
exp_avg_sq (v) spans many orders of magnitude and a linear grid keeps only the largest ones: "log"
(needs x >= 0; exact zeros take the zero level) keeps its relative precision, "sqrt" (signed) is
in between. bench/table7.py measures the relative error of Adam's direction m_hat/(sqrt(v_hat)+eps)
(digits / tiny GPT-2, k=16, mean of 3 checkpoints):

    v quantized alone (m exact):  identity .33/.36   sqrt .28/.18   log .12/.07   (sigma=1)
                                  log with sigma=0.2: .17/.08 (the magnitude term favours large
                                  *weights*; for moments pure frequency weighting is better)
    both quantized:  m as is + v identity  .39/.41     m as is + v log  5.6/.30
                     u = m/(sqrt(v_hat)+eps), decoded as u_q*(sqrt(v_q_hat)+eps), + v log  .086/.093

So the defaults (``config_for_role``): v in "log" with sigma=1 and never pruned (v=0 with m!=0 would
make the update m/eps); m quantized as the normalized u (``normalize_exp_avg`` /
``denormalize_exp_avg``; decode v first), which makes the restored direction exactly
u_q / (1 - beta1^t). Do NOT pair log-domain v with m "as is": an accurate tiny v exposes m's
absolute quantization error (digits: 5.6, i.e. worse than identity v whose rounding-up of tiny v
happens to damp it).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..configcheck import OneOf, Range, check_fields
from ..dist import shared_sketch, sharing
from ..errors import ConfigError
from ..kmeans import INITS
from ..sketch import LogSketch
from ..tensorbytes import dtype_name, torch_dtype
from .base import MIN_NUMEL_RANGE, QuantizedTensor, apply_codebook, flat_float32
from .adam import adam_denominator, adam_direction_error, denormalize_exp_avg, normalize_exp_avg  # noqa: F401
from .dqkernels import dequantize_kernel
from .levels import DOMAINS
from .levels import from_domain as _from_domain
from .levels import histogram_centers, level_bounds
from .levels import to_domain as _to_domain

DESCRIPTOR = "dynaquant/1"
LAYER_TYPES = ("embedding", "linear", "conv", "norm", "bias", "other")
QUANTIZABLE_LAYER_TYPES = frozenset({"embedding", "linear", "conv", "other"})
QUANTIZABLE_ROLES = frozenset({"weight", "exp_avg", "exp_avg_sq", "momentum_buffer", "max_exp_avg_sq"})
# Default domain per role, chosen by the Adam-direction measurement in bench/table7.py.
# exp_avg stays "identity" because it is meant to be quantized as normalize_exp_avg(m, v) (see above).
DEFAULT_DOMAIN = {"exp_avg": "identity", "exp_avg_sq": "log", "max_exp_avg_sq": "log"}
MOMENT_SIGMA = 1.0  # k-means frequency weight for moments (measured better than 0.2, see docstring)
_NONNEG_ROLES = frozenset({"exp_avg_sq", "max_exp_avg_sq"})


@dataclass(frozen=True)
class DynaQuantConfig:
    bins: int = 16                   # k for every non-embedding layer (paper searches 4..32)
    embedding_bins: int = 32         # k for embedding layers, more sensitive (paper: 16 or 32)
    prune_fraction: float = 0.1      # F_prun per layer type (paper searches 0..0.5); embeddings: 0
    prune_metric: str = "magnitude"  # "magnitude" |theta| or "sensitivity" |theta * g_ema|
    protect_fraction: float = 0.005  # F_prot: top F/2 by magnitude UNION top F/2 by sensitivity
    alpha: float = 0.01              # LogSketch relative error (thresholds and k-means histogram)
    sigma: float = 0.2               # k-means bucket weight: sigma*freq + (1-sigma)*|value|
    seed: int = 0                    # k-means++ initialisation seed
    min_numel: int = 1024            # smaller tensors are kept exact (see module docstring)
    domain: str = "identity"         # "identity" | "sqrt" | "log": value space of the k-means
    center_scope: str = "tensor"     # "tensor": centers per tensor; "layer_type": one codebook per type
    kmeans: str = "density"          # k-means seeding (kmeans.py): "density" (deterministic, batched);
                                     # "kmeans++" (Algorithm 3 sampled, greedy, best of 3: 0.1's default)
    max_prune_ratio: float | None = 1.0  # a tensor loses at most this x prune_fraction of its elements;
                                         # None: the paper's plain per-layer-type threshold, which can wipe
                                         # out a small-magnitude layer (e.g. BERT's pooler) entirely

    def __post_init__(self):
        bins, frac = Range(ge=1, le=65533), Range(ge=0, lt=1)
        check_fields(self, bins=bins, embedding_bins=bins, prune_fraction=frac, protect_fraction=frac,
                     prune_metric=OneOf(("magnitude", "sensitivity")), alpha=Range(gt=0, lt=1),
                     sigma=Range(ge=0, le=1), min_numel=MIN_NUMEL_RANGE, domain=OneOf(DOMAINS),
                     center_scope=OneOf(("tensor", "layer_type")), kmeans=OneOf(INITS),
                     max_prune_ratio=Range(ge=1, note=" or None"))
        if self.prune_fraction + self.protect_fraction >= 1.0:
            raise ConfigError("DynaQuantConfig: prune_fraction + protect_fraction must be < 1; lower one of them")

    def bins_for(self, layer_type: str) -> int:
        return self.embedding_bins if layer_type == "embedding" else self.bins


def config_for_role(config: DynaQuantConfig, role: str) -> DynaQuantConfig:
    """The config to use for one tensor role: moments get their measured domain; v is never pruned."""
    if role == "weight":
        return config
    out = replace(config, domain=DEFAULT_DOMAIN.get(role, config.domain), prune_metric="magnitude",
                  sigma=MOMENT_SIGMA)
    if role in _NONNEG_ROLES:
        out = replace(out, prune_fraction=0.0)
    return out


def is_quantizable(layer_type: str, role: str, numel: int, *, min_numel: int = 1024) -> bool:
    """Whether DynaQuant quantizes this tensor; the rest is kept exact by the caller."""
    return layer_type in QUANTIZABLE_LAYER_TYPES and role in QUANTIZABLE_ROLES and numel >= min_numel


# ---------------------------------------------------------------------------------------------
# plan

@dataclass(frozen=True)
class LayerTypePlan:
    """Thresholds (and optionally centers) shared by every tensor of one layer type."""

    layer_type: str
    bins: int
    numel: int                          # elements sketched for this type
    prune_threshold: float | None       # prune where metric < this; None = no pruning
    protect_magnitude: float | None     # protect where |x| > this; None = no magnitude protection
    protect_sensitivity: float | None   # protect where |x*g| > this; None = none / fallback
    sensitivity_fallback: bool          # True: no gradients, sensitivity replaced by magnitude
    centers: torch.Tensor | None = None  # (k,) in the config's domain, for center_scope="layer_type"

    def to_meta(self) -> dict:
        return {"layer_type": self.layer_type, "bins": self.bins, "prune_threshold": self.prune_threshold,
                "protect_magnitude": self.protect_magnitude, "protect_sensitivity": self.protect_sensitivity,
                "sensitivity_fallback": self.sensitivity_fallback}


@dataclass(frozen=True)
class DynaQuantPlan:
    config: DynaQuantConfig
    layer_types: dict[str, LayerTypePlan]
    tensors: dict[str, str]                           # quantizable name -> layer type
    skipped: tuple[str, ...] = ()                      # names the caller must keep exact
    grads: Mapping[str, torch.Tensor] | None = field(default=None, repr=False)  # for sensitivity at quantize
    tensor_prune: dict[str, float] = field(default_factory=dict)  # per-tensor cap on the prune threshold

    def sensitivity_fallback(self, name: str) -> bool:
        return self.layer_types[self.tensors[name]].sensitivity_fallback


def _unpack(spec) -> tuple[torch.Tensor, str, str]:
    if isinstance(spec, torch.Tensor):
        raise ConfigError("fit_layer_thresholds wants name -> (tensor, layer_type[, role]); got a bare tensor")
    t, lt, *rest = spec
    role = rest[0] if rest else "weight"
    if lt not in LAYER_TYPES:
        raise ConfigError(f"layer type {lt!r} is not one of {LAYER_TYPES}")
    return t, lt, role


def _grad_for(name: str, xf: torch.Tensor, grads) -> torch.Tensor | None:
    if grads is None or name not in grads:
        return None
    g = grads[name]
    if g.numel() != xf.numel():
        raise ConfigError(f"{name}: gradient has {g.numel()} elements, tensor has {xf.numel()}")
    return g.detach().reshape(-1).to(xf.device, torch.float32)


def _check_domain(xf: torch.Tensor, name: str, domain: str) -> None:
    if domain == "log" and bool((xf < 0).any()):
        raise ConfigError(f"{name}: domain='log' needs non-negative values (exp_avg_sq); "
                          f"use domain='sqrt' or 'identity' for signed tensors")


def _quantile(sk: LogSketch, q: float) -> float:
    return float(sk.quantile(q))


def prune_cap_quantile(cfg: DynaQuantConfig) -> float | None:
    """The quantile of a tensor's own prune metric that caps its prune threshold (None: no cap):
    a tensor never loses more than max_prune_ratio x F_prun of its elements."""
    if cfg.max_prune_ratio is None or cfg.prune_fraction <= 0:
        return None
    q = min(1.0, cfg.max_prune_ratio * cfg.prune_fraction)
    return q if q < 1.0 else None


def layer_type_plan(lt: str, numel: int, mag_sk: LogSketch, sens_sk: LogSketch | None,
                    cfg: DynaQuantConfig) -> LayerTypePlan:
    """Thresholds of one layer type from its merged |x| (and |x * g|; None: fallback) sketches."""
    fallback = sens_sk is None
    F = cfg.protect_fraction
    tau_m = tau_s = None
    if F > 0:
        if fallback:
            tau_m = _quantile(mag_sk, 1.0 - F)
        else:
            tau_m = _quantile(mag_sk, 1.0 - F / 2)
            tau_s = _quantile(sens_sk, 1.0 - F / 2)
    tau_p = None
    if cfg.prune_fraction > 0 and lt != "embedding":
        use_sens = cfg.prune_metric == "sensitivity" and not fallback
        tau_p = _quantile(sens_sk if use_sens else mag_sk, cfg.prune_fraction)
    return LayerTypePlan(lt, cfg.bins_for(lt), numel, tau_p, tau_m, tau_s, fallback)


def _share_scope(role: str, lt: str, items) -> tuple:
    """What a layer-type sketch covers when shards of the tensors live on several ranks
    (dist.shared_sketch): weights merge per layer type over the whole state, other roles (fitted
    per tensor) over the tensors of this call."""
    return ("type", "weight", lt) if role == "weight" else ("tensors", role, *sorted(n for n, _ in items))


def fit_layer_thresholds(tensors: Mapping[str, tuple], config: DynaQuantConfig = DynaQuantConfig(),
                         grads: Mapping[str, torch.Tensor] | None = None) -> DynaQuantPlan:
    """Sketch every quantizable tensor, merged per layer type, into pruning/protection thresholds.

    tensors: name -> (tensor, layer_type) or (tensor, layer_type, role) (role defaults to
    "weight"; call once per role, since weights and moments have unrelated distributions).
    grads: name -> g_ema (GradientRecorder.gradients()); a layer type with any tensor lacking a
    gradient falls back to magnitude for sensitivity (``sensitivity_fallback``; its protection is
    then the top F_prot by magnitude, so the protected share is kept). On CPU the sketches come
    from the batched kernels (quant/dqbatch.py); ``fit_layer_thresholds_reference`` is the same
    plan in plain torch.
    """
    from .dqbatch import Sketched, fast_path

    if fast_path(_unpack(s)[0] for s in tensors.values()):
        return Sketched(tensors, config, grads).plan(config)
    return fit_layer_thresholds_reference(tensors, config, grads)


def fit_layer_thresholds_reference(tensors: Mapping[str, tuple], config: DynaQuantConfig = DynaQuantConfig(),
                                   grads: Mapping[str, torch.Tensor] | None = None) -> DynaQuantPlan:
    """``fit_layer_thresholds`` in plain torch, one LogSketch per tensor (any device)."""
    cfg = config
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    roles: dict[str, str] = {}
    skipped = []
    for name, spec in tensors.items():
        t, lt, role = _unpack(spec)
        if not is_quantizable(lt, role, t.numel(), min_numel=cfg.min_numel):
            skipped.append(name)
            continue
        groups.setdefault(lt, []).append((name, t))
        roles.setdefault(lt, role)

    plans: dict[str, LayerTypePlan] = {}
    cap_q = prune_cap_quantile(cfg)
    tensor_prune: dict[str, float] = {}
    for lt, items in groups.items():
        fallback = grads is None or any(n not in grads for n, _ in items)
        mag_sk = LogSketch(alpha=cfg.alpha)
        sens_sk = None if fallback else LogSketch(alpha=cfg.alpha)
        for name, t in items:
            xf = flat_float32(t, f"DynaQuant ({name})")
            _check_domain(xf, name, cfg.domain)
            t_mag = LogSketch(alpha=cfg.alpha).add(xf.abs(), name=name)  # per tensor, merged per type
            mag_sk.merge(t_mag)
            t_sens = None
            if sens_sk is not None:
                t_sens = LogSketch(alpha=cfg.alpha).add((xf * _grad_for(name, xf, grads)).abs(), name=name)
                sens_sk.merge(t_sens)
            if cap_q is not None and lt != "embedding":
                use_sens = cfg.prune_metric == "sensitivity" and t_sens is not None
                sk = t_sens if use_sens else t_mag
                sk = shared_sketch(("sensitivity" if use_sens else "magnitude", "tensor", name), sk)
                tensor_prune[name] = _quantile(sk, cap_q)
        scope = _share_scope(roles[lt], lt, items)
        mag_sk = shared_sketch(("magnitude", *scope), mag_sk)
        if sens_sk is not None:
            sens_sk = shared_sketch(("sensitivity", *scope), sens_sk)
        plans[lt] = layer_type_plan(lt, mag_sk.count, mag_sk, sens_sk, cfg)

    plan = DynaQuantPlan(cfg, plans, {n: lt for lt, items in groups.items() for n, _ in items},
                         tuple(skipped), grads, tensor_prune)
    if cfg.center_scope == "layer_type":
        plans = dict(plans)
        for lt, items in groups.items():
            sk = LogSketch(alpha=cfg.alpha)
            for name, t in items:
                xf = flat_float32(t, f"DynaQuant ({name})")
                part = _partition(xf, name, plan)
                vals = xf[part == 1]
                sk.add(vals, name=name)
            sk = shared_sketch(("values", *_share_scope(roles[lt], lt, items)), sk)
            centers = torch.empty(0) if sk.count == 0 else _sketch_centers(sk, plans[lt].bins, cfg)
            plans[lt] = replace(plans[lt], centers=torch.as_tensor(centers, dtype=torch.float32).reshape(-1))
        plan = replace(plan, layer_types=plans)
    return plan


# ---------------------------------------------------------------------------------------------
# quantize / dequantize

def _partition(xf: torch.Tensor, name: str, plan: DynaQuantPlan) -> torch.Tensor:
    """(n,) int8: 0 = pruned / exact zero, 1 = quantized, 2 = protected."""
    ltp = plan.layer_types[plan.tensors[name]]
    mag = xf.abs()
    sens = None if ltp.sensitivity_fallback else _grad_for(name, xf, plan.grads)
    if sens is not None:
        sens = (xf * sens).abs()
    protected = torch.zeros_like(xf, dtype=torch.bool)
    if ltp.protect_magnitude is not None:
        protected |= mag > ltp.protect_magnitude
    if ltp.protect_sensitivity is not None and sens is not None:
        protected |= sens > ltp.protect_sensitivity
    pruned = xf == 0
    if ltp.prune_threshold is not None:
        metric = sens if (plan.config.prune_metric == "sensitivity" and sens is not None) else mag
        pruned |= metric < min(ltp.prune_threshold, plan.tensor_prune.get(name, math.inf))
    part = torch.ones_like(xf, dtype=torch.int8)
    part[pruned] = 0
    part[protected] = 2  # protection wins over pruning
    return part


def _sketch_centers(sk: LogSketch, k: int, cfg: DynaQuantConfig) -> torch.Tensor:
    """Algorithm 1 in the config's domain: the sketch is built on original values (so its buckets
    keep the alpha-relative bound), its bucket representatives are mapped by f and clustered there.
    Mapping buckets rather than sketching f(x) keeps log-domain resolution at log(gamma) ~ 2 alpha;
    a sketch of log v would have relative error alpha on |log v| (~0.2 for v ~ 1e-9)."""
    return histogram_centers(sk._ord, sk._counts, torch.tensor([0, sk._ord.numel()]), k, cfg)[0]


def _fit_centers(vals: torch.Tensor, k: int, cfg: DynaQuantConfig, name: str | None = None) -> torch.Tensor:
    """(m <= k,) sorted centers in the config's domain for one tensor's quantized values."""
    if vals.numel() <= k and not sharing():  # no more values than bins: every value its own center
        return _to_domain(torch.unique(vals), cfg.domain).to(torch.float32)
    sk = LogSketch(alpha=cfg.alpha).add(vals)
    if name is not None:  # a shard's values: the codebook comes from every shard of the tensor
        sk = shared_sketch(("values", "tensor", name), sk)
    if sk.count == 0:
        return torch.empty(0, dtype=torch.float32, device=vals.device)
    return _sketch_centers(sk, k, cfg).to(vals.device)


def quantize(x: torch.Tensor, name: str, plan: DynaQuantPlan) -> QuantizedTensor:
    """Quantize one tensor that ``plan`` was fitted on (see module docstring for the levels).
    Codes are int64. On CPU the kernels of quant/dqbatch.py run; ``quantize_reference`` is the
    same result in plain torch (any device)."""
    from .dqbatch import Sketched, fast_path

    _check_planned(name, plan)
    if not fast_path([x]):
        return quantize_reference(x, name, plan)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name}: DynaQuant quantizes float tensors, got {getattr(x, 'dtype', type(x))}")
    grads = {name: plan.grads[name]} if plan.grads is not None and name in plan.grads else None
    q = Sketched({name: (x, plan.tensors[name])}, plan.config, grads, quantizable=True).quantize(plan)[name]
    q.codes = q.codes.long()
    return q


def _check_planned(name: str, plan: DynaQuantPlan) -> None:
    if name not in plan.tensors:
        why = "is kept exact (not quantizable)" if name in plan.skipped else "was not in fit_layer_thresholds"
        raise ConfigError(f"{name}: {why}; store it losslessly or refit the plan with it")


def quantize_reference(x: torch.Tensor, name: str, plan: DynaQuantPlan) -> QuantizedTensor:
    """``quantize`` in plain torch, one tensor at a time (the reference of the batched kernels)."""
    _check_planned(name, plan)
    cfg = plan.config
    lt = plan.tensors[name]
    ltp = plan.layer_types[lt]
    xf = flat_float32(x, f"DynaQuant ({name})")
    _check_domain(xf, name, cfg.domain)
    part = _partition(xf, name, plan)
    qmask = part == 1
    vals = xf[qmask]
    if ltp.centers is not None:
        centers_f = ltp.centers.to(xf.device)
    else:
        centers_f = _fit_centers(vals, ltp.bins, cfg, name)
    k = int(centers_f.numel())
    codes = torch.zeros(xf.numel(), dtype=torch.int64, device=xf.device)
    if vals.numel():
        if k == 0:
            raise ConfigError(f"{name}: the layer-type codebook is empty but the tensor has values to quantize")
        codes[qmask] = torch.searchsorted(level_bounds(centers_f, cfg.domain).to(xf.device), vals) + 1
    pmask = part == 2
    codes[pmask] = k + 1
    centers = _from_domain(centers_f.to(torch.float64), cfg.domain).to(torch.float32)
    codebook = torch.cat([torch.zeros(1, device=xf.device), centers.to(xf.device),
                          torch.full((1,), float("nan"), device=xf.device)])
    meta = {"descriptor": DESCRIPTOR, "domain": cfg.domain, "k": k, "center_scope": cfg.center_scope,
            "prune_metric": cfg.prune_metric, "n_pruned": int((part == 0).sum()),
            "n_protected": int(pmask.sum()), **ltp.to_meta()}
    return QuantizedTensor(codes=codes, n_levels=k + 2, codebook=codebook, shape=tuple(x.shape),
                           dtype=dtype_name(x.dtype), side={"protected": xf[pmask].to(torch.bfloat16)},
                           meta=meta)


def quantize_tensors(tensors: Mapping[str, tuple], config: DynaQuantConfig = DynaQuantConfig(),
                     grads: Mapping[str, torch.Tensor] | None = None, *, threads: int | None = None):
    """``fit_layer_thresholds`` + ``quantize`` of every quantizable tensor in one batched pass:
    (plan, {name: QuantizedTensor}) with the same codes (narrow dtype), codebooks and side values
    as the per-tensor calls. See quant/dqbatch.py."""
    from .dqbatch import quantize_tensors as batched

    return batched(tensors, config, grads, threads=threads)


def dequantize(q: QuantizedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Codebook lookup with the protected values put back; x's shape and dtype, or written into
    ``out`` (q's shape, any float dtype; returned). On CPU one numba pass
    (``dqkernels.dequantize_kernel``), straight into a float32 ``out``; ``dequantize_reference`` is
    the same in plain torch and raises its errors."""
    direct = out is not None and out.dtype == torch.float32 == torch_dtype(q.dtype) and out.device.type == "cpu" \
        and out.is_contiguous()  # a narrower record is rounded to its dtype first, as dequantize(q) is
    if out is not None and tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"dynaquant: out has shape {tuple(out.shape)}, the quantized tensor {tuple(q.shape)}")
    if dequantize_kernel is None or q.codes.device.type != "cpu":
        y = dequantize_reference(q)
        return y if out is None else out.copy_(y)
    if out is not None and not direct:
        return out.copy_(dequantize(q))
    codes = q.codes.reshape(-1).contiguous()
    flat = torch.empty(codes.numel(), dtype=torch.float32) if out is None else out.detach().view(-1)
    if flat.numel() != codes.numel():  # the kernel writes one value per code: never past ``out``
        raise ValueError(f"dynaquant: {codes.numel()} codes for a tensor of shape {tuple(q.shape)}")
    prot = q.side.get("protected")
    prot = np.zeros(0, np.float32) if prot is None else prot.reshape(-1).to("cpu", torch.float32).numpy()
    used = dequantize_kernel(codes.numpy(), q.codebook.to("cpu", torch.float32).contiguous().numpy(),
                             q.n_levels - 1, prot, flat.numpy())
    if used != prot.shape[0]:
        return dequantize_reference(q)  # the reference names what is wrong
    return out if out is not None else flat.reshape(q.shape).to(torch_dtype(q.dtype))


def dequantize_reference(q: QuantizedTensor) -> torch.Tensor:
    """``dequantize`` in plain torch (any device)."""
    out = apply_codebook(q.codes, q.codebook.to(q.codes.device))
    pmask = q.codes == q.n_levels - 1
    prot = q.side.get("protected")
    n_prot = int(pmask.sum())
    if n_prot:
        if prot is None or prot.numel() != n_prot:
            raise ValueError(f"dynaquant: {n_prot} protected codes but "
                             f"{0 if prot is None else prot.numel()} protected values")
        out[pmask] = prot.to(out.device, torch.float32)
    return out.reshape(q.shape).to(torch_dtype(q.dtype))
