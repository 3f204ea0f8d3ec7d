"""Methods ``bitsnap`` and ``bitsnap-lossless``: BitSnap (paper 004, sections 3.3-3.4, 4.2-4.4).

Model states (float tensors of role ``weight`` or ``buffer``) are stored *losslessly*: a base
checkpoint keeps them exactly, and each of the next ``max_cached_iterations`` checkpoints keeps
only a bitmask delta against that base (codec/bitmask.py: per tensor the smallest of "same",
"bitmask" and "dense" by exact byte count). Every delta points at the base, never at the previous
delta, so restoring any step decodes two files at most. After ``max_cached_iterations`` deltas the
method starts a new base by itself (the paper's MAX_CACHED_ITERATION; the paper gives no default,
10 matches its Fig. 9 window of 10 iterations after a base); a ``None`` reference from the chain's
keyframe policy starts one at any time. That policy counts saves including the base (default every
10: a base and 9 deltas), so at both defaults the chain starts bases first; give the chain a larger
``KeyframePolicy.every`` to let ``max_cached_iterations`` decide.

Optimizer states (Adam moments and fp32 master weights: float records whose role is not
weight/buffer/step/tensor and that belong to a parameter) are quantized with cluster8 in *every*
checkpoint, keyframes included -- never delta-encoded (section 3.4). ``bitsnap-lossless`` keeps
them exact instead.

Adam guard (``adam_guard``, on by default; a deviation from the paper, which rounds to nearest).
Adam steps by m / (sqrt(v) + eps). Round-to-nearest puts every v below half a cluster step on the
cluster minimum -- often exactly 0 -- and turns m into 0 +- half an m step where m was 0; both
make the rebuilt step m' / eps, thousands of times too large (on the digits MLP resumed at step 30
the largest step grows from 1.2 to 8448 and training collapses to chance). So second moments
(exp_avg_sq, max_exp_avg_sq, square_avg, sum, exp_inf) are rounded *up* within their cluster
(v <= v' < v + scale: the stored codes move one level up where needed, the format is unchanged),
and exp_avg is set to exactly 0 where its exp_avg_sq decodes to 0 -- which with upward rounding
happens only where v was 0, i.e. the parameter never had a gradient and m was 0 too.

Everything else (step counts, integer tensors, RNG states, unlinked tensors) is stored exactly
through methods.base.encode_exact.

Per-record pipelines and blobs (all integers little-endian)::

    exact (keyframe model states, other records)
        ["exact/1", "bytegroup/1"]                    data = bytegroup(raw tensor bytes)
    delta of a model state, meta {"kind", "n_changed"}; kind "same" has no blobs
        payload_codec "bytegroup" (default):
        ["bitsnap/1", "bitmask/1", "bytegroup/1"]     mask   = bytegroup(packed bitmask, width 1)
                                                      values = bytegroup(changed values, width w)
        payload_codec "zstd":
        ["bitsnap/1", "bitmask/1", "zstd-frame/1"]    payload = one zstd frame over mask || values
                                                      (files of bitsnap/1, ckptzip 0.1: "zstd/1")
        ["bitsnap/1", "bitmask/1"]                    payload = mask || values (codec "none", or
                                                      zstd did not shrink it)
      mask: ceil(n/8) bytes, bit i of byte j = element 8j+i changed (absent for kind "dense");
      values: the changed elements' raw bytes in flat order (kind "dense": all n elements).
    optimizer state (bitsnap)
        ["bitsnap/1", "cluster8/1"]                   labels, values, scale, min (quant/cluster8);
                                                      meta {"n_clusters", "rounding": "nearest"|"up"}
        ["bitsnap/1", "cluster8/1", "zero-if/1"]      the same, then 0 wherever the record named by
                                                      meta "zero_if_zero" (its exp_avg_sq) decodes to 0

Method-level meta: ``{"bitsnap": {"base_step", "delta_index"}, "summary": {...}}``; delta_index is
0 for a base and 1.. for its deltas, so a restarted writer rebuilds the count from the file alone.
The reference is ``BitSnapReference(base_step, base={name: CPU copy of the base's exact model
states}, count=deltas written against it)``; the optimizer state is never kept.

Call order (see methods/base.py)::

    enc, ref = m.encode(flat, None, ctx=ctx)    # a base: ref.step == ctx.step, count 0
    enc, ref = m.encode(flat, ref, ctx=ctx)     # a delta against ref.step; ref keeps the base
    ...                                         # count == max_cached_iterations -> a new base
    tensors, ref = m.decode(records, enc, ref, ctx=dctx)
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from ..codec import bitmask, bytegroup, frames
from ..codec import stages as S
from ..configcheck import OneOf, Range, check_fields
from ..errors import ConfigError, CorruptCheckpointError, NonFiniteError
from ..quant import cluster8
from ..quant.base import apply_codebook
from ..state import FlatState, TensorRecord
from .base import (DecodeContext, EncodeContext, Encoded, Method, Reference, decode_exact, encode_exact, is_exact,
                   register)

PAYLOAD_CODECS = ("bytegroup", "zstd", "none")
_NOT_OPTIMIZER = frozenset({"weight", "buffer", "step", "tensor"})
# optimizer states that divide the step (Adam/AdamW/Adamax/RMSprop/Adagrad): rounded up by the guard
SECOND_MOMENT_ROLES = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "exp_inf"})
QUANTIZED = S.pipeline(S.BITSNAP, S.CLUSTER8)
DELTA = S.pipeline(S.BITSNAP, S.BITMASK)
FRAMED = ([S.ZSTD_FRAME.descriptor], [S.ZSTD_LEGACY.descriptor])  # zstd/1: the frame, in bitsnap/1 files


@dataclass(frozen=True)
class BitSnapConfig:
    max_cached_iterations: int = 10   # deltas against one base before a new base (paper: MAX_CACHED_ITERATION)
    n_clusters: int = 16              # cluster8 clusters for optimizer states (<= 16: uint4 labels)
    quantize_optimizer: bool = True   # False keeps optimizer states exact (method bitsnap-lossless)
    zstd_level: int = 3               # exact records and the payload pass; higher levels gain little on floats
    payload_codec: str = "bytegroup"  # lossless pass over delta payloads: "bytegroup" (mask via zstd, values
                                      # byte-grouped), "zstd" (one frame), "none" (the paper's raw payload)
    adam_guard: bool = True           # round second moments up, zero exp_avg where exp_avg_sq is 0 (see
                                      # module docstring); False: the paper's round-to-nearest

    def __post_init__(self):
        check_fields(self, max_cached_iterations=Range(ge=0, note=" (0: every save is a base)"),
                     n_clusters=cluster8.N_CLUSTERS, zstd_level=frames.ZSTD_LEVELS, payload_codec=OneOf(PAYLOAD_CODECS))


@dataclass(frozen=True)
class BitSnapReference(Reference):
    """The base checkpoint's exact model states (CPU copies) and the deltas written against it."""

    base: Mapping[str, torch.Tensor]
    count: int

    def tensors(self) -> Iterator[torch.Tensor]:
        return iter(self.base.values())


