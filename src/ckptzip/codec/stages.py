"""The registry of record stages: every descriptor ``"name/version"`` a record's pipeline may hold.

A record's ``pipeline`` (docs/FORMAT.md section 1.3) lists the stages its bytes went through,
outermost first: a method's marker (what the record is), then the transforms down to the stored
bytes. Each descriptor is defined here once, with its layout; FORMAT.md spells every layout out
and ``tests/test_format_descriptors.py`` keeps the two in step. A stage that transforms bytes on
its own names the functions that do it (``codec``), so a pipeline of them runs through
:func:`encode` / :func:`decode`; the other stages are read by the method that wrote them.

Reading checks every descriptor first (:func:`check_pipeline`): an unknown name or version is an
``UnknownStageError`` naming the record and the fix (upgrade ckptzip). Descriptors that ckptzip
0.1 wrote with a meaning that depended on the method (``zstd/1`` named four layouts) are
readable only in files of the methods that wrote them (``legacy_in``); nothing writes them now.

Call order::

    d = pipeline(EXACT, RAW)                                   # ["exact/1", "raw/1"]
    check_pipeline(d, record="model/w", method="bitsnap")     # on read, before decoding
    buf = encode([BITPACK, XZ], codes, bits=4)                 # stages that run on their own
    codes = decode([BITPACK, XZ], buf, n=n, bits=4, what="...")
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from ..errors import CorruptCheckpointError, UnknownStageError

# what a stage's encode takes: "bytes" -> bytes, "codes" (integers) -> bytes, "" (read by its method)
BYTES, CODES = "bytes", "codes"


@dataclass(frozen=True)
class Stage:
    descriptor: str                  # "name/version", as written into pipelines
    layout: str                      # one line; docs/FORMAT.md gives the byte layout
    takes: str = ""                  # BYTES | CODES | "": no codec of its own (its method reads it)
    codec: str = ""                  # "module:encode:decode" when takes is set
    legacy_in: tuple[str, ...] = ()  # read only in files of these methods (written by ckptzip 0.1)

    @property
    def name(self) -> str:
        return self.descriptor.partition("/")[0]

    @property
    def version(self) -> int:
        return int(self.descriptor.partition("/")[2])

    def _fn(self, i: int) -> Callable:
        module, *fns = self.codec.split(":")
        return getattr(importlib.import_module(module), fns[i])

    def encode(self, x, **kw) -> bytes:
        return self._fn(0)(x, **kw)

    def decode(self, data, **kw):
        return self._fn(1)(data, **kw)


STAGES: dict[str, Stage] = {}


def _stage(descriptor: str, layout: str, **kw) -> Stage:
    s = Stage(descriptor, layout, **kw)
    if descriptor in STAGES:
        raise RuntimeError(f"stage {descriptor} is defined twice")
    STAGES[descriptor] = s
    return s


# --- stored bytes -------------------------------------------------------------------------------
RAW = _stage("raw/1", "the bytes as they are, in the record's own blob 'data' (0.1's excp and excp-fixed "
             "also wrote it FIRST for bytes at meta.span of the shared payload: since 0.2 'span/1')",
             takes=BYTES, codec=f"{__name__}:_identity:_identity")
BATCH = _stage("batch/1", "a quantized record's blob 'data' (its meta.parts) is meta.batch = [blob key, offset, "
               "nbytes] of the blob 'batch' that the file's small quantized records share: methods/qrecord.py")
SPAN = _stage("span/1", "the bytes are meta.span = [offset, length] of the method's shared payload blob, "
              "after the payload's own stage (method_meta.payload.stage)")
BYTEGROUP = _stage("bytegroup/1", "byte planes of the words (floats rotated left by one bit), each a zstd "
                   "frame or raw: codec/bytegroup.py", takes=BYTES,
                   codec="ckptzip.codec.bytegroup:compress:decompress")
BYTEGROUP2 = _stage("bytegroup/2", "bytegroup/1, and planes at most half nonzero may be stored sparse (a nonzero "
                    "mask's frame and the nonzero bytes' frame), a tensor over 2**30 words in segments: "
                    "codec/bytegroup.py", takes=BYTES, codec="ckptzip.codec.bytegroup:compress_sparse:decompress")
ZSTD_FRAME = _stage("zstd-frame/1", "one zstd frame with its content size: codec/frames.py", takes=BYTES,
                    codec="ckptzip.codec.frames:zstd_compress:zstd_decompress")
XZ = _stage("xz/1", "one .xz stream (LZMA2 preset 9|extreme, CRC64): codec/frames.py", takes=BYTES,
            codec="ckptzip.codec.frames:xz_compress:xz_decompress")
ZSTD_LEGACY = _stage("zstd/1", "ckptzip 0.1: bitsnap -> zstd-frame/1; excp-fixed payload stage -> zstd-frame/1, "
                     "after excp-codes/1 -> zstd-frame/1 of MSB-first packed codes; dynaquant/qd/cnr/gobo -> "
                     "zstd-ints/1", legacy_in=("bitsnap", "bitsnap-lossless", "excp-fixed", "dynaquant", "qd",
                                               "cnr", "gobo"))

# --- integer codes -> bytes ---------------------------------------------------------------------
BITPACK = _stage("bitpack/1", "codes of `bits` bits, 8 // bits per byte, LSB first, zero padding: "
                 "codec/bitpack.py", takes=CODES, codec=f"{__name__}:_pack:_unpack")
HUFFMAN = _stage("huffman/1", "canonical Huffman stream 'HF' v1: codec/huffman.py", takes=CODES,
                 codec="ckptzip.codec.huffman:huffman_encode:huffman_decode")
ANS = _stage("ans/1", "stack-ANS stream 'AN' v1 (constriction): codec/ans.py", takes=CODES,
             codec="ckptzip.codec.ans:ans_encode:ans_decode")
RANS = _stage("rans/1", "interleaved static rANS stream 'RA' v1: codec/rans.py", takes=CODES,
              codec="ckptzip.codec.rans:rans_encode:rans_decode")
ZSTD_INTS = _stage("zstd-ints/1", "stream 'ZS' v1: the integers at the narrowest width, one zstd frame: "
                   "codec/entropy.zstd_encode", takes=CODES,
                   codec="ckptzip.codec.entropy:zstd_encode:zstd_decode")

CODER_STAGES = {"huffman": HUFFMAN, "ans": ANS, "zstd": ZSTD_INTS, "rans": RANS}  # codec/entropy.CODERS names -> stage

# --- exact and lossless records -----------------------------------------------------------------
EXACT = _stage("exact/1", "the tensor's exact bytes (FORMAT section 3), stored by the next stage")
LOSSLESS = _stage("lossless/1", "method lossless: the tensor's bits, or their XOR with the parent's")
XOR = _stage("xor/1", "bits XOR the parent record's bits (same dtype and shape)")
SAME = _stage("same/1", "the tensor is the parent checkpoint's record of the same name, bit for bit (same dtype "
              "and shape): no blob")
GROUP = _stage("group/1", "the words are meta.group = [blob key, offset, count] (in words) of a blob shared by "
               "the file's small records of one word width and kind, stored by the next stage")

# --- quantized records (methods/qrecord.py): blob 'codes' is an encode_codes buffer -------------
DYNAQUANT = _stage("dynaquant/1", "a DynaQuant quantized record: codes, codebook, side.protected")
QD = _stage("qd/1", "a QD (uniform, entropy-chosen bins) quantized record")
CNR = _stage("cnr/1", "a Check-N-Run (greedy clipping) quantized record")
GOBO = _stage("gobo/1", "a GOBO (outliers + k-means) quantized record")
QUANTIZED_RECORD = {"dynaquant": DYNAQUANT, "qd": QD, "cnr": CNR, "gobo": GOBO}  # method name -> its marker
MOMENT_GRID = _stage("moment-grid/1", "an Adam exp_avg_sq as levels of its update denominator on a fixed log grid "
                     "(codes, no codebook, side.row/col when factored): methods/moments.py")
MOMENT_DIRECTION = _stage("moment-direction/1", "an Adam exp_avg as its direction m / D (or an SGD momentum "
                          "buffer) at 1-3 bits: codes, codebook, side.scale; no blobs when meta.zero: "
                          "methods/moments.py")
CYCLIC_DELTA = _stage("cyclic-delta/1", "codes as (parent codes - codes) mod B: codec/delta.py")
RESIDUAL = _stage("residual/1", "the codes quantize the weight minus the parent's reconstruction of it; the weight is "
                  "that reconstruction + the dequantized record (no cyclic delta follows): methods/quantizing.py")
REARRANGE = _stage("rearrange/1", "deltas grouped by the parent's code (Algorithm 5): codec/delta.py")
RLE = _stage("rle/1", "run-length stream (-value, length if >= 2): codec/rle.py")
TUPLE = _stage("tuple/1", "codes of B = 2..32 levels packed tuples.size(B) to a symbol, the first the lowest "
               "digit: codec/tuples.py")

# --- bitsnap ------------------------------------------------------------------------------------
BITSNAP = _stage("bitsnap/1", "a BitSnap record: a model-state delta or a quantized optimizer state")
BITMASK = _stage("bitmask/1", "changed-element mask (bitpack/1, bits 1) then the changed values, against "
                 "the base: codec/bitmask.py")
CLUSTER8 = _stage("cluster8/1", "labels (bitpack/1, bits 4), uint8 values, fp32 scale and min per cluster: "
                  "quant/cluster8.py")
ZERO_IF = _stage("zero-if/1", "then 0 wherever the record meta.zero_if_zero decodes to 0")

# --- ExCP ---------------------------------------------------------------------------------------
EXCP_RESIDUAL = _stage("excp-residual/1", "the weight is the parent's rebuilt weight + the decoded residual")
EXCP_TENSOR = _stage("excp-tensor/2", "a parameter's residual parts dw, m, v (eq. 5/6 masks), each dense fp32 "
                     "or k-means codes (bitpack/1 where packed) + codebook: quant/excp.py")
EXCP_TENSOR_V1 = _stage("excp-tensor/1", "ckptzip 0.1: as excp-tensor/2 with codes packed MSB first; in "
                        "exp_avg / exp_avg_sq records: as joint/1", legacy_in=("excp", "excp-fixed"))
EXCP_BASE = _stage("excp-base/1", "no bytes: the keyframe's value (the authors restore the base optimizer's step)")
JOINT = _stage("joint/1", "no bytes of its own: part meta.part of the parameter decoded with record meta.of")
KMEANS_NONZERO = _stage("kmeans-nonzero/1", "a keyframe's parts: k-means of all non-zeros, no masks")
EXCP_CODES = _stage("excp-codes/2", "the k-means codes are in the shared 'codes' blob, conditional sub-streams "
                    "coded by the stages that follow (method_meta.streams)")
EXCP_CODES_V1 = _stage("excp-codes/1", "ckptzip 0.1: as excp-codes/2; the following coder xz/1 or zstd/1 "
                       "compressed MSB-first packed codes", legacy_in=("excp-fixed",))


def pipeline(*stages: Stage) -> list[str]:
    return [s.descriptor for s in stages]


def get(descriptor: str, *, record: str, method: str) -> Stage:
    """The stage of ``descriptor`` in a record of ``method``'s file; UnknownStageError if this
    reader does not know it there."""
    s = STAGES.get(descriptor) if isinstance(descriptor, str) else None
    if s is not None and (not s.legacy_in or method in s.legacy_in):
        return s
    name = descriptor.partition("/")[0] if isinstance(descriptor, str) else repr(descriptor)
    readable = [d for d, t in STAGES.items() if t.name == name and (not t.legacy_in or method in t.legacy_in)]
    if readable:
        raise UnknownStageError(f"record {record!r} (method {method!r}) names stage {descriptor!r}; this ckptzip "
                                f"reads {', '.join(readable)} there: upgrade ckptzip to read the file")
    raise UnknownStageError(f"record {record!r} (method {method!r}) names unknown stage {descriptor!r}: the file "
                            "was written by a newer ckptzip (upgrade ckptzip) or is corrupt")


def check_pipeline(pipeline: list, *, record: str, method: str) -> list[Stage]:
    """Every descriptor of a record's pipeline, resolved; the first unknown one raises."""
    if not isinstance(pipeline, list) or not pipeline:
        raise CorruptCheckpointError(f"record {record!r} has no pipeline")
    return [get(d, record=record, method=method) for d in pipeline]


