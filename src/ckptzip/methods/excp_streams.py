"""excp-fixed's code sub-streams: every k-means code of a checkpoint, coded against its parent part.

ExCP's masks nest: support(v^) <= support(m^) <= support(dW^) (eq. 6 ANDs the weight mask in).
So a child part's codes (m under dw, v under m) are stored only where its parent part is non-zero,
split into sub-streams by the parent's code there (static conditional coding):

    context 0              a part coded at every element (no parent, or its support leaks out)
    context 1..2**bits-1   a child's codes where the parent's code is that value
    context 2**bits        a child's codes under a dense parent

Each sub-stream concatenates, in the order the writer adds parameters (sorted weight-record
names), each parameter's codes for it. Per kind (dw, m, v) the writer codes every sub-stream
with each candidate coder and keeps the one with the fewest bytes in all (``CODERS``: a list of
registry stages, codec/stages.py). The ``codes`` blob is kinds dw, m, v in that order, each kind's
contexts in increasing numeric order; ``method_meta["streams"][kind] = {"stages": [...], "subs":
{"<context>": [offset, length, n_codes]}}``. Files of ckptzip 0.1 wrote ``"coder": name``
instead of ``"stages"``, and their xz / zstd coders compressed codes packed MSB first.

Call order::

    w = StreamWriter(bits); cond = w.add(parts)    # per parameter, in order
    blob, meta, chosen = w.finish(coders)
    r = StreamReader(blob, meta, bits)
    codes = r.read(parts_so_far, p, numel, cond)   # per parameter and part, in the same order
    r.check_consumed()
"""
from __future__ import annotations

import numpy as np
import torch

from ..codec import bitpack, frames
from ..codec import stages as S
from ..errors import CorruptCheckpointError, malformed
from ..quant.excp import PARTS, Part
from .excp_records import SpanWriter, cut

CODERS = {"ans": [S.ANS], "huffman": [S.HUFFMAN], "xz": [S.BITPACK, S.XZ], "zstd": [S.BITPACK, S.ZSTD_FRAME]}
ZSTD_LEVEL = 19
PARENT = {"m": "dw", "v": "m"}  # v's support lies in m's, m's in dW's (eq. 6 nests the masks)


def _support(part: Part) -> np.ndarray:
    return part.support().numpy()


def route(parts: dict[str, Part], p: str, bits: int) -> tuple[np.ndarray | None, np.ndarray | int]:
    """(positions, contexts) of part p's codes; positions None = every element, context 0.

    Conditional when p's support lies inside its parent's: only the parent's non-zero positions
    are coded, each in the sub-stream of the parent's code there (2**bits for a dense parent).
    """
    parent = parts.get(PARENT.get(p, ""))
    if parent is None:
        return None, 0
    pos = _support(parent)
    if (_support(parts[p]) & ~pos).any():
        return None, 0
    ctx = parent.codes.numpy()[pos].astype(np.int64) if parent.mode == "kmeans" else 2 ** bits
    return pos, ctx


class StreamWriter:
    """Collects each kind's sub-streams (kind -> context -> code arrays, in parameter order)."""

    def __init__(self, bits: int):
        self.bits = bits
        self.subs: dict[str, dict[int, list[np.ndarray]]] = {p: {} for p in PARTS}

    def add(self, parts: dict[str, Part]) -> dict[str, bool]:
        """Route one parameter's k-means parts; returns whether each is coded conditionally."""
        cond = {}
        for p, part in parts.items():
            if part.mode != "kmeans":
                continue
            pos, ctx = route(parts, p, self.bits)
            cond[p] = pos is not None
            codes = part.codes.numpy() if pos is None else part.codes.numpy()[pos]
            if isinstance(ctx, int):
                self.subs[p].setdefault(ctx, []).append(codes)
            else:
                for c in np.unique(ctx):
                    self.subs[p].setdefault(int(c), []).append(codes[ctx == c])
        return cond

    def finish(self, coders: tuple[str, ...]) -> tuple[bytes, dict, dict[str, str]]:
        """(codes blob, method_meta["streams"], the coder chosen per kind)."""
        out = SpanWriter()
        meta, chosen = {}, {}
        for p in PARTS:
            streams = {c: np.concatenate(v) for c, v in sorted(self.subs[p].items())}
            if not streams:
                continue
            best = None
            for coder in coders:
                try:
                    bufs = {c: S.encode(CODERS[coder], s, bits=self.bits, level=ZSTD_LEVEL) for c, s in streams.items()}
                except ImportError:  # ANS needs the optional constriction package
                    continue
                size = sum(map(len, bufs.values()))
                if best is None or size < best[0]:
                    best = (size, coder, bufs)
            _, coder, bufs = best
            chosen[p] = coder
            meta[p] = {"stages": S.pipeline(*CODERS[coder]),
                       "subs": {str(c): [*out.add(bufs[c]), int(streams[c].size)] for c in streams}}
        return out.getvalue(), meta, chosen


