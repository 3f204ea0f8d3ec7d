"""Optimizer moments in the quantizing methods (dynaquant, qd, cnr, gobo): one codec for all four.

Codecs (``MomentConfig.codec``), each measured in docs/BENCHMARKS.md ("Optimizer state"):

- ``"grid"`` (the default): quant/moments.py. Adam's v as its update denominator on a fixed log
  grid (levels shared by every checkpoint, so v's codes are cyclic deltas against the parent's
  levels; a keyframe may code them as residuals of row + column effects), Adam's m as the
  direction m / D at ``grid.m_bits`` bits with a bf16 scale per group, SGD momentum the same way
  without D. Records below.
- ``"normalized"`` (v0.1's recipe, readable in every file 0.1 wrote): v quantized in the log domain
  by k-means, m divided by the *decoded* v's denominator before k-means and multiplied back by the
  decoder, SGD momentum as it is (quant/dynaquant.py); records are the method's M.2 records.
- ``"exact"``: every moment exact.

Every codec keeps exact what it does not know: the state of a parameter that is neither Adam-family
(exp_avg and exp_avg_sq, betas, eps, a step >= 1) nor SGD (a momentum_buffer and ``momentum`` in
its param group) -- Adagrad's sum, AMSGrad's max_exp_avg_sq, Lion's exp_avg, ... -- and tensors that
are small (``grid.min_numel``; normalized: ``min_numel`` and no norm / bias layers), not float or
not finite. ``ckptzip inspect`` lists what was kept exact. The grid codec codes the moments of
biases and norms too: kept exact they cost a GPT-2 chain a fifth of its moment bytes.

Grid records (pipelines ``moment-grid/1, [cyclic-delta/1,] ans/1`` and ``moment-direction/1[, ans/1]``,
layout of methods/qrecord.py):

- v: codes = absolute grid levels c (D = eps * 2**(c * step)), or zigzag residuals c - row_i - col_j
  with int16 ``side.row`` / ``side.col`` (meta ``factored``); no codebook (meta ``codebook: false``);
  meta ``step`` (log2 units per level) and ``adam`` = {step, beta1, beta2, eps}.
- m: codes into the level table (codebook), ``side.scale`` bf16 per ``group`` elements; meta
  ``bits``, ``group``, ``prune``, ``normalized`` and ``v`` (the v record whose D multiplies it);
  ``zero: true`` and no blobs when m is not stored (``m_bits=0``). SGD momentum: ``normalized`` false.

Call order (methods/quantizing.py)::

    plan = plan_moments(state, config, prev, marker=..., codes=...)  # record -> MomentItem
    codes_m[name] = store_moment(batch, name, plan[name])             # in record order (qrecord.RecordBatch)
    batch.flush()
    ref = MomentReference(codes_m) if config.deltas(...) else None    # what the next save deltas against
    ...
    ref = decode_moments(encoded, records, prev, out, deltas)         # v records first, then m
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from ..codec import stages as S
from ..configcheck import OneOf, Range, check_fields
from ..errors import ConfigError, CorruptCheckpointError, NonFiniteError
from ..quant import dynaquant as dq
from ..quant import moments as M
from ..quant.base import MIN_NUMEL, MIN_NUMEL_RANGE, QuantizedTensor, all_finite
from ..state import FlatState, ParamView, TensorRecord
from ..tensorbytes import torch_dtype
from . import qrecord
from .base import Encoded

MOMENT_CODECS = ("grid", "normalized", "exact")
_QUANTIZED_ROLES = ("exp_avg_sq", "exp_avg", "momentum_buffer")  # v first: m is normalized by the decoded v
# measured: an order-0 coder on the plain delta beats RLE + Huffman on v's codes; "auto" also packs
# long enough streams of few levels (tuple/1: the direction codes' 3, v's deltas in pairs)
_GRID_CODER = ("auto", False, False)


@dataclass(frozen=True)
class MomentConfig:
    codec: str = "grid"              # see the module docstring; "exact": moments stored losslessly
    grid: M.GridCodec = field(default_factory=M.GridCodec)  # codec "grid"
    bins: int = 16                   # codec "normalized": k-means levels per moment tensor
    delta: bool = False              # codec "normalized": cyclic code deltas against the previous save
    protect_fraction: float = 0.005  # codec "normalized": largest values kept in bf16, as for weights
    alpha: float = 0.01              # codec "normalized": LogSketch relative accuracy
    min_numel: int = MIN_NUMEL       # codec "normalized": smaller moment tensors stay exact

    def __post_init__(self):
        check_fields(self, codec=OneOf(MOMENT_CODECS), bins=Range(ge=1, le=65533),
                     protect_fraction=Range(ge=0, lt=1), alpha=Range(gt=0, lt=1), min_numel=MIN_NUMEL_RANGE)

    def deltas(self, weights_delta: bool) -> bool:
        """Whether moment records are deltas against the previous save: grid's v levels in a method
        whose weights delta (cnr and gobo files stay keyframes), normalized's codes with ``delta``."""
        return (self.codec == "grid" and weights_delta) or (self.codec == "normalized" and self.delta)

    def quantizer(self, role: str) -> dq.DynaQuantConfig:
        """The DynaQuant quantizer config for one moment role (log domain for v, never pruned)."""
        cfg = dq.DynaQuantConfig(bins=self.bins, embedding_bins=self.bins, prune_fraction=0.0,
                                 protect_fraction=self.protect_fraction, alpha=self.alpha, min_numel=self.min_numel)
        return dq.config_for_role(cfg, "exp_avg" if role == "momentum_buffer" else role)


