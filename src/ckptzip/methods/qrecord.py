"""Storing one QuantizedTensor as a chain record (shared by every quantizing method).

Blobs: ``codes`` (codec/entropy.encode_codes buffer: self-describing, optionally a cyclic delta
against the previous checkpoint's codes; never for a ``residual/1`` record, whose codes quantize
the weight minus the parent's reconstruction), ``codebook`` (fp32, n_levels values, NaN allowed; absent
with meta ``codebook: false`` for a parametric grid), and
one blob per side tensor ``side.<key>`` (raw little-endian bytes). Meta: ``n_levels``, ``delta``,
``side`` = {key: [dtype, shape]}, plus the quantizer's JSON facts.

Packed (meta ``parts`` = [[part, nbytes], ...]), the parts are one blob ``data``, codes first. A
record of fewer than ``BATCH_BELOW`` codes keeps no blob of its own (stage ``batch/1``): its
``data`` is meta ``batch`` = [blob key, offset, nbytes] of the blob ``batch`` that the save's small
records share. A blob costs a file ~35 bytes of compressed checksum and table entry and a save a
few microseconds; a small chain's delta had 106 of them, 70 for its quantized records.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..codec import stages as S
from ..codec import tuples
from ..codec.entropy import decode_codes, decode_symbols_many, encode_codes_many
from ..codec.rans import HAVE_NUMBA
from ..errors import CorruptCheckpointError
from ..quant.base import QuantizedTensor, compact
from ..tensorbytes import dtype_name, host, tensor_from_bytes, tensor_to_bytes
from .base import Encoded

@dataclass(frozen=True)
class Codes:
    """One record's integer codes kept between saves (the next checkpoint's delta is taken against them)."""

    codes: torch.Tensor   # flat, in the narrowest integer dtype that holds them (see ``compact``)
    n_levels: int


BATCH_BELOW = 1 << 16  # codes under which a record's data joins the shared blob (batch/1); above, a blob
                      # costs well under 1 % of coding it, and joining would copy the large ones
BATCH_KEY = "batch"
_BATCH = [S.BATCH.descriptor]


class RecordBatch:
    """Quantized records added to one ``Encoded``, their code streams entropy-coded together at
    ``flush`` (``encode_codes_many``: one kernel call for the order-0 streams instead of ~75 us of
    Python each). A record takes its place in ``enc`` (its index, so its blob keys) at ``store``::

        batch = RecordBatch(enc, share=True)
        codes = batch.store(name, q, prev, method=...)   # what the next save's delta is taken against
        batch.flush()                                    # before enc is written

    ``share``: every record packed, the small ones into the shared blob (module docstring); one
    batch a file shares.
    """

    def __init__(self, enc: Encoded, *, share: bool = False):
        self.enc, self.share = enc, share
        self._jobs: list[tuple] = []      # encode_codes_many's
        self._pending: list[tuple] = []   # (name, rec_meta, the parts after the codes, pack, shared)

    def store(self, name: str, q: QuantizedTensor, prev: Codes | None, *, method: str, coder: str = "huffman",
              rearrange: bool = True, rle: bool = True, meta: dict | None = None, pack: bool = False,
              residual: bool = False, steps: bool = False) -> Codes:
        """Add record ``name`` holding ``q``; a cyclic delta against ``prev`` when given and same size.
        ``residual``: ``q`` quantizes the weight minus the parent's reconstruction (stage ``residual/1``;
        its codes are never a cyclic delta, they mean something else than the parent's).
        ``pack``: the parts in one blob ``data`` (meta ``parts`` = [[part, nbytes], ...]): every blob
        costs a file ~100 bytes of header (offsets, SHA-256), which small tensors feel. ``steps``: a
        delta's codes move by a step or two (grid levels), so ``coder="auto"`` packs them in pairs
        from fewer codes (``tuples.min_codes``)."""
        if residual or (prev is not None and prev.codes.numel() != q.numel):
            prev = None
        B = max(q.n_levels, prev.n_levels) if prev is not None else q.n_levels  # levels may change between saves
        packed = False
        if coder == "auto":
            coder, rearrange, rle = ORDER0_CODER, False, False
            packed = tuples.size(B) > 1 and q.numel >= tuples.min_codes(B, steps=steps and prev is not None)
        # narrow codes (uint8) go in as they are: the delta and coder kernels widen value by value
        self._jobs.append((prev.codes if prev is not None else None, q.codes, B,
                           {"rearrange": rearrange, "rle": rle, "coder": coder, "tuples": packed}))
        pipeline = _pipeline(method, prev is not None, rearrange, rle, packed, coder, residual)
        side = {k: host(v) for k, v in q.side.items()}
        rec_meta = {"n_levels": q.n_levels, "delta": prev is not None,
                    "side": {k: [dtype_name(v.dtype), list(v.shape)] for k, v in side.items()}, **(meta or {})}
        parts = {}
        if q.codebook.numel():
            book = q.codebook
            parts["codebook"] = tensor_to_bytes(book if book.dtype is torch.float32 else book.float())
        else:  # a parametric grid (the moment codec): the levels are implied by the meta
            rec_meta["codebook"] = False
        parts.update({f"side.{k}": tensor_to_bytes(v) for k, v in side.items()})
        shared = self.share and q.numel < BATCH_BELOW
        pack = pack or self.share
        if shared:
            self.enc.add(name, pipeline + _BATCH, rec_meta)
        else:
            self.enc.add(name, pipeline, rec_meta, **({"data": b""} if pack else {"codes": b"", **parts}))
        self._pending.append((name, rec_meta, parts, pack, shared))
        return Codes(compact(q.codes, q.n_levels), q.n_levels)

    def flush(self) -> None:
        """Code every stored record's codes into its blob (or its span of the shared one)."""
        joined, at = [], 0
        for (name, rec_meta, parts, pack, shared), blob in zip(self._pending, encode_codes_many(self._jobs)):
            if pack:
                rec_meta["parts"] = [["codes", len(blob)]] + [[k, len(v)] for k, v in parts.items()]
            if shared:
                n = len(blob) + sum(len(v) for v in parts.values())
                rec_meta["batch"] = [BATCH_KEY, at, n]
                joined += [blob, *parts.values()]
                at += n
            elif pack:
                self.enc.blobs[self.enc.records[name]["blobs"]["data"]] = b"".join([blob, *parts.values()])
            else:
                self.enc.blobs[self.enc.records[name]["blobs"]["codes"]] = blob
        if joined:
            if BATCH_KEY in self.enc.blobs:
                raise RuntimeError("a second RecordBatch(share=True) in one Encoded")
            self.enc.blobs[BATCH_KEY] = b"".join(joined)
        self._jobs, self._pending = [], []