def _decode_sub(info: dict, buf: bytes, n: int, bits: int) -> np.ndarray:
    """One sub-stream of n codes: through its registry stages, or a 0.1 coder name."""
    if "stages" in info:
        stages = [S.get(d, record="codes", method="excp-fixed") for d in info["stages"]]
        if stages not in list(CODERS.values()):
            raise CorruptCheckpointError(f"code stream has stages {info['stages']} that excp-fixed does not write")
        out = np.asarray(S.decode(stages, buf, n=n, bits=bits, what="code stream"))
    else:  # ckptzip 0.1: xz / zstd over codes packed MSB first
        coder = info["coder"]
        if coder in ("ans", "huffman"):
            out = S.decode(CODERS[coder], buf, what="code stream")
        elif coder in ("xz", "zstd"):
            limit = bitpack.packed_nbytes(n, bits)
            packed = frames.xz_decompress(buf, max_bytes=limit, what="code stream") if coder == "xz" else \
                frames.zstd_decompress(buf, max_bytes=limit, what="code stream")
            out = bitpack.unpack_msb_first(packed, n, bits).numpy()
        else:
            raise CorruptCheckpointError(f"code stream has unknown coder {coder!r}")
    if out.shape != (n,) or (n and (int(out.min()) < 0 or int(out.max()) >= 2 ** bits)):
        raise CorruptCheckpointError(f"code stream decodes to {out.shape[0]} symbols in the wrong range, expected {n}")
    return out.astype(np.uint8)


class StreamReader:
    def __init__(self, blob: bytes, meta: dict, bits: int):
        self.bits = bits
        self.subs: dict[str, dict[int, np.ndarray]] = {}
        self.pos: dict[str, dict[int, int]] = {}
        with malformed("ExCP code streams meta"):
            for p, info in meta.items():
                self.subs[p] = {int(c): _decode_sub(info, cut(blob, s[:2], f"{p} codes"), int(s[2]), bits)
                                for c, s in info["subs"].items()}
                self.pos[p] = {c: 0 for c in self.subs[p]}

    def _take(self, p: str, c: int, k: int) -> np.ndarray:
        sub = self.subs.get(p, {}).get(c)
        i = self.pos.get(p, {}).get(c, 0)
        if sub is None or i + k > sub.size:
            raise CorruptCheckpointError(f"ExCP {p} code sub-stream {c} ends early")
        self.pos[p][c] = i + k
        return sub[i:i + k]

    def read(self, parts: dict[str, Part], p: str, numel: int, cond: bool) -> torch.Tensor:
        """Part p's (numel,) uint8 codes; its parent (already in parts) gives the positions when ``cond``."""
        if not cond:
            return torch.from_numpy(self._take(p, 0, numel).copy())
        parent = parts.get(PARENT.get(p, ""))
        if parent is None:
            raise CorruptCheckpointError(f"ExCP part {p!r} is coded against a parent part the record lacks")
        codes = np.zeros(numel, dtype=np.uint8)
        pos = np.flatnonzero(_support(parent))
        if parent.mode != "kmeans":
            codes[pos] = self._take(p, 2 ** self.bits, pos.size)
            return torch.from_numpy(codes)
        ctx = parent.codes.numpy()[pos]
        for c in np.unique(ctx):
            sel = pos[ctx == c]
            codes[sel] = self._take(p, int(c), sel.size)
        return torch.from_numpy(codes)

    def check_consumed(self) -> None:
        for p, subs in self.subs.items():
            for c, s in subs.items():
                if self.pos[p][c] != s.size:
                    raise CorruptCheckpointError(f"ExCP {p} code sub-stream {c} has {s.size - self.pos[p][c]} "
                                                 "codes no parameter reads")