@dataclass(frozen=True)
class MomentReference:
    """The moment codes of the previous save (grid: v's absolute levels; normalized: with ``delta``)."""

    codes: Mapping[str, qrecord.Codes]

    def tensors(self) -> Iterator[torch.Tensor]:
        return (c.codes for c in self.codes.values())


@dataclass
class MomentItem:
    """One moment record to store: its quantized tensor and how the record holds it."""

    q: QuantizedTensor | None             # None: a record without bytes (m not stored)
    marker: str                           # the record's first stage
    meta: dict
    prev: qrecord.Codes | None = None     # the parent's codes a delta is taken against
    coder: tuple[str, bool, bool] = _GRID_CODER
    keep: bool = False                    # the stored codes go into the next reference
    levels: qrecord.Codes | None = None   # ... or these (grid v: absolute levels, whatever was stored)
    pack: bool = False                    # the parts in one blob (grid records: fewer header bytes)
    steps: bool = False                   # a delta moves its codes a step or two (grid v: packed in pairs)


# ---------------------------------------------------------------------------------------------
# encode

def plan_moments(state: FlatState, config: MomentConfig, prev: MomentReference | None, *, marker: str,
                 codes) -> dict[str, MomentItem]:
    """The moment records this codec stores (the rest of the optimizer state stays exact).
    ``marker``: the method's M.2 record stage (codec normalized); ``codes``: its CodesConfig."""
    if config.codec == "exact":
        return {}
    if config.codec == "normalized":
        return {name: MomentItem(q, marker, {k: v for k, v in q.meta.items() if k in qrecord.RECORD_META},
                                 prev.codes.get(name) if prev is not None and config.delta else None,
                                 (codes.coder, codes.rearrange, codes.rle), keep=config.delta)
                for name, q in quantize_normalized(state, config).items()}
    out = {}
    # residuals of row + column effects on keyframes only; built once (a replace() validates the config)
    grids = (config.grid, replace(config.grid, factored=False) if config.grid.factored else config.grid)
    adam = []
    for view in state.params().values():
        n = config.grid.min_numel
        # Adam's moments are checked finite once a batch (_plan_adam), the rest one by one
        if _codable(state, view, "exp_avg", n, False) and _codable(state, view, "exp_avg_sq", n, False) and view.adam \
                and view.step >= 1 and state.records[view.moments["exp_avg"]].shape == \
                state.records[view.moments["exp_avg_sq"]].shape:
            adam.append(view)
        elif set(view.moments) == {"momentum_buffer"} and view.hparams is not None \
                and view.hparams.momentum is not None and _codable(state, view, "momentum_buffer", n):
            name = view.moments["momentum_buffer"]
            q = M.quantize_m(state.tensors[name], None, bits=config.grid.sgd_bits, group=config.grid.group)
            q.codes = qrecord.compact(q.codes, q.n_levels)
            out[name] = MomentItem(q, S.MOMENT_DIRECTION.descriptor, _direction_meta(q), pack=True)
    return {**_plan_adam(state, adam, grids, prev), **out}


