"""ANS coding of integer streams with the empirical frequencies (constriction's AnsCoder).

Same interface as codec/huffman.py, for comparison and for skewed streams where Huffman's
whole-bit codes waste space (a symbol with p = 0.95 costs Huffman 1 bit, ANS ~0.07)::

    buf = ans_encode(symbols)          # 1-D integers (numpy or torch) -> bytes
    out = ans_decode(buf)              # -> 1-D numpy int64, equal to symbols

The model is a ``constriction.stream.model.Categorical`` over the alphabet (sorted distinct
values) whose probabilities are the symbol counts quantized to a total of about 2**P, P = min(24, max(8,
bit length of n)) (each present symbol keeps at least 1; 24 bits is the coder's own fixed-point
precision, a smaller total keeps short streams' headers short); the quantized counts are stored,
so the decoder rebuilds exactly the encoder's model. Buffer, byte by byte::

    b"AN" 0x01                 magic + format version
    n (varint)                 number of symbols
    k (varint)                 number of distinct symbols (0 iff n == 0)
    alphabet                   zigzag varint of the smallest value, then k-1 varints (gap - 1)
    freqs (k varints)          quantized counts, in value order (k >= 2 only)
    n_words (varint)           (k >= 2 only)
    words (n_words x u32 LE)   constriction's compressed stack (k >= 2 only)
    crc32 (u32 LE)             of everything above

Needs the optional ``constriction`` package (``pip install ckptzip[fast]``).
"""
from __future__ import annotations

import numpy as np

from ..errors import CorruptCheckpointError
from .streamframe import (alphabet_header, as_symbols, open_alphabet_stream, pack_varints, seal, single_value_stream,
                          symbol_table, write_varint)

__all__ = ["ans_encode", "ans_decode", "quantize_counts", "PRECISION_BITS"]

PRECISION_BITS = 24              # constriction's default AnsCoder model precision
_MAX_DISTINCT = 1 << 22          # leaves each symbol >= 4 units of the 2**24 total on average
_MAGIC = b"AN\x01"
_STATE_SLACK_BITS = 256


def ans_encode(symbols) -> bytes:
    """Encode a 1-D integer stream with ANS under its own empirical distribution."""
    sym = as_symbols(symbols)
    values, counts, index = symbol_table(sym)
    k = values.size
    if k > _MAX_DISTINCT:
        raise ValueError(f"{k} distinct symbols exceed the ANS coder's {_MAX_DISTINCT}; "
                         "use the 'huffman' or 'zstd' coder")
    out = alphabet_header(_MAGIC, sym.size, values)
    if k >= 2:
        # a total near n keeps small streams' headers small; 2**24 is the coder's resolution
        freqs = quantize_counts(counts, min(PRECISION_BITS, max(8, int(sym.size).bit_length())))
        coder = _constriction().stream.stack.AnsCoder()
        coder.encode_reverse(index, _model(freqs))
        words = coder.get_compressed().astype("<u4")
        out += pack_varints(freqs)
        write_varint(out, words.size)
        out += words.tobytes()
    return seal(out)


def ans_decode(buf) -> np.ndarray:
    """Inverse of :func:`ans_encode` -> 1-D int64 array. Corrupt input: CorruptCheckpointError."""
    r, n, values = open_alphabet_stream(buf, _MAGIC, "ans stream", max_k=_MAX_DISTINCT)
    single = single_value_stream(r, n, values)
    if single is not None:
        return single
    k = values.size
    freqs = r.varints(k)
    n_words = r.varint()
    words = np.frombuffer(r.take(4 * n_words), dtype="<u4").astype(np.uint32)
    r.expect_end()
    if int(freqs.min()) < 1 or int(freqs.max()) > 1 << PRECISION_BITS:
        raise CorruptCheckpointError("ans stream frequencies are out of range")
    # each symbol costs at least -log2(max p) bits, less what the coder's 64-bit state carries
    # beyond its words (a real 8192-symbol sign stream came out 96 bits under the bound); bounds
    # the output before allocating it
    min_bits = -np.log2(float(freqs.max()) / float(freqs.astype(np.float64).sum()))
    if n * min_bits > 32 * n_words + _STATE_SLACK_BITS:
        raise CorruptCheckpointError(f"ans payload of {n_words} words cannot hold {n} symbols")
    try:
        coder = _constriction().stream.stack.AnsCoder(words)
        index = coder.decode(_model(freqs), n)
        done = coder.is_empty()
    except (ValueError, RuntimeError, OverflowError) as e:
        raise CorruptCheckpointError(f"ans payload does not decode: {e}") from None
    if not done or index.size != n:
        raise CorruptCheckpointError("ans payload does not end where its symbols end")
    if index.size and (int(index.min()) < 0 or int(index.max()) >= k):
        raise CorruptCheckpointError("ans payload decodes to symbols outside the alphabet")
    return values[index]


def quantize_counts(counts, precision_bits: int = PRECISION_BITS) -> np.ndarray:
    """Scale counts to a total of about 2**precision_bits; every present symbol keeps >= 1."""
    counts = np.asarray(counts, dtype=np.float64)
    q = np.rint(counts * ((1 << precision_bits) / counts.sum()))
    return np.maximum(q, 1).astype(np.uint64)


def _model(freqs: np.ndarray):
    # same float64 probabilities on both sides -> bit-identical fixed-point model
    return _constriction().stream.model.Categorical(freqs.astype(np.float64), perfect=False)


def _constriction():
    try:
        import constriction
    except ImportError:  # pragma: no cover
        raise ImportError("the 'ans' coder needs constriction: pip install 'ckptzip[fast]'") from None
    return constriction