@functools.lru_cache(maxsize=256)
def _pipeline(method: str, delta: bool, rearrange: bool, rle: bool, packed: bool, coder: str,
              residual: bool) -> list[str]:
    """A stored record's pipeline (a few distinct ones a save: built once each). Shared: read only."""
    stages = ([S.CYCLIC_DELTA] + ([S.REARRANGE] if rearrange else []) if delta else []) + \
        ([S.RLE] if rle else []) + ([S.TUPLE] if packed else []) + [S.CODER_STAGES[coder]]
    return [method] + S.pipeline(*([S.RESIDUAL] if residual else []), *stages)


# codes a restore decodes ahead of their records (predecode): int64, 32 MiB at most
AHEAD_SYMBOLS = 1 << 22

# quantizer facts worth keeping in a quantized record's meta (decoders read only ``adam`` and qrecord's own)
RECORD_META = ("domain", "k", "n_pruned", "n_protected", "adam", "prune_threshold", "sensitivity_fallback")

# the ``auto`` coder (and the grid moment codec's): an order-0 coder on the plain cyclic delta, for
# every tensor. rANS, measured 1.7x faster than constriction's ANS on a chain's code streams at +0.2 %
# of its bytes (docs/BENCHMARKS.md, issue 15); without numba its plain-Python reference would be far
# slower than ANS. The paper's rearranged RLE + Huffman (``coder="huffman"``) wrote 1.1-2.2x its bytes
# at every share of unchanged codes measured, 5 % to 99.9 % (docs/BENCHMARKS.md, "The auto coder"):
# Huffman spends a whole bit on each symbol, where rANS codes a repeated code in a fraction of one.
ORDER0_CODER = "rans" if HAVE_NUMBA else "ans"


def is_residual(enc: Encoded, name: str) -> bool:
    """Whether record ``name`` quantizes a residual against the parent's reconstruction
    (``RecordBatch.store(residual=True)``)."""
    return S.RESIDUAL.descriptor in enc.records[name]["pipeline"]