def _codable(state: FlatState, view: ParamView, role: str, min_numel: int, finite: bool = True) -> bool:
    """Whether the codec takes this moment (``finite``: and checks it finite here)."""
    name = view.moments.get(role)
    if name is None:
        return False
    rec, t = state.records[name], state.tensors[name]
    return rec.is_float and t.numel() >= min_numel and (not finite or all_finite(t))


def _plan_adam(state: FlatState, views: list[ParamView], grids: tuple[M.GridCodec, M.GridCodec],
               prev: MomentReference | None) -> dict[str, MomentItem]:
    """grids: (the codec for a keyframe of v, for a delta of v). The moments of all parameters
    with the same codec are encoded in one batch (quant/moments.encode_pairs_levels)."""
    parents = {}
    for view in views:
        vname = view.moments["exp_avg_sq"]
        p = prev.codes.get(vname) if prev is not None else None
        parents[vname] = p if p is not None and p.codes.numel() == state.tensors[vname].numel() else None
    out = {}
    for grid, batch in ((g, b) for delta, g in ((False, grids[0]), (True, grids[1]))
                        for b in _batches([w for w in views if (parents[w.moments["exp_avg_sq"]] is not None) == delta],
                                          state)):
        hps = [M.AdamHP(w.step, *w.hparams.betas, w.hparams.eps) for w in batch]
        pairs = [(state.tensors[w.moments["exp_avg"]], state.tensors[w.moments["exp_avg_sq"]], hp)
                 for w, hp in zip(batch, hps)]
        try:  # one finite check over the batch's values (52 per-tensor checks cost a small save ~1 ms)
            coded = M.encode_pairs_levels(pairs, grid)
        except NonFiniteError:  # rare: the moments that hold inf/NaN stay exact, the rest are coded
            finite = [i for i, (m, v, _) in enumerate(pairs) if all_finite(m) and all_finite(v)]
            if len(finite) == len(pairs):
                raise
            batch, hps, pairs = ([x[i] for i in finite] for x in (batch, hps, pairs))
            coded = M.encode_pairs_levels(pairs, grid)
        for view, hp, (qm, qv, levels) in zip(batch, hps, coded):
            out.update(_adam_items(view, hp, grid, qm, qv, levels, parents[view.moments["exp_avg_sq"]]))
    return {name: out[name] for view in views for name in (view.moments["exp_avg_sq"], view.moments["exp_avg"])
            if name in out}


BATCH_NUMEL = 1 << 20  # moment elements per batch: small tensors share passes, the temporaries stay small


def _batches(views: list[ParamView], state: FlatState) -> Iterator[list[ParamView]]:
    """Consecutive runs of ``views`` of up to BATCH_NUMEL moment elements (a larger tensor alone):
    a batch's fp32 and int64 temporaries are ~40 bytes per element, all of them at once would
    exceed the save's memory budget (1.5x the state) on a large model."""
    batch, size = [], 0
    for view in views:
        n = state.tensors[view.moments["exp_avg"]].numel()
        if batch and size + n > BATCH_NUMEL:
            yield batch
            batch, size = [], 0
        batch.append(view)
        size += n
    if batch:
        yield batch


def _adam_items(view: ParamView, hp: M.AdamHP, grid: M.GridCodec, qm: QuantizedTensor | None, qv: QuantizedTensor,
                levels: torch.Tensor, p: qrecord.Codes | None) -> dict[str, MomentItem]:
    """The two records of one Adam parameter's encoded moments."""
    mname, vname = view.moments["exp_avg"], view.moments["exp_avg_sq"]
    # every moment is planned before any is stored: int64 codes of all of them would peak at 2x the state
    # (v's codes and levels come narrowed already)
    if qm is not None:
        qm.codes = qrecord.compact(qm.codes, qm.n_levels)
    if qv.meta["factored"]:
        ref = qrecord.Codes(levels, int(levels.max()) + 1 if levels.numel() else 1)
    else:  # the stored codes are the absolute levels
        ref = qrecord.Codes(qv.codes, qv.n_levels)
    adam = {"step": hp.step, "beta1": hp.beta1, "beta2": hp.beta2, "eps": hp.eps}
    return {vname: MomentItem(qv, S.MOMENT_GRID.descriptor, {"step": grid.v_step, "factored": qv.meta["factored"],
                                                             "adam": adam}, p, levels=ref, pack=True,
                             steps=not qv.meta["factored"]),
            mname: MomentItem(None, S.MOMENT_DIRECTION.descriptor, {"zero": True, "v": vname}) if qm is None else
            MomentItem(qm, S.MOMENT_DIRECTION.descriptor, {**_direction_meta(qm), "v": vname}, pack=True)}