def is_model_state(rec: TensorRecord) -> bool:
    """Records kept as base + bitmask deltas: float weights and buffers."""
    return rec.role in ("weight", "buffer") and rec.is_float


def is_optimizer_state(rec: TensorRecord) -> bool:
    """Records cluster8-quantized by ``bitsnap``: float moments / master weights of a parameter."""
    return rec.is_float and rec.role not in _NOT_OPTIMIZER and rec.param is not None


def quantize_moment(t: torch.Tensor, rec: TensorRecord, config: BitSnapConfig) -> tuple[dict[str, bytes], dict]:
    """cluster8 storage form of one optimizer state (and its record meta); second moments round up
    under the Adam guard. Raises NonFiniteError for inf/NaN (the caller stores those exactly)."""
    q = cluster8.quantize(t, cluster8.Cluster8Config(config.n_clusters))
    rounding = "nearest"
    if config.adam_guard and rec.role in SECOND_MOMENT_ROLES:
        # move each code whose value fell below x one level up its cluster's grid: x <= x' < x + scale
        # (round-to-nearest is within half a step, so one level always suffices; level 255 is the max)
        below = apply_codebook(q.codes, q.codebook) < t.detach().reshape(-1).float()  # fp32 grid values
        q.codes = q.codes + (below & (q.codes % 256 < 255)).to(q.codes.dtype)
        rounding = "up"
    return cluster8.pack(q), {"n_clusters": config.n_clusters, "rounding": rounding}


