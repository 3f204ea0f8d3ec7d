"""Method ``lossless``: bit-exact. Byte-grouped planes + zstd; deltas XOR the previous bits.

Between consecutive checkpoints most weights move by a few ulps, so the XOR of their bit patterns
has long runs of zero high bits -- the sign/exponent plane becomes almost all zeros and zstd
removes it. The reference is the previous checkpoint's exact tensors.
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

    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        prev = reference.exact if reference is not None else None
        enc = Encoded(keyframe=prev is None)
        level = self.config.zstd_level

        def one(name: str):  # XOR, byte planes and zstd of one tensor (threads: none of it holds the GIL)
            t = state.tensors[name].detach().cpu().contiguous()
            p = prev.get(name) if prev is not None else None
            xor = p is not None and p.dtype == t.dtype and p.shape == t.shape and t.numel() > 0
            data = bytegroup.compress(to_numpy_bits(t), t.element_size(), float_bits=t.is_floating_point(),
                                      level=level, prev=to_numpy_bits(p) if xor else None)
            pipeline = [S.LOSSLESS.descriptor] + ([S.XOR.descriptor] if xor else []) + [S.BYTEGROUP.descriptor]
            return pipeline, data, t.clone()

        names = list(state.records)
        ref = {}
        for name, (pipeline, data, copy) in zip(names, thread_map(one, names)):
            enc.add(name, pipeline, {}, data=data)
            ref[name] = copy
        return enc, LosslessReference(ctx.step, ref)

    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        out = {}
        for name, rec in records.items():
            raw = bytegroup.decompress(encoded.blob(name, "data"))
            t = tensor_from_bytes(raw, rec.dtype, rec.shape)
            if S.XOR.descriptor in encoded.records[name]["pipeline"]:
                p = reference.exact.get(name) if reference is not None else None
                if p is None or p.shape != t.shape or p.dtype != t.dtype:
                    raise CorruptCheckpointError(f"record {name!r} is an XOR delta but its parent lacks it")
                t = torch.bitwise_xor(_bits(t), _bits(p)).view(t.dtype)
            out[name] = t
        return out, LosslessReference(ctx.step, dict(out))