def _direction_meta(q: QuantizedTensor) -> dict:
    return {k: q.meta[k] for k in ("bits", "group", "prune", "normalized")}


def store_moment(batch: qrecord.RecordBatch, name: str, item: MomentItem) -> qrecord.Codes | None:
    """Add record ``name`` to ``batch.enc``; returns what the next save's delta of it is taken against
    (or None). Its codes are coded at ``batch.flush()``."""
    if item.q is None:
        batch.enc.add(name, [item.marker], item.meta)
        return None
    coder, rearrange, rle = item.coder
    c = batch.store(name, item.q, item.prev, method=item.marker, coder=coder, rearrange=rearrange, rle=rle,
                    meta=item.meta, pack=item.pack, steps=item.steps)
    return item.levels if item.levels is not None else c if item.keep else None


def quantize_normalized(state: FlatState, config: MomentConfig) -> dict[str, QuantizedTensor]:
    """Codec "normalized" (v0.1's recipe): the moment records it quantizes."""
    out: dict[str, QuantizedTensor] = {}
    for view in state.params().values():
        for role in _QUANTIZED_ROLES:
            if not _codable(state, view, role, config.min_numel):
                continue
            name = view.moments[role]
            rec, t = state.records[name], state.tensors[name]
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


# ---------------------------------------------------------------------------------------------
# decode

def decode_moments(encoded: Encoded, records: Mapping[str, TensorRecord], prev: MomentReference | None,
                   out: dict[str, torch.Tensor], deltas: bool,
                   weight_shapes: Mapping[str, tuple] | None = None) -> MomentReference | None:
    """Decode every moment record of ``records`` into ``out`` (in record order): each m record as soon
    as the v record whose denominator scales it is decoded. ``deltas``: MomentConfig.deltas for this
    method (whether the next file's moments are deltas against this one); ``weight_shapes``:
    parameter -> its weight's shape, to refuse a moment record inconsistent with its weight."""
    codes, grid_v, pending = {}, {}, []
    # a v record's (D, levels, d_table) is kept only until the last direction record that names it is decoded
    # (each m right after its v, or at once when its v came first): holding every v's float32 D to
    # the end was 4 bytes an element of every exp_avg_sq at the restore's peak
    users, waiting, directions = Counter(), {}, {}
    for name in records:
        r = encoded.records[name]
        if r["pipeline"][0] == S.MOMENT_DIRECTION.descriptor and isinstance(r["meta"].get("v"), str):
            users[r["meta"]["v"]] += 1

    def direction(name: str, rec: TensorRecord) -> None:
        v = encoded.records[name]["meta"].get("v")
        directions[name] = _load_direction(encoded, name, rec, grid_v)
        if isinstance(v, str) and users[v]:
            users[v] -= 1
            if not users[v]:
                grid_v.pop(v, None)

    for name, rec in records.items():
        shape = (weight_shapes or {}).get(rec.param)
        if shape is not None and tuple(shape) != tuple(rec.shape):
            raise CorruptCheckpointError(f"record {name!r} has shape {list(rec.shape)} but its weight "
                                         f"{rec.param!r} has {list(shape)}: the file is inconsistent")
        marker = encoded.records[name]["pipeline"][0]
        parent = prev.codes.get(name) if prev is not None else None
        if marker == S.MOMENT_GRID.descriptor:
            out[name], grid_v[name], codes[name] = _load_v(encoded, name, rec, parent)
            for m in waiting.pop(name, ()):
                direction(*m)
        elif marker == S.MOMENT_DIRECTION.descriptor:
            pending.append((name, rec))
            v = encoded.records[name]["meta"].get("v")
            if isinstance(v, str) and v not in grid_v:
                waiting.setdefault(v, []).append((name, rec))
            else:
                direction(name, rec)
        else:  # codec "normalized": the method's M.2 record
            meta = encoded.records[name]["meta"]
            # a normalized exp_avg decodes to u in fp32 first, then m = u * denominator(v)
            q = qrecord.load(encoded, name, rec.shape, "float32" if "adam" in meta else rec.dtype, parent)
            try:
                out[name] = dq.dequantize(q)
            except ValueError as e:
                raise CorruptCheckpointError(f"record {name!r}: {e}") from None
            if "adam" in meta:
                pending.append((name, rec))
            if deltas:
                codes[name] = qrecord.Codes(qrecord.compact(q.codes, q.n_levels), q.n_levels)
    for name, rec in pending:  # in record order, as before; a direction whose v never came raises here
        if encoded.records[name]["pipeline"][0] == S.MOMENT_DIRECTION.descriptor:
            out[name] = directions.pop(name) if name in directions else _load_direction(encoded, name, rec, grid_v)
        else:
            out[name] = _denormalize(encoded, name, rec, out)
    return MomentReference(codes) if deltas else None


