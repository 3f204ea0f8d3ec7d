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
from ..errors import CorruptCheckpointError
from ..state import FlatState, TensorRecord
from ..tensorbytes import BITS_DTYPE, tensor_from_bytes, tensor_to_bytes
from .base import DecodeContext, EncodeContext, Encoded, Method, Reference, register


@dataclass(frozen=True)
class LosslessConfig:
    zstd_level: int = 3  # levels above ~9 cost far more time for little gain on float planes


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
        for name, rec in state.records.items():
            t = state.tensors[name].detach().cpu().contiguous()
            p = prev.get(name) if prev is not None else None
            pipeline = [S.LOSSLESS.descriptor]
            if p is not None and p.dtype == t.dtype and p.shape == t.shape and t.numel():
                t_bits = torch.bitwise_xor(_bits(t), _bits(p))
                pipeline.append(S.XOR.descriptor)
            else:
                t_bits = t
            data = bytegroup.compress(tensor_to_bytes(t_bits), t.element_size(),
                                      float_bits=t.is_floating_point(), level=level)
            enc.add(name, pipeline + [S.BYTEGROUP.descriptor], {}, data=data)
        ref = {n: t.detach().cpu().clone() for n, t in state.tensors.items()}
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