# --- running stages that have a codec of their own ----------------------------------------------
def encode(stages: list[Stage], x, *, bits: int | None = None, level: int | None = None) -> bytes:
    """Run ``x`` through the stages in order (``bits`` for bitpack/1, ``level`` for zstd-frame/1)."""
    for s in stages:
        if s.takes not in (BYTES, CODES):
            raise ValueError(f"stage {s.descriptor} cannot be run on its own")
        x = s.encode(x, bits=bits) if s is BITPACK else s.encode(x, level=level) if s is ZSTD_FRAME and level \
            else s.encode(x)
    return x


def decode(stages: list[Stage], data, *, what: str, n: int | None = None, bits: int | None = None,
           max_bytes: int | None = None):
    """Inverse of :func:`encode`. Each frame is bounded by what its inner stage can hold: a packed
    code stream of ``n`` codes, or ``max_bytes`` for the outermost input."""
    for i in reversed(range(len(stages))):
        s = stages[i]
        if s.takes == CODES:
            if i:
                raise CorruptCheckpointError(f"{what}: stage {s.descriptor} must come first")
            data = s.decode(data, n=n, bits=bits) if s is BITPACK else s.decode(data)
        elif s.takes == BYTES:
            limit = max_bytes if i == 0 else _bound(stages[i - 1], n, bits)
            data = s.decode(data) if s in (RAW, BYTEGROUP) else s.decode(data, max_bytes=limit, what=what)
        else:
            raise CorruptCheckpointError(f"{what}: stage {s.descriptor} cannot be run on its own")
    return data


def _bound(inner: Stage, n: int | None, bits: int | None) -> int:
    from .bitpack import packed_nbytes

    if inner is BITPACK and n is not None and bits is not None:
        return packed_nbytes(n, bits)
    raise CorruptCheckpointError(f"a frame around {inner.descriptor} has no size bound")


def _identity(x, **_):
    return x


def _pack(codes, *, bits: int) -> bytes:
    import torch

    from . import bitpack

    c = codes if isinstance(codes, torch.Tensor) else torch.from_numpy(codes)
    return bitpack.pack(c, bits).cpu().numpy().tobytes()


def _unpack(buf, *, n: int, bits: int):
    from . import bitpack

    return bitpack.unpack(buf, n, bits).numpy()
