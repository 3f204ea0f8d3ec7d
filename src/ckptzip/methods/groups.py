"""Small records' words in shared group blobs (stage ``group/1``).

A record of a few hundred bytes (a bias, a norm, a step scalar) costs more as its own blob than
its bytes: four zstd frames, a SHA-256 and a header entry each. Instead the words of every small
record of one width and kind (float or not) are concatenated, in record order, into one
byte-grouped blob ``group.<width><f|i>``, and each record names its words as
``meta.group = [blob key, offset, count]`` (offset and count in words). Words may be XORed with a
parent's first (``lossless``'s deltas); the reader undoes that, not this module.

Call order::

    g = GroupWriter(level)                 # encode
    meta = g.add(t, parent_bits)           # per small record: its meta.group, in record order
    g.flush(enc)                           # the group blobs into enc.blobs
    words = group_words(encoded, name, cache)   # decode: the record's bytes (cache: one dict per file)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..codec import bytegroup
from ..errors import CorruptCheckpointError
from ..tensorbytes import to_numpy_bits

if TYPE_CHECKING:  # base.py imports this module (encode_exact)
    from .base import Encoded

GROUP_BELOW = 16384  # tensor bytes under which a record's words go to a group blob


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GroupWriter:
    """Collects small records' words per group blob; ``flush`` compresses each blob once."""

    def __init__(self, level: int = 3):
        self.level = level
        self._groups: dict[str, tuple[list, list, list]] = {}

    def add(self, t: torch.Tensor, parent: np.ndarray | None = None) -> dict:
        """Append ``t``'s words (XOR ``parent``'s bits when given); returns the record's meta."""
        key = f"group.{t.element_size()}{'f' if t.is_floating_point() else 'i'}"
        words, parents, size = self._groups.setdefault(key, ([], [], [0]))
        bits = to_numpy_bits(t)
        meta = {"group": [key, size[0], int(bits.size)]}
        size[0] += bits.size
        words.append(bits)
        parents.append(parent)
        return meta

    def flush(self, enc: Encoded) -> None:
        for key, (words, parents, _) in self._groups.items():
            width, is_float = int(key[len("group."):-1]), key.endswith("f")
            prev = None
            if any(p is not None for p in parents):  # XOR with zeros keeps a record's own bits
                prev = np.concatenate([p if p is not None else np.zeros_like(w) for w, p in zip(words, parents)])
            enc.blobs[key] = bytegroup.compress(np.concatenate(words), width, float_bits=is_float, level=self.level,
                                                prev=prev)
        self._groups.clear()


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
