"""The grid moment codec as chain records: one Adam parameter's (m, v) pair, or one SGD buffer.

Records (methods/qrecord.py layout, codes coded by ANS on the plain stream or cyclic delta):

- v (``exp_avg_sq``): pipeline ``moment-grid/1``; codes = absolute grid levels of Adam's
  denominator (quant/moments.py), a cyclic delta against the previous checkpoint's levels when
  the reference has them; a keyframe may code them as residuals of row + column effects
  (``factored``: int16 side tensors ``row``/``col``, no codebook). Meta ``adam`` = {step, beta1,
  beta2, eps}: what the decoder needs to turn levels back into v.
- m (``exp_avg``): pipeline ``moment-direction/1``; codes into the level table (codebook),
  side ``scale`` (bf16 per group); meta ``v`` names the v record whose denominator scales it.
  Never a delta: m changes wholesale between saves (its signs agree ~50 % after 12 steps).
- SGD ``momentum_buffer``: ``moment-direction/1`` without ``v`` (u = the buffer itself).

Decode order: every v record first (its levels are the next reference), then the m records.
The reference kept between saves is {v record name: (absolute levels, n_levels)}.
"""
from __future__ import annotations

import torch

from ..errors import CorruptCheckpointError
from ..quant import moments as M
from ..quant.base import QuantizedTensor
from . import qrecord
from .base import Encoded

GRID_PIPELINE = M.GRID_DESCRIPTOR
DIRECTION_PIPELINE = M.DIRECTION_DESCRIPTOR
_CODER = {"coder": "ans", "rearrange": False, "rle": False}  # measured: ANS on the plain delta wins for v


def store_adam(enc: Encoded, m_name: str, v_name: str, m: torch.Tensor, v: torch.Tensor, hp: M.AdamHP,
               codec: M.GridCodec, prev: qrecord.CodesRef | None) -> qrecord.CodesRef:
    """Store one Adam pair; ``prev``: the v levels of the previous checkpoint (None: keyframe)."""
    if prev is not None and prev[0].numel() != v.numel():
        prev = None
    factored = codec.factored and prev is None  # residuals only pay at keyframes (deltas: absolute levels)
    qv = M.quantize_v(v, hp, step=codec.v_step, factored=factored, m=m)
    if prev is not None and prev_step(prev) != codec.v_step:
        prev = None
    adam = {"step": hp.step, "beta1": hp.beta1, "beta2": hp.beta2, "eps": hp.eps}
    qrecord.store(enc, v_name, qv, _codes_ref(prev), method=GRID_PIPELINE, **_CODER,
                  meta={"step": codec.v_step, "factored": qv.meta["factored"], "adam": adam})
    levels = M.decode_grid(qv)
    if codec.m_bits:
        D = M.decode_denominator(qv, hp, levels) if codec.normalize == "decoded" else M.denominator(v, hp)
        qm = M.quantize_m(m, D, bits=codec.m_bits, group=codec.group, prune=codec.prune)
        qrecord.store(enc, m_name, qm, None, method=DIRECTION_PIPELINE, **_CODER,
                      meta={**_direction_meta(qm), "v": v_name})
    else:
        enc.add(m_name, [DIRECTION_PIPELINE], {"zero": True, "v": v_name})
    return _reference(levels, codec.v_step)


def store_momentum(enc: Encoded, name: str, buf: torch.Tensor, codec: M.GridCodec) -> None:
    """Store an SGD momentum buffer (no v: the buffer is its own direction) at max(m_bits, 1)."""
    q = M.quantize_m(buf, None, bits=max(codec.m_bits, 1), group=codec.group, prune=codec.prune)
    qrecord.store(enc, name, q, None, method=DIRECTION_PIPELINE, **_CODER, meta=_direction_meta(q))


def load_v(enc: Encoded, name: str, shape, dtype: str, prev: qrecord.CodesRef | None
           ) -> tuple[torch.Tensor, torch.Tensor, qrecord.CodesRef]:
    """(v, D_q flat, reference) of one v record."""
    meta = enc.records[name]["meta"]
    try:
        hp = M.AdamHP(float(meta["adam"]["step"]), float(meta["adam"]["beta1"]), float(meta["adam"]["beta2"]),
                      float(meta["adam"]["eps"]))
        step = float(meta["step"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"record {name!r} has malformed moment metadata ({e})") from None
    q = qrecord.load(enc, name, shape, dtype, _codes_ref(prev) if meta.get("delta") else None)
    try:
        levels = M.decode_grid(q)
    except ValueError as e:
        raise CorruptCheckpointError(f"record {name!r}: {e}") from None
    D = M.decode_denominator(q, hp, levels)
    return M.v_from_denominator(D, hp, shape, getattr(torch, dtype)), (D, levels), _reference(levels, step)


def load_direction(enc: Encoded, name: str, shape, dtype: str, v_levels: tuple | None) -> torch.Tensor:
    """m (or an SGD buffer); ``v_levels``: (D_q, levels) of its v record when normalized."""
    meta = enc.records[name]["meta"]
    if meta.get("zero"):
        return torch.zeros(tuple(shape), dtype=getattr(torch, dtype))
    q = qrecord.load(enc, name, shape, dtype, None)
    if q.meta.get("normalized") and v_levels is None:
        raise CorruptCheckpointError(f"record {name!r} needs its exp_avg_sq record {meta.get('v')!r}, "
                                     "which the file lacks")
    try:
        m = M.dequantize_m(q, None if v_levels is None else v_levels[0])
    except (KeyError, ValueError) as e:
        raise CorruptCheckpointError(f"record {name!r}: {e}") from None
    if v_levels is not None:
        m.reshape(-1)[v_levels[1] == 0] = 0
    return m


# ---------------------------------------------------------------------------------------------

def _direction_meta(q: QuantizedTensor) -> dict:
    return {k: q.meta[k] for k in ("bits", "group", "prune", "normalized")}


def _reference(levels: torch.Tensor, step: float) -> qrecord.CodesRef:
    return qrecord.compact(levels), ("grid", step)


def prev_step(prev) -> float | None:
    return prev[1][1] if isinstance(prev[1], tuple) else None


def _codes_ref(prev):
    if prev is None:
        return None
    return prev[0], int(prev[0].max()) + 1 if prev[0].numel() else 1
