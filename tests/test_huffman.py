"""Canonical length-limited Huffman coder (codec/huffman.py): exactness, optimality, robustness."""
from __future__ import annotations

import random
import struct
import zlib

import dahuffman
import numpy as np
import pytest
import torch

from ckptzip.codec import huffman as H
from ckptzip.errors import CorruptCheckpointError

BACKENDS = ["numpy"] + (["numba"] if H.HAVE_NUMBA else [])


def optimal_total_bits(counts: np.ndarray) -> int:
    """Total bits of dahuffman's (heap-based, optimal) code over exactly these symbols."""
    freqs = {i: int(c) for i, c in enumerate(counts)}
    table = dahuffman.HuffmanCodec.from_frequencies(freqs, eof=0).get_code_table()  # eof=0: no extra symbol
    return sum(int(c) * table[i][0] for i, c in enumerate(counts))


def kraft(lengths: np.ndarray) -> float:
    return float(np.sum(2.0 ** -lengths.astype(np.float64)))


def streams():
    rng = np.random.default_rng(0)
    yield "geometric", rng.geometric(0.3, 20_000).astype(np.int64)
    yield "zipf-negative", rng.zipf(1.4, 20_000).astype(np.int64) - 100
    yield "rle-like", np.where(rng.random(20_000) < 0.5, -rng.integers(0, 16, 20_000), rng.integers(2, 400, 20_000))
    yield "two", rng.integers(0, 2, 999).astype(np.int64)
    yield "uniform-256", rng.integers(0, 256, 20_000).astype(np.int64)
    yield "wide-values", rng.choice(np.array([-(1 << 62), -5, 0, 1 << 40, (1 << 62) + 7]), 5_000)
    yield "int64-extremes", rng.choice(np.array([-(1 << 63), -1, 0, (1 << 63) - 1]), 3_000)


@pytest.mark.parametrize("name,x", list(streams()))
def test_round_trip_and_backends_agree(name, x):
    bufs = {b: H.huffman_encode(x, backend=b) for b in BACKENDS}
    assert len(set(bufs.values())) == 1, "numba and numpy encoders must write identical bytes"
    buf = bufs[BACKENDS[0]]
    for b in BACKENDS:
        out = H.huffman_decode(buf, backend=b)
        assert out.dtype == np.int64 and np.array_equal(out, x), (name, b)


@pytest.mark.parametrize("name,x", list(streams())[:5])
def test_total_bits_equal_optimal_huffman(name, x):
    _, counts = np.unique(x, return_counts=True)
    for backend in BACKENDS:
        lengths = H.code_lengths(counts, backend=backend)
        assert int(lengths.max()) <= H.MAX_CODE_LEN
        assert kraft(lengths) == pytest.approx(1.0, abs=1e-12)
        assert int((counts * lengths).sum()) == optimal_total_bits(counts), (name, backend)
    # the payload is exactly the optimal number of bits, rounded up to a byte
    buf = H.huffman_encode(x)
    total = int((counts * H.code_lengths(counts)).sum())
    assert len(buf) >= (total + 7) // 8 and len(buf) <= (total + 7) // 8 + 3 * counts.size + 32


def test_length_limit_on_fibonacci_counts():
    # Fibonacci counts force a maximally skewed tree: optimal depth k - 1 = 39 > 24
    fib = [1, 1]
    while len(fib) < 40:
        fib.append(fib[-1] + fib[-2])
    counts = np.array(fib, dtype=np.int64)
    free = H.code_lengths(counts, max_code_len=32)
    assert int(free.max()) == 32                                # limited at 32 already
    for backend in BACKENDS:
        lim = H.code_lengths(counts, max_code_len=24, backend=backend)
        assert int(lim.max()) == 24 and kraft(lim) == pytest.approx(1.0, abs=1e-12)
        # the heuristic costs little against the unrestricted optimum
        assert int((counts * lim).sum()) <= 1.001 * optimal_total_bits(counts)
    # a real stream whose optimal depth (25) exceeds the default limit of 24
    x = np.repeat(np.arange(26), fib[:26])
    x = x[np.random.default_rng(1).permutation(x.size)]
    for backend in BACKENDS:
        for limit in (24, 12):
            buf = H.huffman_encode(x, max_code_len=limit, backend=backend)
            assert np.array_equal(H.huffman_decode(buf, backend=backend), x), (backend, limit)


