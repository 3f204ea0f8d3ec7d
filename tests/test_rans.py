"""Interleaved static rANS coder (codec/rans.py): round trips, numba kernels == the reference,
size against constriction's ANS, hostile buffers, and a dynaquant chain coded with it."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from helpers import coded_stages
import torch

from ckptzip.codec import entropy as E
from ckptzip.codec import streamframe as S
from ckptzip.codec import rans as R
from ckptzip.errors import CorruptCheckpointError

BACKENDS = ["numpy", "numba"] if R.HAVE_NUMBA else ["numpy"]


def streams():
    rng = np.random.default_rng(0)
    yield "empty", np.zeros(0, dtype=np.int64)
    yield "one", np.array([7], dtype=np.int64)
    yield "one-value", np.full(300, -9, dtype=np.int64)
    yield "two-skewed", np.where(np.arange(3001) == 1234, 5, -5)            # p = 1 - 1/3001
    yield "sign", (rng.random(2001) < 0.96).astype(np.int64)
    yield "many-distinct", rng.permutation(np.arange(-700, 1300))          # every count 1: P > log2 n
    yield "negative-zipf", rng.zipf(1.5, 3003).astype(np.int64) * -1
    yield "wide", rng.choice(np.array([-(1 << 63), 0, (1 << 63) - 1]), 1002)
    # a real Adam exp_avg's 8192 1-bit direction codes (tests/test_ans.py: under the naive size bound)
    sign = (Path(__file__).parent / "data" / "ans_sign_stream.bin").read_bytes()
    yield "real-sign", np.unpackbits(np.frombuffer(sign, dtype=np.uint8)).astype(np.int64)


@pytest.mark.parametrize("name,x", list(streams()))
def test_round_trip_every_lane_count_and_backends_agree(name, x):
    for lanes in R.LANES:
        bufs = {b: R.rans_encode(x, lanes=lanes, backend=b) for b in BACKENDS}
        assert len(set(bufs.values())) == 1, f"{name}: kernel bytes differ from the reference"
        for b in BACKENDS:
            out = R.rans_decode(bufs["numpy"], backend=b)
            assert out.dtype == np.int64 and np.array_equal(out, x), (name, lanes, b)


@pytest.mark.skipif(not R.HAVE_NUMBA, reason="the batch kernel is numba's")
def test_batch_kernel_writes_rans_encode_bytes():
    # rans_encode_codes: each segment's stream (or its cyclic delta's) as rans_encode writes it; a
    # segment it cannot take (code out of range, sparse alphabet) comes back None, the rest unharmed
    rng = np.random.default_rng(7)
    for dtype, B in ((np.uint8, 256), (np.int8, 100), (np.int16, 3000), (np.int32, 70_000), (np.int64, 5)):
        sizes = [0, 1, 2, 37, 5000, 40_000]                   # 1, 2 and 4 lanes, a single value, empty
        cur = [np.minimum(rng.geometric(0.3, n) - 1, B - 1).astype(dtype) for n in sizes]
        prev = [rng.integers(0, B, n).astype(dtype) for n in sizes]
        for c in cur[3:]:
            c[:2] = (0, B - 1)                                # the ends of the range
        for delta in (np.zeros(len(sizes), bool), np.arange(len(sizes)) % 2 == 1):
            got = R.rans_encode_codes(cur, np.full(len(sizes), B), prev, delta)
            want = [R.rans_encode((p.astype(np.int64) - c) % B if d else c) for c, p, d in zip(cur, prev, delta)]
            # None only where rans_encode's general normalization takes over (~30k distinct deltas)
            assert all(g == w or (g is None and B == 70_000) for g, w in zip(got, want)), (dtype, delta)
            assert sum(g is None for g in got) <= 1
    # many streams of each lane count: the kernel groups single-lane streams by four and two-lane
    # ones by two, sorted by length, odd and even counts; values above zero and spans on either
    # side of the value-row table's limit (_VALUE_ROWS); long runs of one value (delta codes)
    sizes = [int(n) for n in rng.choice([3, 64, 65, 130, 999, 1500, 1501, 3001, 4000, 6000, 30_001, 120_000], 40)]
    sizes += [30_000, 33_001, 36_000]                        # two-lane streams, odd and even
    for B in (40, R._VALUE_ROWS + 7, 5000):
        cur = []
        for j, n in enumerate(sizes):
            c = np.where(rng.random(n) < 0.87, 0, rng.integers(0, B, n)) + (j % 3)  # lo 0, 1 or 2
            if j % 4 == 0:
                c[0] = B - 1                                   # the widest span
            cur.append(np.minimum(c, B - 1).astype(np.int16))
        prev = [np.where(rng.random(n) < 0.9, c, rng.integers(0, B, n)).astype(np.int16) for c, n in zip(cur, sizes)]
        delta = np.arange(len(sizes)) % 3 == 0
        want = [R.rans_encode((p.astype(np.int64) - c) % B if d else c) for c, p, d in zip(cur, prev, delta)]
        assert R.rans_encode_codes(cur, np.full(len(sizes), B), prev, delta) == want, B
        # read in place: views at odd offsets into one buffer give the same bytes
        at = np.cumsum([0] + sizes)
        joined, joined_prev = np.concatenate([[0]] + cur).astype(np.int16), np.concatenate([[0]] + prev).astype(np.int16)
        views = [joined[1 + a:1 + e] for a, e in zip(at, at[1:])]
        prev_views = [joined_prev[1 + a:1 + e] for a, e in zip(at, at[1:])]
        got = R.rans_encode_codes(views, np.full(len(sizes), B), prev_views, delta)
        assert got == want, B
        assert {R.rans_decode(g)[0] >= 0 for g in got} == {True}
    bad = np.array([0, 1, 7, 1, 0, 1 << 30], dtype=np.int64)  # [7] outside B = 4; then a sparse alphabet
    got = R.rans_encode_codes([bad[:2], bad[2:4], bad[4:6]], np.array([4, 4, 1 << 31]))
    assert got == [R.rans_encode(bad[:2]), None, None]
    # an array the kernel cannot read in place is refused, not misread
    with pytest.raises(ValueError, match="C-contiguous 1-D int64"):
        R.rans_encode_codes([bad[:2], bad[::2]], np.array([4, 4]))
    with pytest.raises(ValueError, match="C-contiguous 1-D int64"):
        R.rans_encode_codes([bad[:2], bad[2:4].astype(np.int32)], np.array([4, 4]))
    with pytest.raises(ValueError, match="a delta needs prevs"):  # never the curs read as their own parents
        R.rans_encode_codes([bad[:2]], np.array([4]), None, np.array([True]))


def test_large_stream_and_torch_input():
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.geometric(0.4, 1_000_003)).to(torch.int16)     # 4 lanes, a partial group
    buf = R.rans_encode(x)
    assert np.array_equal(R.rans_decode(buf), x.numpy())
    assert E.entropy_bits(x) / 8 <= len(buf) <= 1.001 * E.entropy_bits(x) / 8 + 64


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32])
def test_narrow_symbols_write_the_int64_bytes(dtype):
    # the kernels read narrow symbols as they are (a 124M-code stream's int64 copy was 1 GB of page faults)
    rng = np.random.default_rng(5)
    hi = 256 if dtype == np.uint8 else 128
    for x in (rng.integers(0, hi, 20_000), np.minimum(rng.geometric(0.3, 50_000), hi - 1), np.arange(hi) % hi):
        for encode in (R.rans_encode, E.get_coder("huffman")[0]):
            want = encode(x.astype(np.int64))
            assert encode(x.astype(dtype)) == want and encode(torch.from_numpy(x.astype(dtype))) == want


def test_skewed_streams_cost_about_what_ans_costs():
    pytest.importorskip("constriction")
    from ckptzip.codec.ans import ans_encode

    rng = np.random.default_rng(2)
    for p, n in ((0.95, 40_000), (0.995, 200_000), (0.6, 30_000)):
        x = (rng.random(n) > p).astype(np.int64)
        a, r = len(ans_encode(x)), len(R.rans_encode(x))
        assert r <= 1.005 * a + 8, (p, n, r, a)
    x = rng.choice(4, 100_000, p=[0.9, 0.06, 0.03, 0.01])                 # 2-bit codes
    assert len(R.rans_encode(x)) <= 1.005 * len(ans_encode(x)) + 8


def test_normalize_counts_sums_to_the_total():
    for counts, P in (([1, 10**9, 5], 24), ([3, 1], 8), ([1] * 3000 + [10**6], 12)):   # the last forces 1s
        q = R.normalize_counts(np.array(counts), P)
        assert int(q.sum()) == 1 << P and int(q.min()) >= 1
        assert int(q.argmax()) == int(np.argmax(counts))
    with pytest.raises(ValueError, match="cannot share"):
        R.normalize_counts(np.ones(300, dtype=np.int64), 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_flipped_and_forged_buffers_raise(backend):
    rng = np.random.default_rng(3)
    x = rng.geometric(0.2, 600).astype(np.int64)
    buf = R.rans_encode(x, lanes=2)
    for cut in range(len(buf)):
        with pytest.raises(CorruptCheckpointError):
            R.rans_decode(buf[:cut], backend=backend)
    for bit in random.Random(0).sample(range(8 * len(buf)), 120):
        bad = bytearray(buf)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptCheckpointError):
            R.rans_decode(bytes(bad), backend=backend)
    # behind a valid CRC: garbage words, other lane counts, a huge n
    body = bytearray(buf[:-4])
    body[-9] ^= 0x5A
    with pytest.raises(CorruptCheckpointError):
        R.rans_decode(S.seal(bytes(body)), backend=backend)
    for forged in (_forge(x, lanes=3), _forge(x, n=1 << 40), _forge(x, freq_bump=1)):
        with pytest.raises(CorruptCheckpointError):
            R.rans_decode(forged, backend=backend)


@pytest.mark.parametrize("backend,threads", [(b, t) for b in BACKENDS for t in (1, 3)])
def test_decode_many_is_decode_of_each(backend, threads):
    """Every stream of streams() at every lane count, and single-lane streams of many lengths (the
    kernel decodes four at a time, each to its own end), on one thread or spread over three: what
    rans_decode gives, in input order."""
    rng = np.random.default_rng(5)
    xs = [x for _, x in streams()] + [(rng.random(n) < p).astype(np.int64) * 3 - 1
                                      for n, p in ((4000, 0.98), (4001, 0.9), (37, 0.5), (9000, 0.99), (2, 0.5))]
    bufs = [R.rans_encode(x, lanes=lanes) for x in xs for lanes in R.LANES]
    out = R.rans_decode_many(bufs, backend=backend, threads=threads)
    assert len(out) == len(bufs)
    for buf, got in zip(bufs, out):
        assert got.dtype == np.int64 and np.array_equal(got, R.rans_decode(buf))
    assert R.rans_decode_many([]) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_many_reports_a_corrupt_stream_in_a_group(backend):
    """A stream whose header is sound but whose words are not fails its group of four; decoded
    alone, it raises rans_decode's error (the others decode)."""
    rng = np.random.default_rng(6)
    good = [R.rans_encode((rng.random(3000) < 0.97).astype(np.int64), lanes=1) for _ in range(7)]
    body = bytearray(good[2][:-4])
    body[-9] ^= 0x5A
    bad = S.seal(bytes(body))
    with pytest.raises(CorruptCheckpointError, match="does not decode") as alone:
        R.rans_decode(bad, backend=backend)
    for threads in (1, 2):
        with pytest.raises(CorruptCheckpointError) as many:
            R.rans_decode_many(good[:2] + [bad] + good[3:], backend=backend, threads=threads)
        assert str(many.value) == str(alone.value)
    assert [a.tolist() for a in R.rans_decode_many(good, backend=backend)] == [R.rans_decode(b).tolist() for b in good]


