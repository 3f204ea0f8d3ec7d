"""Small records' words in shared group blobs (stage ``group/1``).

A record of a few hundred bytes (a bias, a norm, a step scalar) costs more as its own blob than
its bytes: four zstd frames, a checksum and a header entry each. Instead the words of every small
record of one width and kind (float or not) are concatenated, in record order, into one
byte-grouped blob ``group.<width><f|i>``, and each record names its words as
``meta.group = [blob key, offset, count]`` (offset and count in words). Words may be XORed with a
parent's first (``lossless``'s deltas); the reader undoes that, not this module.

Call order::

    g = GroupWriter(level)                 # encode
    meta = g.add(t, parent)                # per small record: its meta.group, in record order
    g.add_words(key, words)                # or a group's words whole, joined by the caller (join_words)
    g.flush(enc)                           # the group blobs into enc.blobs; returns their words
    words = group_words(encoded, name, cache)   # decode: the record's bytes (cache: one dict per file)
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..codec import bytegroup
from ..errors import CorruptCheckpointError

if TYPE_CHECKING:  # base.py imports this module (encode_exact)
    from .base import Encoded

GROUP_BELOW = 16384  # tensor bytes under which a record's words go to a group blob


def group_key(t: torch.Tensor) -> str:
    key = _KEYS.get(t.dtype)
    if key is None:  # once per dtype: a save asks for every small record's
        key = _KEYS[t.dtype] = f"group.{t.element_size()}{'f' if t.is_floating_point() else 'i'}"
    return key


_KEYS: dict[torch.dtype, str] = {}


def join_words(ts: list[torch.Tensor]) -> np.ndarray:
    """The tensors' words (CPU, contiguous; one width), concatenated into a new array of unsigned ints.
    Viewed as integers before joining when dtypes differ: fp16 and bf16, int8 and uint8 share a
    group, and numpy would promote their values to a wider type."""
    arrays = [t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy() for t in ts]
    uint = np.dtype(f"u{ts[0].element_size()}")
    if any(a.dtype != arrays[0].dtype for a in arrays):
        arrays = [a.view(uint) for a in arrays]
    return np.concatenate(arrays, axis=None).view(uint)


@dataclass(frozen=True)
class GroupWords:
    """A group blob's words before compression (its records' bits, in record order, unsigned ints) and
    those records' names, dtypes and shapes: the next delta XORs a group of the same records with
    ``words`` whole, and reads a record's parent bits as a view of them."""

    words: np.ndarray
    names: tuple[str, ...]
    specs: tuple[tuple[torch.dtype, torch.Size], ...]

    def tensor(self, i: int, offset: int) -> torch.Tensor:
        dtype, shape = self.specs[i]
        t = torch.from_numpy(self.words[offset:offset + shape.numel()])
        return t.view(dtype).view(shape)


class EncoderTensors(Mapping):
    """An encoder's reference tensors by record name: its own copies of the large records, the small
    ones views of their group's words (``groups``, by group key), made when asked for (a steady-state
    delta asks for none)."""

    def __init__(self, names: list[str], own: dict[str, torch.Tensor], groups: dict[str, GroupWords]):
        self._names, self._own, self.groups = names, own, groups
        self._grouped = {}
        for g in groups.values():
            off = 0
            for i, (n, (_, shape)) in enumerate(zip(g.names, g.specs)):
                self._grouped[n] = (g, i, off)
                off += shape.numel()

    def owns(self, name: str) -> bool:
        """Whether the record is one of the large records' copies (not a view of group words)."""
        return name in self._own

    def own(self, name: str) -> torch.Tensor | None:
        """The record's own copy, None for a small record (a view of its group's words) or none."""
        return self._own.get(name)

    def spec(self, name: str) -> tuple[torch.dtype, torch.Size] | None:
        """The record's dtype and shape, without making its view."""
        t = self._own.get(name)
        if t is not None:
            return t.dtype, t.shape
        g = self._grouped.get(name)
        return g[0].specs[g[1]] if g is not None else None

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._own.get(name)
        if t is not None:
            return t
        g, i, off = self._grouped[name]
        return g.tensor(i, off)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def exact_groups(exact: Mapping[str, torch.Tensor]) -> Mapping[str, GroupWords]:
    """The group words a reference's exact tensors keep: an encoder's (EncoderTensors), else none (a
    reference decoded by a restore holds plain tensors)."""
    return exact.groups if isinstance(exact, EncoderTensors) else {}


@dataclass
class _Group:
    tensors: list = field(default_factory=list)
    parents: list = field(default_factory=list)
    words: np.ndarray | None = None  # add_words's: the group's words whole
    size: int = 0


class GroupWriter:
    """Collects small records' words per group blob; ``flush`` compresses each blob once."""

    def __init__(self, level: int = 3, min_gain: float = 0.0, sparse: bool = False):
        self.level, self.min_gain, self.sparse = level, min_gain, sparse  # bytegroup.compress's
        self._groups: dict[str, _Group] = {}

    def add(self, t: torch.Tensor, parent: torch.Tensor | None = None) -> dict:
        """Append ``t``'s words (CPU, contiguous) to be XORed with ``parent``'s (same dtype and shape)
        when given; returns the record's meta."""
        key = group_key(t)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group()
        if g.words is not None:
            raise ValueError(f"group {key} was given its words whole (add_words)")
        n = t.numel()
        meta = {"group": [key, g.size, n]}
        g.size += n
        g.tensors.append(t)
        g.parents.append(parent)
        return meta

    def add_words(self, key: str, words: np.ndarray) -> None:
        """Group ``key``'s words whole (unsigned ints, its records' in record order; kept, not copied):
        for a writer that joined them itself. No other add to the group."""
        if key in self._groups:
            raise ValueError(f"group {key} already has records")
        self._groups[key] = _Group(words=words, size=words.size)

    def flush(self, enc: Encoded, *, prev: dict[str, np.ndarray] | None = None,
              raw_planes: dict[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
        """The group blobs into ``enc.blobs``; returns each group's words (unsigned ints: a copy of the
        records', or add_words's array).
        ``prev``: per group, the words to XOR it with whole (instead of its records' parents: a
        group of the same records as last save's); ``raw_planes``: per group, the planes
        predicted raw (bytegroup.compress's ``store_raw``)."""
        out = {}
        for key, g in self._groups.items():
            width, is_float = int(key[len("group."):-1]), key.endswith("f")
            words = join_words(g.tensors) if g.words is None else g.words
            parent = prev.get(key) if prev else None
            if parent is None and any(q is not None for q in g.parents):  # XOR with zeros keeps a record's bits
                parent = join_words([q if q is not None else torch.zeros(t.numel(), dtype=t.dtype)
                                     for t, q in zip(g.tensors, g.parents)])
            enc.blobs[key] = bytegroup.compress(words, width, float_bits=is_float, level=self.level, prev=parent,
                                                store_raw=(raw_planes or {}).get(key, ()), min_gain=self.min_gain,
                                                sparse=self.sparse)
            out[key] = words
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
