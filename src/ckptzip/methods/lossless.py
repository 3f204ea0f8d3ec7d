"""Method ``lossless``: bit-exact. Byte-grouped planes + zstd; deltas XOR the previous bits.

Between consecutive checkpoints most weights move by a few ulps, so the XOR of their bit patterns
has long runs of zero high bits -- the sign/exponent plane becomes mostly zeros, stored as its
nonzero mask and nonzero bytes (``sparse_planes``, stage ``bytegroup/2``) -- and zstd removes it.
The reference is the previous checkpoint's exact tensors.

Small records (under ``group_below`` bytes: biases, norms, scalars) are not compressed one by one
(four zstd frames and a checksum each would cost more than their bytes): their words, each XORed
with its parent where it has one, go into the group blobs of methods/groups.py (stage ``group/1``).
``group_below = 0`` gives every record its own blob (the layout before issue 15; both decode the
same way).

The writer's reference (what ``encode`` returns) keeps each group blob's words, so the next delta
XORs a group of the same records in one pass, and which planes of each delta blob zstd could not
shrink: the next delta stores those raw unless zstd shrinks a probe of their first bytes
(``bytegroup.compress``'s ``store_raw``). When the caller spends the reference
(``EncodeContext.reference_spent``: CheckpointChain.save), the large records' copies in it are
overwritten with the new bits instead of copying the state again; a keyframe writes its copies
into its spent predecessor's (``EncodeContext.recycle``) where dtype and shape match.

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
from ..configcheck import Range, check_fields
from ..errors import CorruptCheckpointError
from ..format import blob_digest
from ..parallel import thread_map
from ..state import FlatState, TensorRecord
from ..tensorbytes import BITS_DTYPE, host, tensor_from_bytes, tensor_from_words, to_numpy_bits, torch_dtype
from .base import DecodeContext, EncodeContext, Encoded, Method, Reference, register
from .groups import GROUP_BELOW, EncoderTensors, GroupWords, GroupWriter, exact_groups, group_key, group_words


@dataclass(frozen=True)
class LosslessConfig:
    zstd_level: int = 3  # levels above ~9 cost far more time for little gain on float planes
    # a byte plane zstd shrinks by less than this share is stored raw: the mantissa planes of a delta
    # shrink 4-8 % at ~50 KB saved per ms of zstd (docs/BENCHMARKS.md, "Batched code streams, the auto
    # coder, plane probes"); 0 keeps every gain zstd finds
    min_gain: float = 0.1
    # planes at most half nonzero (a delta's exponent plane) stored as a mask and the nonzero bytes
    # (stage bytegroup/2: faster and smaller, docs/BENCHMARKS.md "Sparse exponent planes"); False:
    # every plane one frame or raw, as before
    sparse_planes: bool = True

    def __post_init__(self):
        check_fields(self, zstd_level=ZSTD_LEVELS, min_gain=Range(ge=0.0, lt=1.0))


def _guess_raw(t: torch.Tensor) -> tuple[int, ...]:
    """The planes to probe before compressing where no earlier delta says which stay raw (a keyframe,
    the first delta after one): a float's planes after its first, whose mantissa bits zstd barely
    shrinks (the first holds the exponent, which it does)."""
    return tuple(range(1, t.element_size())) if t.is_floating_point() else ()


@dataclass(frozen=True)
class LosslessReference(Reference):
    """The previous checkpoint's exact tensors (CPU), XOR-ed against by the next delta. An encoder's
    are an EncoderTensors, which keeps its group blobs' words (``groups``); its reference also keeps
    which planes of each delta blob were stored raw (``raw_planes``, by record or group key: the next
    delta stores those raw unless a probe of their first bytes shrinks; a keyframe's planes predict
    nothing of a delta's)."""

    exact: Mapping[str, torch.Tensor]
    raw_planes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def groups(self) -> Mapping[str, GroupWords]:
        return exact_groups(self.exact)

    def tensors(self) -> Iterator[torch.Tensor]:
        return iter(self.exact.values())

    def spec(self, name: str) -> tuple[torch.dtype, torch.Size] | None:
        if isinstance(self.exact, EncoderTensors):
            return self.exact.spec(name)
        t = self.exact.get(name)
        return None if t is None else (t.dtype, t.shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return host(t).view(BITS_DTYPE[t.element_size()])


_PLAIN = [S.LOSSLESS.descriptor]
_XOR = [S.LOSSLESS.descriptor, S.XOR.descriptor]


@register
class LosslessMethod(Method):
    name = "lossless"
    version = 1
    config_cls = LosslessConfig

    group_below = GROUP_BELOW  # records under this many bytes share a group blob (0: every record its own)

    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        prev = reference if isinstance(reference, LosslessReference) else None
        enc = Encoded(keyframe=prev is None)
        level, sparse = self.config.zstd_level, self.config.sparse_planes
        praw = prev.raw_planes if prev is not None else {}

        # a spent writer's reference holds its own copies of the large records: the new bits overwrite
        # the parent's once XORed (a fresh copy of the state per save cost its allocation and page faults),
        # and a keyframe's copies go into its spent predecessor's (ctx.recycle) where dtype and shape match
        reuse = ctx.reference_spent and prev is not None and isinstance(prev.exact, EncoderTensors)
        spare = ctx.recycle.exact if ctx.reference_spent and prev is None and isinstance(
            ctx.recycle, LosslessReference) and isinstance(ctx.recycle.exact, EncoderTensors) else None

        def keep(name: str, t: torch.Tensor) -> torch.Tensor:  # the reference's own copy of t
            s = spare.own(name) if spare is not None else None
            return s.copy_(t) if s is not None and s.dtype == t.dtype and s.shape == t.shape else t.clone()

        def one(item):  # XOR, byte planes, zstd and checksum of one tensor (threads: none holds the GIL)
            name, t, xor = item
            p = prev.exact[name] if xor else None
            advance = reuse and xor and prev.exact.owns(name)
            data = bytegroup.compress(to_numpy_bits(t), t.element_size(), float_bits=t.is_floating_point(),
                                      level=level, prev=None if p is None else to_numpy_bits(p),
                                      store_raw=praw.get(name, _guess_raw(t)) if xor else _guess_raw(t),
                                      advance=advance, min_gain=self.config.min_gain, sparse=sparse)
            # the blob's checksum now, while it is in cache (read again from memory later: twice the time)
            digest = blob_digest(ctx.checksum, data) if ctx.checksum else None
            return data, digest, p if advance else keep(name, t)

        large, members = [], {}  # members: group key -> [(name, tensor, xor)] in record order
        for name in state.records:  # one pass: each record's parent (same dtype and shape), its blob or group
            t = host(state.tensors[name])
            ps = prev.spec(name) if prev is not None else None
            xor = ps is not None and ps[0] == t.dtype and ps[1] == t.shape and t.numel() > 0
            if t.numel() * t.element_size() < self.group_below:
                members.setdefault(group_key(t), []).append((name, t, xor))
            else:
                large.append((name, t, xor))
        whole = {}  # a group of the same records as the parent's group: XORed with its words whole
        for key, items in members.items():
            pg = prev.groups.get(key) if prev is not None else None
            if pg is not None and all(x for _, _, x in items) and pg.names == tuple(n for n, _, _ in items):
                whole[key] = pg.words
        groups, metas = GroupWriter(level, self.config.min_gain, sparse), {}
        for key, items in members.items():
            for name, t, xor in items:
                metas[name] = groups.add(t, prev.exact[name] if xor and key not in whole else None)
        words = groups.flush(enc, prev=whole, raw_planes={key: praw.get(key, _guess_raw(items[0][1]))
                                                          for key, items in members.items()})
        kept = {key: GroupWords(words[key], tuple(n for n, _, _ in items),
                                tuple((t.dtype, t.shape) for _, t, _ in items)) for key, items in members.items()}
        coded = dict(zip((n for n, _, _ in large), thread_map(one, large)))
        xored = {n for items in members.values() for n, _, x in items if x} | {n for n, _, x in large if x}
        raw_planes = {} if prev is None else {k: bytegroup.raw_planes(enc.blobs[k]) for k in kept}
        own, grouped = {}, {key: [S.GROUP.descriptor, bytegroup.stage(enc.blobs[key])] for key in kept}
        for name in state.records:  # records in the state's order
            head = _XOR if name in xored else _PLAIN
            if name in metas:
                enc.add(name, head + grouped[metas[name]["group"][0]], metas[name])
            else:
                data, digest, own[name] = coded[name]
                if name in xored:
                    raw_planes[name] = bytegroup.raw_planes(data)
                key = enc.add(name, head + [bytegroup.stage(data)], {}, data=data)["data"]
                if digest is not None:
                    enc.digests[key] = ctx.checksum, digest, data
        return enc, LosslessReference(ctx.step, EncoderTensors(list(state.records), own, kept), raw_planes)

    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        out, groups = {}, {}
        for name, rec in records.items():
            pipeline = encoded.records[name]["pipeline"]
            p = None
            if S.XOR.descriptor in pipeline:
                p = reference.exact.get(name) if reference is not None else None
                if p is None or p.shape != tuple(rec.shape) or p.dtype != torch_dtype(rec.dtype):
                    raise CorruptCheckpointError(f"record {name!r} is an XOR delta but its parent lacks it")
            if S.GROUP.descriptor in pipeline:
                t = tensor_from_bytes(group_words(encoded, name, groups), rec.dtype, rec.shape)
                if p is not None:
                    _bits(t).bitwise_xor_(_bits(p))
            else:  # the parent's bits XORed in as the planes are merged: no pass or copy of its own
                prev = None if p is None else to_numpy_bits(p).view(f"u{p.element_size()}")
                t = tensor_from_words(bytegroup.decompress_words(encoded.blob(name, "data"), prev),
                                      rec.dtype, rec.shape)
            out[name] = t
        return out, LosslessReference(ctx.step, dict(out))
