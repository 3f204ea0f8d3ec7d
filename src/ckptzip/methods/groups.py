"""Small records' words in shared group blobs (stage ``group/1``).

A record of a few hundred bytes (a bias, a norm, a step scalar) costs more as its own blob than
its bytes: four zstd frames, a SHA-256 and a header entry each. Instead the words of every small
record of one width and kind (float or not) are concatenated, in record order, into one
byte-grouped blob ``group.<width><f|i>``, and each record names its words as
``meta.group = [blob key, offset, count]`` (offset and count in words). Words may be XORed with a
parent's first (``lossless``'s deltas); the reader undoes that, not this module.

Call order::

    g = GroupWriter(level)                 # encode
    meta = g.add(t, parent)                # per small record: its meta.group, in record order
    g.flush(enc)                           # the group blobs into enc.blobs (keep=True: their words)
    words = group_words(encoded, name, cache)   # decode: the record's bytes (cache: one dict per file)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..codec import bytegroup
from ..errors import CorruptCheckpointError
from ..tensorbytes import BITS_DTYPE

if TYPE_CHECKING:  # base.py imports this module (encode_exact)
    from .base import Encoded

GROUP_BELOW = 16384  # tensor bytes under which a record's words go to a group blob


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def group_key(t: torch.Tensor) -> str:
    return f"group.{t.element_size()}{'f' if t.is_floating_point() else 'i'}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A flat view of ``t``'s words as the same-width integer (fp16 and bf16, int8 and uint8 share a
    group: their words must not be promoted to a wider type when concatenated)."""
    return t.reshape(-1).view(BITS_DTYPE[t.element_size()])


@dataclass(frozen=True)
class GroupWords:
    """A group blob's words before compression (its records' bits, in record order) and each record
    as a view of them: what ``lossless`` keeps as the next save's reference, so that a group whose
    records are these same views again is XORed with ``words`` in one pass."""

    words: torch.Tensor
    views: tuple[torch.Tensor, ...]


@dataclass
class _Group:
    tensors: list = field(default_factory=list)
    parents: list = field(default_factory=list)
    size: int = 0


class GroupWriter:
    """Collects small records' words per group blob; ``flush`` compresses each blob once."""

    def __init__(self, level: int = 3):
        self.level = level
        self._groups: dict[str, _Group] = {}

    def add(self, t: torch.Tensor, parent: torch.Tensor | None = None) -> dict:
        """Append ``t``'s words (CPU, contiguous) to be XORed with ``parent``'s (same dtype and shape)
        when given; returns the record's meta."""
        key = group_key(t)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group()
        n = t.numel()
        meta = {"group": [key, g.size, n]}
        g.size += n
        g.tensors.append(t)
        g.parents.append(parent)
        return meta

    def flush(self, enc: Encoded, *, prev: dict[str, GroupWords] | None = None, keep: bool = False,
              raw_planes: dict[str, tuple[int, ...]] | None = None) -> dict[str, GroupWords]:
        """The group blobs into ``enc.blobs``. ``prev``: a group's words of the last save (``keep``'s
        output), used whole when every record's parent is its view there; ``raw_planes``: per group,
        planes to store raw untried (bytegroup.compress). With ``keep``, returns each group's words."""
        out = {}
        for key, g in self._groups.items():
            width, is_float = int(key[len("group."):-1]), key.endswith("f")
            words = torch.cat([_bits(t) for t in g.tensors]) if len(g.tensors) > 1 else _bits(g.tensors[0]).clone()
            p = prev.get(key) if prev else None
            if p is not None and len(p.views) == len(g.parents) and all(a is b for a, b in zip(p.views, g.parents)):
                parent = p.words
            elif any(q is not None for q in g.parents):  # XOR with zeros keeps a record's own bits
                parent = torch.cat([_bits(q) if q is not None else torch.zeros(t.numel(), dtype=words.dtype)
                                    for t, q in zip(g.tensors, g.parents)])
            else:
                parent = None
            enc.blobs[key] = bytegroup.compress(words.numpy(), width, float_bits=is_float, level=self.level,
                                                prev=None if parent is None else parent.numpy(),
                                                store_raw=(raw_planes or {}).get(key, ()))
            if keep:
                views, off = [], 0
                for t in g.tensors:
                    n = t.numel()
                    views.append(words[off:off + n].view(t.dtype).view(t.shape))
                    off += n
                out[key] = GroupWords(words, tuple(views))
        self._groups.clear()
        return out


def group_words(encoded: Encoded, name: str, cache: dict[str, memoryview]) -> memoryview:
    """The bytes of a grouped record's words (its group blob decompressed once, kept in ``cache``)."""
    g = encoded.records[name]["meta"].get("group")
    if not (isinstance(g, list) and len(g) == 3 and isinstance(g[0], str) and g[0] in encoded.blobs
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in g[1:])):
        raise CorruptCheckpointError(f"record {name!r}: meta.group {g!r} is not [blob key, offset, count] of a blob "
                                     "in the file")
    key, off, n = g
    if key not in cache:
        cache[key] = memoryview(bytegroup.decompress(encoded.blobs[key]))
    buf = cache[key]
    width = encoded.blobs[key][0]  # the byte-grouped blob's first byte: its word width
    if (off + n) * width > buf.nbytes:
        raise CorruptCheckpointError(f"record {name!r}: words {off}..{off + n} lie outside group blob {key!r}")
    return buf[off * width:(off + n) * width]