def test_codes_decoded_ahead_are_the_codes():
    """entropy.decode_symbols_many: the order-0 rANS streams within the budget decoded ahead, the
    rest (RLE, another coder, past the budget) left to decode_codes; decode_codes given them
    returns what it decodes itself; one damaged buffer and nothing is decoded ahead."""
    rng = np.random.default_rng(7)
    codes = [torch.from_numpy(rng.integers(0, 4, n)) for n in (500, 3000, 700, 800, 900)]
    codes[3][100:700] = 0  # a long run: RLE applies
    bufs = [E.encode_codes(None, c, 4, coder=coder, rle=rle)
            for c, coder, rle in zip(codes, ["rans", "rans", "zstd", "rans", "rans"], [False, False, False, True, False])]
    assert E._split_codes(bufs[3])[0]["rle"]
    ahead = E.decode_symbols_many(bufs, max_symbols=1500)
    assert [a is not None for a in ahead] == [True, False, False, False, True]  # 3000 codes: past the budget left
    for buf, sym, c in zip(bufs, ahead, codes):
        assert torch.equal(E.decode_codes(buf, symbols=sym), c) and torch.equal(E.decode_codes(buf), c)
    damaged = bytearray(bufs[4])
    damaged[-2] ^= 1
    assert E.decode_symbols_many(bufs[:4] + [bytes(damaged)], max_symbols=1 << 20) == [None] * 5