def test_canonical_codes_are_prefix_free_and_ordered():
    lengths = np.array([3, 3, 3, 3, 3, 2, 4, 4], dtype=np.uint8)
    codes = H.canonical_codes(lengths)
    words = [format(int(c), f"0{int(l)}b") for c, l in zip(codes, lengths)]
    assert words[5] == "00"                                      # shortest first, value order inside
    assert words[:5] == ["010", "011", "100", "101", "110"]
    assert words[6:] == ["1110", "1111"]
    for a in words:
        for b in words:
            assert a == b or not b.startswith(a)


def test_edge_cases():
    empty = H.huffman_encode(np.zeros(0, dtype=np.int64))
    assert H.huffman_decode(empty).size == 0
    one = H.huffman_encode(np.full(1_000_000, -7))
    assert len(one) < 20                                        # one distinct symbol: no payload
    assert np.array_equal(H.huffman_decode(one), np.full(1_000_000, -7))
    t = torch.tensor([3, 1, 3, 3], dtype=torch.int32)
    assert H.huffman_decode(H.huffman_encode(t)).tolist() == [3, 1, 3, 3]
    with pytest.raises(TypeError):
        H.huffman_encode(np.array([1.5]))
    with pytest.raises(ValueError, match="max_code_len"):
        H.huffman_encode(np.arange(10), max_code_len=3)


@pytest.mark.skipif(not H.HAVE_NUMBA, reason="the numpy reference decoder is too slow for 2**20 symbols")
def test_huge_alphabet():
    rng = np.random.default_rng(2)
    k = 1 << 20
    x = np.concatenate([np.arange(k, dtype=np.int64) * 3 - k, rng.integers(0, 64, 1 << 20)])
    rng.shuffle(x)
    buf = H.huffman_encode(x)
    assert np.array_equal(H.huffman_decode(buf), x)
    sparse = np.unique(rng.integers(-(1 << 60), 1 << 60, 50_000))  # span too wide for a count table
    assert np.array_equal(H.huffman_decode(H.huffman_encode(sparse)), sparse)


def _reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_and_truncated_input_raise(backend):
    rng = np.random.default_rng(3)
    x = rng.geometric(0.2, 400).astype(np.int64)
    buf = H.huffman_encode(x)
    for cut in range(len(buf)):
        with pytest.raises(CorruptCheckpointError):
            H.huffman_decode(buf[:cut], backend=backend)
    r = random.Random(0)
    for bit in r.sample(range(8 * len(buf)), 150):
        bad = bytearray(buf)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptCheckpointError):
            H.huffman_decode(bytes(bad), backend=backend)
    with pytest.raises(CorruptCheckpointError):
        H.huffman_decode(b"XX\x01" + buf[3:], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_with_valid_crc_never_crashes(backend):
    # bytes that pass the CRC but hold garbage must still only give typed errors or a decode
    rng = np.random.default_rng(4)
    x = rng.geometric(0.3, 300).astype(np.int64)
    body = bytearray(H.huffman_encode(x)[:-4])
    r = random.Random(1)
    outcomes = {"raised": 0, "decoded": 0}
    for _ in range(300):
        bad = bytearray(body)
        for _ in range(r.randint(1, 4)):
            bad[r.randrange(len(bad))] = r.randrange(256)
        if r.random() < 0.3:
            bad = bad[: r.randrange(len(bad))]
        try:
            out = H.huffman_decode(_reseal(bytes(bad)), backend=backend)
            assert out.dtype == np.int64
            outcomes["decoded"] += 1
        except CorruptCheckpointError:
            outcomes["raised"] += 1
    assert outcomes["raised"] > 100
    # an oversubscribed (Kraft > 1) length table is rejected
    two = H.huffman_encode(np.array([0, 1, 1, 2, 2, 2]))[:-4]
    with pytest.raises(CorruptCheckpointError, match="Kraft"):
        H.huffman_decode(_reseal(two.replace(b"\x02\x02\x01", b"\x01\x01\x01")), backend=backend)