def _load_v(enc: Encoded, name: str, rec: TensorRecord, parent: qrecord.Codes | None):
    """(v, (D_q, levels, d_table): M.decode_v's denominator, levels as the next reference) of one grid record."""
    meta = enc.records[name]["meta"]
    try:
        a = meta["adam"]
        hp = M.AdamHP(float(a["step"]), float(a["beta1"]), float(a["beta2"]), float(a["eps"]))
        step = float(meta["step"])
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        raise CorruptCheckpointError(f"record {name!r} has malformed moment metadata ({e})") from None
    q = qrecord.load(enc, name, rec.shape, rec.dtype, parent)
    q.meta = {**q.meta, "step": step}
    try:
        levels = M.decode_grid(q)
    except ValueError as e:
        raise CorruptCheckpointError(f"record {name!r}: {e}") from None
    n_levels = int(levels.max()) + 1 if levels.numel() else 1
    try:
        v, D, d_table = M.decode_v(q, hp, levels, top=n_levels - 1, dtype=torch_dtype(rec.dtype))
    except ValueError as e:
        raise CorruptCheckpointError(f"record {name!r}: {e}") from None
    return v.reshape(rec.shape), (D, levels, d_table), qrecord.Codes(qrecord.compact(levels, n_levels), n_levels)


def _load_direction(enc: Encoded, name: str, rec: TensorRecord, grid_v: dict) -> torch.Tensor:
    meta = enc.records[name]["meta"]
    dv = grid_v.get(meta.get("v")) if meta.get("v") is not None else None
    if meta.get("v") is not None and dv is None:
        raise CorruptCheckpointError(f"record {name!r} needs its exp_avg_sq record {meta.get('v')!r}, "
                                     "which the file lacks")
    if dv is not None and dv[1].numel() != rec.numel:
        raise CorruptCheckpointError(f"record {name!r} has {rec.numel} elements but its exp_avg_sq "
                                     f"{meta['v']!r} has {dv[1].numel()}")
    if meta.get("zero"):
        return torch.zeros(tuple(rec.shape), dtype=torch_dtype(rec.dtype))
    q = qrecord.load(enc, name, rec.shape, rec.dtype, None)
    D, v_codes, d_table = dv if dv is not None else (None, None, None)
    try:  # 0 where v has its zero level: both moments were exactly zero
        return M.dequantize_m(q, D if meta.get("normalized") else None, v_codes=v_codes, d_table=d_table)
    except (KeyError, ValueError) as e:
        raise CorruptCheckpointError(f"record {name!r}: {e}") from None


def _denormalize(enc: Encoded, name: str, rec: TensorRecord, out: dict) -> torch.Tensor:
    """Codec normalized: m = u * denominator(v) with the decoded v."""
    a = enc.records[name]["meta"]["adam"]
    v = out.get(a.get("v")) if isinstance(a, dict) else None
    if v is None or v.shape != out[name].shape:
        raise CorruptCheckpointError(f"record {name!r} is normalized by {a.get('v') if isinstance(a, dict) else a!r}, "
                                     "which the file lacks or which has another shape")
    try:
        return dq.denormalize_exp_avg(out[name], v, a["step"], (a["beta1"], a["beta2"]), a["eps"],
                                      dtype=getattr(torch, rec.dtype))
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"record {name!r} has malformed Adam metadata ({e})") from None