def _forge(x, *, lanes=None, n=None, freq_bump=0) -> bytes:
    """x's stream rebuilt field by field with one field replaced (resealed)."""
    r, n0, values = S.open_alphabet_stream(R.rans_encode(x, lanes=1), b"RA\x01", "t")
    freqs = r.varints(values.size)
    freqs[0] += np.uint64(freq_bump)
    r.u8()
    words = bytes(r.take(4 * r.varint()))
    out = S.alphabet_header(b"RA\x01", n0 if n is None else n, values)
    out += S.pack_varints(freqs)
    out.append(1 if lanes is None else lanes)
    S.write_varint(out, len(words) // 4)
    return S.seal(bytes(out) + words)


def test_dynaquant_chain_with_the_rans_coder(tmp_path, digits_snapshots):
    """A chain coded with rans restores bit for bit what the same chain coded with zstd restores
    (same quantization; the coders are lossless)."""
    from helpers import assert_same

    from ckptzip import CheckpointChain
    from ckptzip.format import decode_container

    model, opt, snaps, _ = digits_snapshots
    chains = {c: CheckpointChain(tmp_path / c, "dynaquant", {"codes": {"coder": c, "rearrange": False, "rle": False}})
              for c in ("rans", "zstd")}
    for i, s in enumerate(snaps[:3]):
        for ch in chains.values():
            e = ch.save({"model": s.model, "optimizer": s.optimizer}, i + 1, model=model, optimizer=opt)
    recs = decode_container(chains["rans"].storage.read(e.file)).manifest["records"].values()
    weights = [r["pipeline"] for r in recs if r["pipeline"][0] == "dynaquant/1"]
    assert weights and all(coded_stages(p)[-1] == "rans/1" for p in weights)
    for step in (1, 3):
        assert_same(chains["rans"].load(step), chains["zstd"].load(step))


@pytest.mark.parametrize("backend", ["numba", "numpy"] if R.HAVE_NUMBA else ["numpy"])
def test_narrow_decode_is_uint8_where_every_value_fits(backend):
    """``narrow=True`` decodes a stream of values in [0, 255] to uint8 (the restore's order-0 code
    streams: 1 fresh byte a code, not 8) and any other stream to int64, the same values; so does
    decode_codes for an order-0 rANS code stream."""
    g = np.random.default_rng(5)
    for x, want in ((g.integers(0, 34, 70_001), np.uint8), (g.integers(0, 256, 999), np.uint8),
                    (g.integers(0, 300, 999), np.int64), (g.integers(-3, 9, 999), np.int64)):
        got = R.rans_decode(R.rans_encode(x), backend=backend, narrow=True)
        assert got.dtype == want and np.array_equal(got.astype(np.int64), x)
        assert R.rans_decode(R.rans_encode(x), backend=backend).dtype == np.int64
    codes = torch.from_numpy(g.integers(0, 34, 5000))
    got = E.decode_codes(E.encode_codes(None, codes, 34, coder="rans", rle=False))
    assert got.dtype == torch.uint8 and torch.equal(got.long(), codes)
