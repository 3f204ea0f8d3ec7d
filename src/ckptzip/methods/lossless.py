"""Method ``lossless``: bit-exact. Byte-grouped planes + zstd; deltas XOR the previous bits.

Between consecutive checkpoints most weights move by a few ulps, so the XOR of their bit patterns
has long runs of zero high bits -- the sign/exponent plane becomes almost all zeros and zstd
removes it. The reference is the previous checkpoint's exact tensors.

Small records (under ``group_below`` bytes: biases, norms, scalars) are not compressed one by one
(four zstd frames and a checksum each would cost more than their bytes): their words, each XORed
with its parent where it has one, go into the group blobs of methods/groups.py (stage ``group/1``).
``group_below = 0`` gives every record its own blob (the layout before issue 15; both decode the
same way).

Decode recipe: per record, its words from its own blob or its group's (each group blob
decompressed once per file), viewed as the record's dtype and shape, XORed with the parent's
bits when the pipeline says ``xor/1``.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ..codec import bytegroup
from ..codec import stages as S
from ..codec.frames import ZSTD_LEVELS
from ..configcheck import check_fields
from ..errors import CorruptCheckpointError
from ..parallel import thread_map
from ..state import FlatState, TensorRecord
from ..tensorbytes import BITS_DTYPE, tensor_from_bytes, to_numpy_bits
from .base import DecodeContext, EncodeContext, Encoded, Method, Reference, register
from .groups import GROUP_BELOW, GroupWords, GroupWriter, group_words


@dataclass(frozen=True)
class LosslessConfig:
    zstd_level: int = 3  # levels above ~9 cost far more time for little gain on float planes

    def __post_init__(self):
        check_fields(self, zstd_level=ZSTD_LEVELS)


@dataclass(frozen=True)
class LosslessReference(Reference):
    """The previous checkpoint's exact tensors (CPU), XOR-ed against by the next delta. An encoder's
    reference also keeps its group blobs' words (``groups``: the small records' tensors in ``exact``
    are views of them, XORed whole) and which planes of each blob were stored raw (``raw_planes``,
    by record or group key: the next delta stores those raw untried)."""

    exact: Mapping[str, torch.Tensor]
    groups: Mapping[str, GroupWords] = field(default_factory=dict)
    raw_planes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def tensors(self) -> Iterator[torch.Tensor]:
        return iter(self.exact.values())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(BITS_DTYPE[t.element_size()])


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, on the CPU and contiguous (no call where it already is: a save visits every record)."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


_PLAIN = [S.LOSSLESS.descriptor]
_XOR = [S.LOSSLESS.descriptor, S.XOR.descriptor]
_OWN, _GROUPED = [S.BYTEGROUP.descriptor], [S.GROUP.descriptor, S.BYTEGROUP.descriptor]


@register
class LosslessMethod(Method):
    name = "lossless"
    version = 1
    config_cls = LosslessConfig

    group_below = GROUP_BELOW  # records under this many bytes share a group blob (0: every record its own)

    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        prev = reference if isinstance(reference, LosslessReference) else None
        pexact = prev.exact if prev is not None else {}
        praw = prev.raw_planes if prev is not None else {}
        enc = Encoded(keyframe=prev is None)
        level = self.config.zstd_level

        def one(item):  # XOR, byte planes and zstd of one tensor (threads: none of it holds the GIL)
            name, t, p = item
            data = bytegroup.compress(to_numpy_bits(t), t.element_size(), float_bits=t.is_floating_point(),
                                      level=level, prev=None if p is None else to_numpy_bits(p),
                                      store_raw=() if p is None else praw.get(name, ()))
            return data, t.clone()

        metas, large, groups, members = {}, [], GroupWriter(level), {}
        for name in state.records:  # one pass: the parent each record is XORed with, its own blob or a group's
            t = _host(state.tensors[name])
            p = pexact.get(name)
            if p is not None and not (p.dtype == t.dtype and p.shape == t.shape and t.numel() > 0):
                p = None
            if t.numel() * t.element_size() < self.group_below:
                meta = groups.add(t, p)
                metas[name] = (_PLAIN if p is None else _XOR) + _GROUPED, meta
                members.setdefault(meta["group"][0], []).append(name)
            else:
                metas[name] = (_PLAIN if p is None else _XOR) + _OWN, None
                large.append((name, t, p))
        kept = groups.flush(enc, prev=prev.groups if prev is not None else None, keep=True,
                            raw_planes=praw if not enc.keyframe else None)
        coded = dict(zip((n for n, _, _ in large), thread_map(one, large)))
        ref = {n: v for key, g in kept.items() for n, v in zip(members[key], g.views)}
        # which planes of a delta's blobs did not shrink (a keyframe's planes predict nothing of a delta's)
        raw_planes = {} if enc.keyframe else {k: bytegroup.raw_planes(enc.blobs[k]) for k in kept}
        for name, (pipeline, meta) in metas.items():  # records in the state's order
            if meta is not None:
                enc.add(name, pipeline, meta)
            else:
                data, ref[name] = coded[name]
                if pipeline is not _PLAIN:
                    raw_planes[name] = bytegroup.raw_planes(data)
                enc.add(name, pipeline, {}, data=data)
        return enc, LosslessReference(ctx.step, {n: ref[n] for n in metas}, kept, raw_planes)

    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        out, groups = {}, {}
        for name, rec in records.items():
            if S.GROUP.descriptor in encoded.records[name]["pipeline"]:
                raw = group_words(encoded, name, groups)
            else:
                raw = bytegroup.decompress(encoded.blob(name, "data"))
            t = tensor_from_bytes(raw, rec.dtype, rec.shape)
            if S.XOR.descriptor in encoded.records[name]["pipeline"]:
                p = reference.exact.get(name) if reference is not None else None
                if p is None or p.shape != t.shape or p.dtype != t.dtype:
                    raise CorruptCheckpointError(f"record {name!r} is an XOR delta but its parent lacks it")
                t = torch.bitwise_xor(_bits(t), _bits(p)).view(t.dtype)
            out[name] = t
        return out, LosslessReference(ctx.step, dict(out))
