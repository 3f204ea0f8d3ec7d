"""ANS coder (codec/ans.py) and the coder registry / zstd baseline (codec/entropy.py)."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptzip.codec import entropy as E
from ckptzip.codec import streamframe as S
from ckptzip.codec.ans import ans_decode, ans_encode, quantize_counts
from ckptzip.errors import CorruptCheckpointError

pytest.importorskip("constriction")


def streams():
    rng = np.random.default_rng(0)
    yield "empty", np.zeros(0, dtype=np.int64)
    yield "single", np.full(5000, 9, dtype=np.int64)
    yield "two", np.array([4, -4], dtype=np.int64)
    yield "skewed", np.where(rng.random(50_000) < 0.97, 0, rng.integers(1, 16, 50_000))
    yield "zipf-negative", rng.zipf(1.4, 30_000).astype(np.int64) - 100
    yield "wide", rng.choice(np.array([-(1 << 62), 0, 1 << 50]), 2_000)


@pytest.mark.parametrize("name,x", list(streams()))
def test_round_trip(name, x):
    out = ans_decode(ans_encode(x))
    assert out.dtype == np.int64 and np.array_equal(out, x), name


def test_size_close_to_entropy_and_beats_huffman_on_skew():
    rng = np.random.default_rng(1)
    x = np.where(rng.random(200_000) < 0.97, 0, rng.integers(1, 16, 200_000))
    h_bytes = E.entropy_bits(x) / 8
    a = len(ans_encode(x))
    assert h_bytes <= a <= 1.01 * h_bytes + 64
    # Huffman pays >= 1 bit for the 97 % symbol; ANS ~0.04 bits
    assert a < 0.5 * len(E.encode_stream("huffman", x))


def test_torch_input_and_quantized_counts():
    t = torch.tensor([1, 1, 2, 3, 3, 3], dtype=torch.int32)
    assert ans_decode(ans_encode(t)).tolist() == [1, 1, 2, 3, 3, 3]
    q = quantize_counts(np.array([1, 10**9, 5]), 24)
    assert q.min() >= 1 and abs(int(q.sum()) - (1 << 24)) <= 3


def test_corrupt_and_truncated_raise():
    rng = np.random.default_rng(2)
    x = rng.geometric(0.2, 500).astype(np.int64)
    buf = ans_encode(x)
    for cut in range(len(buf)):
        with pytest.raises(CorruptCheckpointError):
            ans_decode(buf[:cut])
    r = random.Random(0)
    for bit in r.sample(range(8 * len(buf)), 150):
        bad = bytearray(buf)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptCheckpointError):
            ans_decode(bytes(bad))


def test_payload_garbage_behind_valid_crc_is_detected():
    rng = np.random.default_rng(3)
    x = rng.geometric(0.3, 2000).astype(np.int64)
    body = bytearray(ans_encode(x)[:-4])
    body[-5] ^= 0xFF                                            # inside the compressed words
    with pytest.raises(CorruptCheckpointError):
        ans_decode(S.seal(bytes(body)))


@pytest.mark.parametrize("coder", sorted(E.CODERS))
def test_registry_round_trip(coder):
    rng = np.random.default_rng(4)
    for x in (np.zeros(0, np.int64), rng.integers(-300, 300, 10_000), np.array([1 << 62, -(1 << 62)])):
        buf = E.encode_stream(coder, x)
        assert np.array_equal(E.decode_stream(coder, buf), x)
    with pytest.raises(ValueError, match="unknown coder"):
        E.get_coder("lz4")


def test_zstd_picks_narrow_width_and_rejects_corruption():
    x = np.arange(-100, 100, dtype=np.int64)
    buf = E.zstd_encode(x)
    assert buf[3] == 1                                          # int8 carries [-100, 100)
    assert np.array_equal(E.zstd_decode(buf), x)
    assert E.zstd_encode(np.array([1 << 40]))[3] == 8
    for cut in range(len(buf)):
        with pytest.raises(CorruptCheckpointError):
            E.zstd_decode(buf[:cut])


def test_varints_vectorized_match_scalar(monkeypatch):
    vals = np.array([0, 1, 127, 128, 300, (1 << 35) + 5, (1 << 64) - 1], dtype=np.uint64)
    scalar = bytearray()
    for v in vals.tolist():
        S.write_varint(scalar, v)
    for reps in (1, 50):  # the kernel (numba), the plain loop and the vectorized numpy form
        packed = S.pack_varints(np.tile(vals, reps))
        with monkeypatch.context() as m:
            m.setattr(S, "_numba", None)
            assert packed == S.pack_varints(np.tile(vals, reps)) == bytes(scalar) * reps
    for reps in (1, 3):  # 7 values: the reader's plain loop; 21: its vectorized form
        many = np.tile(vals, reps)
        r = S.ByteReader(S.pack_varints(many), "test")
        assert r.varints(len(many)).tolist() == many.tolist()
        r.expect_end()
        with pytest.raises(CorruptCheckpointError):
            S.ByteReader(S.pack_varints(many)[:-1], "test").varints(len(many))
    with pytest.raises(CorruptCheckpointError):
        S.ByteReader(b"\x80" * 11, "test").varint()


@pytest.mark.parametrize("kernel", [True, False])
def test_alphabet_and_varint_readers_equal_the_numpy_reference(monkeypatch, kernel):
    """The numba readers (varints, alphabet) give the numpy reference's values and refuse the same
    buffers: truncated, over-long or 2**64 varints, alphabets past int64."""
    if not kernel:
        monkeypatch.setattr(S, "_numba", None)
    top, bottom = (1 << 63) - 1, -(1 << 63)
    rng = np.random.default_rng(3)
    wide = sorted(rng.choice(1 << 40, 300, replace=False) - (1 << 39))
    for values in ([0], [-5, 7], [bottom, bottom + 1, 0, top], wide, list(range(-20, 20))):
        values = np.array(values, dtype=np.int64)
        r = S.ByteReader(S.pack_alphabet(values) + b"!", "test")
        assert S.read_alphabet(r, len(values)).tolist() == values.tolist()
        assert r.u8() == ord("!")
    over = bytearray()
    S.write_varint(over, S.zigzag(top - 1))
    for gaps in ([1], [0, 0], [(1 << 64) - 1]):  # top - 1 + 2 (or more) passes int64
        buf = bytes(over) + S.pack_varints(np.array(gaps, dtype=np.uint64))
        with pytest.raises(CorruptCheckpointError, match="overflows int64"):
            S.read_alphabet(S.ByteReader(buf, "test"), len(gaps) + 1)
    for bad in (b"\x80" * 10 + b"\x00", b"\xff" * 9 + b"\x02", b"\x01\x80"):  # over-long, 2**64, truncated
        with pytest.raises(CorruptCheckpointError):
            S.ByteReader(bad * 20, "test").varints(40)
    many = rng.integers(0, 1 << 63, 50, dtype=np.uint64)
    assert S.ByteReader(S.pack_varints(many), "test").varints(50).tolist() == many.tolist()
    with pytest.raises(CorruptCheckpointError, match="truncated"):  # a corrupt count: no terabyte array
        S.ByteReader(S.pack_varints(many), "test").varints(1 << 40)


def test_stream_under_the_naive_size_bound_decodes():
    """A real 8192-symbol sign stream (an Adam exp_avg's 1-bit direction codes) that constriction
    stores in 96 bits fewer than n * -log2(max p): the decoder's size guard must allow for the
    bits the coder's state carries."""
    bits = np.unpackbits(np.frombuffer((Path(__file__).parent / "data" / "ans_sign_stream.bin").read_bytes(),
                                       dtype=np.uint8)).astype(np.int64)
    assert np.array_equal(ans_decode(ans_encode(bits)), bits)


@pytest.mark.parametrize("name,x", [*streams(), ("span-9000", np.random.default_rng(1).integers(-9, 8991, 20_001))])
def test_symbol_table_matches_numpy_unique(name, x):
    # the counting passes (four interleaved tables for small alphabets, one above 4096 values)
    values, counts, index = S.symbol_table(x)
    want, inverse, want_counts = np.unique(x, return_inverse=True, return_counts=True)
    assert np.array_equal(values, want) and np.array_equal(counts, want_counts)
    assert index.dtype == np.int32 and np.array_equal(index, inverse.reshape(-1))