@register
class BitSnapMethod(Method):
    name = "bitsnap"
    version = 2  # 2: "zstd-frame/1" where 1 wrote "zstd/1" (payload_codec "zstd"); both are read
    config_cls = BitSnapConfig

    # --- encode ---------------------------------------------------------------------------
    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        cfg = self.config
        base, count = self._unpack_reference(reference)
        models = {n: r for n, r in state.records.items() if is_model_state(r)}
        if base is not None and (count >= cfg.max_cached_iterations or not self._fits(base, models, state)):
            base = None  # limit reached, or the model's tensors changed: start a new base
        keyframe = base is None
        base_step = ctx.step if keyframe else reference.step
        count = 0 if keyframe else count + 1
        enc = Encoded(keyframe=keyframe)
        kinds = {"same": 0, "bitmask": 0, "dense": 0}
        n_model = n_changed = 0
        quantized = []
        guarded = []  # (exp_avg record, its exp_avg_sq record)
        v_of = {p.moments["exp_avg"]: p.moments["exp_avg_sq"] for p in state.params().values()
                if "exp_avg" in p.moments and "exp_avg_sq" in p.moments}
        new_base = {} if keyframe else base
        for name, rec in state.records.items():
            t = state.tensors[name]
            if name in models:
                n_model += t.numel()
                if keyframe:
                    encode_exact(enc, name, t, level=cfg.zstd_level)
                    new_base[name] = state.own(name)  # the base must not alias weights training mutates
                    continue
                kind, k = self._encode_delta(enc, name, t.detach().cpu(), base[name])
                kinds[kind] += 1
                n_changed += k
            elif is_optimizer_state(rec) and cfg.quantize_optimizer and t.numel():
                try:
                    blobs, meta = quantize_moment(t, rec, cfg)
                except NonFiniteError:
                    encode_exact(enc, name, t, level=cfg.zstd_level)  # inf/NaN moments: keep them as they are
                    continue
                pipeline = list(QUANTIZED)
                v_name = v_of.get(name)
                if cfg.adam_guard and v_name is not None:
                    pipeline.append(S.ZERO_IF.descriptor)
                    meta["zero_if_zero"] = v_name
                    guarded.append((name, v_name))
                enc.add(name, pipeline, meta, **blobs)
                quantized.append(name)
            else:
                encode_exact(enc, name, t, level=cfg.zstd_level)
        for m_name, v_name in guarded:  # an exp_avg_sq kept exact (non-finite) gives no zero pattern
            if enc.records[v_name]["pipeline"][:2] != QUANTIZED:
                enc.records[m_name]["pipeline"].remove(S.ZERO_IF.descriptor)
                del enc.records[m_name]["meta"]["zero_if_zero"]
        summary = {"base_step": base_step, "delta_index": count, "optimizer_quantized": len(quantized),
                   "adam_guard": cfg.adam_guard}
        if not keyframe:
            summary.update(kinds, changed_frac=round(n_changed / n_model, 6) if n_model else 0.0,
                           payload_codec=cfg.payload_codec)
        enc.meta = {"bitsnap": {"base_step": base_step, "delta_index": count}, "summary": summary}
        return enc, BitSnapReference(base_step, new_base, count)

    @staticmethod
    def _unpack_reference(reference: Reference | None) -> tuple[dict | None, int]:
        if reference is None:
            return None, 0
        if not isinstance(reference, BitSnapReference):
            raise ConfigError("bitsnap was given a reference it did not make; pass the Reference its "
                              "encode/decode returned, or None for a base checkpoint")
        return reference.base, reference.count

    @staticmethod
    def _fits(base: dict, models: dict[str, TensorRecord], state: FlatState) -> bool:
        if set(base) != set(models):
            return False
        return all(base[n].dtype == state.tensors[n].dtype and base[n].shape == state.tensors[n].shape
                   for n in models)

    def _encode_delta(self, enc: Encoded, name: str, cur: torch.Tensor, base: torch.Tensor) -> tuple[str, int]:
        kind, payload, dmeta = bitmask.encode_delta(cur, base)
        k = dmeta["n_changed"]
        meta = {"kind": kind, "n_changed": k}
        pipeline = list(DELTA)
        codec, level = self.config.payload_codec, self.config.zstd_level
        if kind == "same":
            enc.add(name, pipeline, meta)
        elif codec == "bytegroup":
            n_mask = math.ceil(cur.numel() / 8) if kind == "bitmask" else 0
            blobs = {"values": bytegroup.compress(payload[n_mask:], cur.element_size(), float_bits=True, level=level)}
            if n_mask:
                blobs["mask"] = bytegroup.compress(payload[:n_mask], 1, float_bits=False, level=level)
            enc.add(name, pipeline + [bytegroup.stage(*blobs.values())], meta, **blobs)
        else:
            if codec == "zstd":
                packed = frames.zstd_compress(payload, level)
                if len(packed) < len(payload):
                    payload, pipeline = packed, pipeline + [S.ZSTD_FRAME.descriptor]
            enc.add(name, pipeline, meta, payload=payload)
        return kind, k

    # --- decode ---------------------------------------------------------------------------
    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        info = encoded.meta.get("bitsnap") if isinstance(encoded.meta, dict) else None
        try:
            base_step, count = int(info["base_step"]), int(info["delta_index"])
        except (TypeError, KeyError, ValueError):
            raise CorruptCheckpointError("bitsnap checkpoint lacks its base_step/delta_index metadata") from None
        if encoded.keyframe:
            if base_step != ctx.step or count != 0:
                raise CorruptCheckpointError(f"bitsnap base at step {ctx.step} names base {base_step}, delta {count}")
            base = {}
        else:
            base, _ = self._unpack_reference(reference) if reference is not None else (None, 0)
            if base is None or reference.step != base_step or count < 1:
                got = "none" if reference is None else f"step {reference.step}"
                raise CorruptCheckpointError(f"bitsnap delta {count} at step {ctx.step} needs base step {base_step}, "
                                             f"got {got}")
        out = {}
        for name, rec in records.items():
            if name not in encoded.records:
                raise CorruptCheckpointError(f"record {name!r} is missing from the bitsnap checkpoint")
            pipeline = encoded.records[name]["pipeline"]
            if is_exact(encoded, name):
                t = decode_exact(encoded, name, rec)
                if encoded.keyframe and is_model_state(rec):
                    base[name] = t
            elif pipeline[:2] == QUANTIZED and pipeline[2:] in ([], [S.ZERO_IF.descriptor]):
                blobs = {p: encoded.blob(name, p) for p in ("labels", "values", "scale", "min")}
                t = cluster8.dequantize(cluster8.unpack(blobs, rec.shape, rec.dtype, device=ctx.device))
            elif pipeline[:2] == DELTA and not encoded.keyframe:
                if name not in base:
                    raise CorruptCheckpointError(f"record {name!r} is a bitmask delta but base step {base_step} "
                                                 "lacks it")
                t = self._decode_delta(encoded, name, rec, base[name])
            else:
                raise CorruptCheckpointError(f"record {name!r} has pipeline {pipeline}, which bitsnap/1 cannot decode")
            out[name] = t.to(ctx.device)
        for name in records:
            if encoded.records[name]["pipeline"][2:] == [S.ZERO_IF.descriptor]:
                v_name = encoded.records[name]["meta"].get("zero_if_zero")
                v = out.get(v_name)
                if v is None or v.shape != out[name].shape:
                    raise CorruptCheckpointError(f"record {name!r} is zeroed where {v_name!r} is 0, "
                                                 "but that record is missing or has another shape")
                out[name] = out[name].masked_fill(v == 0, 0)
        if encoded.keyframe:
            return out, BitSnapReference(ctx.step, base, 0)
        return out, BitSnapReference(base_step, base, count)

    @staticmethod
    def _decode_delta(encoded: Encoded, name: str, rec: TensorRecord, base: torch.Tensor) -> torch.Tensor:
        r = encoded.records[name]
        meta, pipeline = r["meta"], r["pipeline"]
        kind = meta.get("kind")
        dmeta = {"shape": list(rec.shape), "dtype": rec.dtype}
        if isinstance(meta.get("n_changed"), int):
            dmeta["n_changed"] = meta["n_changed"]
        if kind == "same":
            payload = b""
        elif pipeline[2:] in ([S.BYTEGROUP.descriptor], [S.BYTEGROUP2.descriptor]):
            payload = bytegroup.decompress(encoded.blob(name, "values"))
            if kind == "bitmask":
                payload = bytegroup.decompress(encoded.blob(name, "mask")) + payload
        elif pipeline[2:] in ([], *FRAMED):
            payload = encoded.blob(name, "payload")
            if pipeline[2:]:  # the mask and every value at most
                payload = frames.zstd_decompress(payload, max_bytes=math.ceil(rec.numel / 8) + rec.numel *
                                                 base.element_size(), what=f"record {name!r} zstd payload")
        else:
            raise CorruptCheckpointError(f"record {name!r} has pipeline {pipeline}, which bitsnap/1 cannot decode")
        if kind not in bitmask.KINDS:
            raise CorruptCheckpointError(f"record {name!r} names delta kind {kind!r}; expected one of {bitmask.KINDS}")
        try:
            return bitmask.decode_delta(kind, payload, base, dmeta)
        except ConfigError as e:  # the base we hold does not match what the record was written against
            raise CorruptCheckpointError(f"record {name!r}: {e}") from None


@register
class BitSnapLosslessMethod(BitSnapMethod):
    """BitSnap with exact optimizer states: every tensor of every step restores bit-exactly."""

    name = "bitsnap-lossless"
    version = 2

    def __init__(self, config=None, **overrides):
        if config is None:
            config = BitSnapConfig(quantize_optimizer=False)
        elif isinstance(config, dict):
            config = {"quantize_optimizer": False, **config}
        super().__init__(config, **overrides)
        if self.config.quantize_optimizer:
            raise ConfigError("bitsnap-lossless keeps optimizer states exact; set quantize_optimizer=False "
                              "or use method 'bitsnap' to quantize them")
