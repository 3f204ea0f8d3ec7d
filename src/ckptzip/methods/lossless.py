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
from dataclasses import dataclass

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
from .groups import GROUP_BELOW, GroupWriter, group_words, nbytes


@dataclass(frozen=True)
class LosslessConfig:
    zstd_level: int = 3  # levels above ~9 cost far more time for little gain on float planes

    def __post_init__(self):
        check_fields(self, zstd_level=ZSTD_LEVELS)


@dataclass(frozen=True)
class LosslessReference(Reference):
    """The previous checkpoint's exact tensors (CPU), XOR-ed against by the next delta."""

    exact: Mapping[str, torch.Tensor]

    def tensors(self) -> Iterator[torch.Tensor]:
        return iter(self.exact.values())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(BITS_DTYPE[t.element_size()])


@register
class LosslessMethod(Method):
    name = "lossless"
    version = 1
    config_cls = LosslessConfig

    group_below = GROUP_BELOW  # records under this many bytes share a group blob (0: every record its own)

    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        prev = reference.exact if reference is not None else None
        enc = Encoded(keyframe=prev is None)
        level = self.config.zstd_level

        def prepare(name: str):  # the tensor, its parent's bits when it is XORed, its pipeline
            t = state.tensors[name].detach().cpu().contiguous()
            p = prev.get(name) if prev is not None else None
            xor = p is not None and p.dtype == t.dtype and p.shape == t.shape and t.numel() > 0
            pipeline = [S.LOSSLESS.descriptor] + ([S.XOR.descriptor] if xor else [])
            return t, (to_numpy_bits(p) if xor else None), pipeline

        def one(name: str):  # XOR, byte planes and zstd of one tensor (threads: none of it holds the GIL)
            t, p, pipeline = prepare(name)
            data = bytegroup.compress(to_numpy_bits(t), t.element_size(), float_bits=t.is_floating_point(),
                                      level=level, prev=p)
            return pipeline + [S.BYTEGROUP.descriptor], data, t.clone()

        names = list(state.records)
        small = [n for n in names if nbytes(state.tensors[n]) < self.group_below]
        large = [n for n in names if nbytes(state.tensors[n]) >= self.group_below]
        ref, metas, groups = {}, {}, GroupWriter(level)
        for name in small:
            t, p, pipeline = prepare(name)
            metas[name] = (pipeline + [S.GROUP.descriptor, S.BYTEGROUP.descriptor], groups.add(t, p))
            ref[name] = t.clone()
        groups.flush(enc)
        coded = dict(zip(large, thread_map(one, large)))
        for name in names:  # records in the state's order
            if name in metas:
                enc.add(name, *metas[name])
            else:
                pipeline, data, ref[name] = coded[name]
                enc.add(name, pipeline, {}, data=data)
        return enc, LosslessReference(ctx.step, {n: ref[n] for n in names})

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