def load(enc: Encoded, name: str, shape, dtype: str, prev: Codes | None) -> QuantizedTensor:
    """Inverse of store (codes, codebook, side tensors) -> QuantizedTensor."""
    meta = enc.records[name]["meta"]
    try:
        n_levels = int(meta["n_levels"])
        side_spec = dict(meta.get("side", {}))
    except (KeyError, TypeError, ValueError):
        raise CorruptCheckpointError(f"record {name!r} has malformed quantizer metadata") from None
    if meta.get("delta") and prev is None:
        raise CorruptCheckpointError(f"record {name!r} is a delta but its parent checkpoint has no codes for it")
    part = _parts(enc, name, meta)
    try:
        codes = decode_codes(part("codes"), prev.codes if meta.get("delta") else None,  # narrow prev: read as is
                             symbols=enc.ahead.pop(name, None))
    except ValueError as e:  # header and record disagree (delta flag, code count): a damaged file
        raise CorruptCheckpointError(f"record {name!r}: {e}") from None
    n = 1
    for d in shape:
        n *= int(d)
    if codes.numel() != n:
        raise CorruptCheckpointError(f"record {name!r} holds {codes.numel()} codes for a tensor of {n} elements")
    blobs = {k: part(f"side.{k}") for k in side_spec}
    book = None if meta.get("codebook") is False else part("codebook")
    try:
        codebook = torch.empty(0) if book is None else tensor_from_bytes(book, "float32", (n_levels,))
        side = {k: tensor_from_bytes(blobs[k], dt, tuple(shp)) for k, (dt, shp) in side_spec.items()}
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"record {name!r}: {e}") from None
    return QuantizedTensor(codes=codes, n_levels=n_levels, codebook=codebook, shape=tuple(shape), dtype=dtype,
                           side=side, meta=meta)


def predecode(enc: Encoded, names) -> None:
    """Decode the code streams of ``names``' records in one batch ahead of their ``load`` (into
    ``enc.ahead``; at most AHEAD_SYMBOLS codes held). A restore's streams are mostly short,
    low-entropy, single-lane rANS: decoded four at a time, their chains overlap."""
    keys, bufs = [], []
    for name in names:
        try:
            meta = enc.records[name]["meta"]
            if "n_levels" in meta and not meta.get("zero"):
                bufs.append(_parts(enc, name, meta)("codes"))
                keys.append(name)
        except (CorruptCheckpointError, KeyError, TypeError, AttributeError):
            continue  # a damaged record: its load reports it
    for name, symbols in zip(keys, decode_symbols_many(bufs, AHEAD_SYMBOLS)):
        if symbols is not None:
            enc.ahead[name] = symbols


def part_bytes(enc: Encoded, name: str, part: str) -> bytes:
    """Record ``name``'s part (``codes``, ``codebook``, ``side.<key>``) wherever it is stored."""
    return _parts(enc, name, enc.records[name]["meta"])(part)


def batch_span(name: str, meta: dict) -> tuple[str, int, int] | None:
    """A ``batch/1`` record's meta ``batch`` as (blob key, offset, nbytes); None for a record with blobs
    of its own. Only the bounds of the blob are left to check."""
    span = meta.get("batch")
    if span is None:
        return None
    if not (isinstance(span, list) and len(span) == 3 and isinstance(span[0], str) and
            all(type(v) is int and v >= 0 for v in span[1:])):
        raise CorruptCheckpointError(f"record {name!r} has malformed meta.batch {span!r}")
    return span[0], span[1], span[2]


def _parts(enc: Encoded, name: str, meta: dict):
    """part name -> its bytes: its own blob, or its span of the packed blob ``data`` (meta ``parts``),
    itself its own blob or a span of the shared one (meta ``batch``)."""
    if "parts" not in meta:
        return lambda part: enc.blob(name, part)
    span = batch_span(name, meta)
    if span is None:
        data = memoryview(enc.blob(name, "data"))
    else:
        key, off, n = span
        blob = enc.blobs.get(key)
        if blob is None or off + n > len(blob):
            raise CorruptCheckpointError(f"record {name!r}: meta.batch {list(span)} is outside the file's blobs")
        data = memoryview(blob)[off:off + n]
    spans, at = {}, 0
    try:
        for part, nbytes in meta["parts"]:
            spans[str(part)] = (at, at + int(nbytes))
            at += int(nbytes)
    except (TypeError, ValueError):
        raise CorruptCheckpointError(f"record {name!r} has malformed meta.parts") from None
    if at != len(data):
        raise CorruptCheckpointError(f"record {name!r}: its parts hold {at} bytes, its data blob {len(data)}")

    def part(p: str) -> bytes:
        if p not in spans:
            raise CorruptCheckpointError(f"record {name!r} has no part {p!r}")
        return bytes(data[spans[p][0]:spans[p][1]])
    return part


