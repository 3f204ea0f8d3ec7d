"""Cyclic delta, rearrangement by source bucket, and the full encode_codes/decode_codes pipeline."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from ckptzip.codec import delta as D
from ckptzip.codec.entropy import decode_codes, encode_codes, encode_codes_many, entropy_bits, read_codes_header
from ckptzip.errors import CorruptCheckpointError

BACKENDS = ["torch"] + (["numba"] if D.HAVE_NUMBA else [])
FLAGS = list(itertools.product([False, True], [False, True], ["huffman", "ans", "rans", "zstd"]))
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def uniform_codes(x: torch.Tensor, n_levels: int) -> torch.Tensor:
    """16-level (or n_levels) uniform quantizer over the tensor's own range -> flat int64 codes."""
    x = x.float().reshape(-1)
    lo, hi = x.min(), x.max()
    scale = (hi - lo).clamp_min(1e-12)
    return torch.clamp(torch.round((x - lo) / scale * (n_levels - 1)), 0, n_levels - 1).long()


@pytest.fixture(scope="module")
def real_codes(digits_snapshots):
    """name -> [codes of checkpoint 0..9] for every parameter tensor, 16 levels."""
    _, _, snaps, _ = digits_snapshots
    return {name: [uniform_codes(s.model[name], 16) for s in snaps] for name in snaps[0].model}


# --------------------------------------------------------------------------- cyclic delta
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cyclic_delta_round_trip_and_range(dtype, backend):
    g = torch.Generator().manual_seed(0)
    prev = torch.randint(0, 16, (5000,), generator=g, dtype=dtype)
    cur = torch.randint(0, 32, (5000,), generator=g, dtype=dtype)   # level count grew: B = 32
    d = D.cyclic_delta(prev, cur, 32, backend=backend)
    assert d.dtype == dtype
    assert int(d.min()) >= 0 and int(d.max()) < 32
    assert torch.equal(d.long(), (prev.long() - cur.long()) % 32)
    assert torch.equal(D.undo_cyclic_delta(prev, d, 32, backend=backend), cur)
    # the inverse is the general mod even for deltas outside [0, B)
    assert torch.equal(D.undo_cyclic_delta(prev, d.long() + 64, 32, backend=backend), cur.long())


@pytest.mark.parametrize("backend", BACKENDS)
def test_cyclic_delta_zero_where_unchanged_and_wraps(backend):
    prev = torch.tensor([0, 5, 15, 3])
    cur = torch.tensor([0, 5, 0, 4])
    assert D.cyclic_delta(prev, cur, 16, backend=backend).tolist() == [0, 0, 15, 15]  # 3-4 = -1 = 15


@pytest.mark.parametrize("backend", BACKENDS)
def test_cyclic_delta_rejects_bad_input(backend):
    with pytest.raises(ValueError, match="n_levels"):
        D.cyclic_delta(torch.tensor([0, 20]), torch.tensor([0, 1]), 16, backend=backend)
    with pytest.raises(ValueError, match=r"cur codes span \[-1, 1\]"):
        D.cyclic_delta(torch.tensor([0, 1]), torch.tensor([-1, 1]), 16, backend=backend)
    with pytest.raises(ValueError, match="n_levels"):
        D.rearrange(torch.tensor([0, 1]), torch.tensor([0, 16]), 16, backend=backend)
    with pytest.raises(ValueError, match="codes"):
        D.cyclic_delta(torch.tensor([0, 1]), torch.tensor([0, 1, 2]), 16, backend=backend)
    with pytest.raises(TypeError, match="integer codes"):
        D.cyclic_delta(torch.tensor([0.0]), torch.tensor([0.0]), 16, backend=backend)


NARROW = [torch.uint8, torch.int8, torch.int16]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", NARROW)
def test_cyclic_delta_of_narrow_codes_equals_int64(dtype, backend):
    # B = 10 does not divide 256: a difference taken in uint8 (wrapping) would give other values
    g = torch.Generator().manual_seed(1)
    prev = torch.randint(0, 10, (4000,), generator=g)
    cur = torch.randint(0, 10, (4000,), generator=g)
    want = (prev - cur) % 10
    d = D.cyclic_delta(prev.to(dtype), cur.to(dtype), 10, backend=backend)
    assert d.dtype == dtype and torch.equal(d.long(), want)
    assert torch.equal(D.undo_cyclic_delta(prev.to(dtype), d, 10, backend=backend).long(), cur)
    ds, sizes = D.grouped_cyclic_delta(prev.to(dtype), cur.to(dtype), 10, backend=backend)
    ws, wsizes = D.grouped_cyclic_delta(prev, cur, 10, backend=backend)
    assert ds.dtype == dtype and torch.equal(ds.long(), ws) and torch.equal(sizes, wsizes)
    assert torch.equal(D.undo_grouped_cyclic_delta(prev.to(dtype), ds, 10, backend=backend).long(), cur)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cyclic_delta_widens_when_the_levels_outgrow_cur_dtype(backend):
    # the parent had 300 levels (int16 codes), this checkpoint 200 (uint8): deltas reach 299
    g = torch.Generator().manual_seed(2)
    prev = torch.randint(0, 300, (3000,), generator=g)
    cur = torch.randint(0, 200, (3000,), generator=g)
    for fn in (D.cyclic_delta, lambda p, c, b, backend: D.grouped_cyclic_delta(p, c, b, backend=backend)[0]):
        got = fn(prev.to(torch.int16), cur.to(torch.uint8), 300, backend=backend)
        assert got.dtype == torch.int16
        assert torch.equal(got.long(), fn(prev, cur, 300, backend=backend))
    assert D.delta_dtype(torch.uint8, 256) == torch.uint8 and D.delta_dtype(torch.uint8, 257) == torch.int16
    assert D.delta_dtype(torch.int8, 200) == torch.int16 and D.delta_dtype(torch.int16, 1 << 20) == torch.int32


@pytest.mark.parametrize("rearrange,rle,coder", FLAGS)
def test_pipeline_bytes_of_narrow_codes_equal_int64(real_codes, rearrange, rle, coder):
    # the narrow path (no int64 copy per tensor) writes the bytes the int64 path writes; values >= 128
    # catch a kernel that negates (RLE) or subtracts (delta) in the narrow type
    g = torch.Generator().manual_seed(3)
    seq = real_codes["fc2.weight"]
    pairs = [(seq[4], seq[5], 16), (torch.randint(100, 200, (5000,), generator=g),
                                    torch.randint(130, 250, (5000,), generator=g), 256)]
    for prev, cur, levels in pairs:
        for dtype in (torch.uint8, torch.int16, torch.int32):
            assert encode_codes(None, cur.to(dtype), levels, rle=rle, coder=coder) == \
                encode_codes(None, cur, levels, rle=rle, coder=coder)
            buf = encode_codes(prev.to(dtype), cur.to(dtype), levels, rearrange=rearrange, rle=rle, coder=coder)
            assert buf == encode_codes(prev, cur, levels, rearrange=rearrange, rle=rle, coder=coder)
            got = decode_codes(buf, prev.to(dtype))  # a plain delta's codes come back narrow
            assert got.dtype == (torch.int64 if rearrange else torch.uint8) and torch.equal(got.long(), cur)


# --------------------------------------------------------------------------- rearrangement
def algorithm5(delta: list[int], prev: list[int]) -> dict[int, list[int]]:
    """The paper's Algorithm 5, literally: a dict of lists keyed by source bucket."""
    groups: dict[int, list[int]] = {b: [] for b in sorted(set(prev))}
    for j in range(len(prev)):
        groups[prev[j]].append(delta[j])
    return groups


@pytest.mark.parametrize("backend", BACKENDS)
def test_rearrange_matches_algorithm5_and_is_stable(backend):
    prev = torch.tensor([2, 0, 2, 1, 0, 2, 1, 1])
    delta = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])   # distinct: order is observable
    out, sizes = D.rearrange(delta, prev, 3, backend=backend)
    assert out.tolist() == [11, 14, 13, 16, 17, 10, 12, 15]
    assert sizes.tolist() == [2, 3, 3]
    groups = algorithm5(delta.tolist(), prev.tolist())
    assert out.tolist() == list(itertools.chain.from_iterable(groups[b] for b in sorted(groups)))
    assert torch.equal(D.unrearrange(out, prev, 3, backend=backend), delta)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_levels", [1, 2, 7, 16, 300])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_rearrange_equals_stable_sort_reference(backend, n_levels, dtype):
    g = torch.Generator().manual_seed(n_levels)
    n = 20_000
    prev = torch.randint(0, n_levels, (n,), generator=g, dtype=dtype)
    delta = torch.arange(n, dtype=dtype)                       # payload = original index
    out, sizes = D.rearrange(delta, prev, n_levels, backend=backend)
    ref = torch.argsort(prev.long(), stable=True)             # reference only, in the test
    assert torch.equal(out.long(), ref)
    assert torch.equal(sizes, torch.bincount(prev.long(), minlength=n_levels))
    assert torch.equal(D.unrearrange(out, prev, n_levels, backend=backend), delta)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_fused_grouped_delta_equals_composition(backend, dtype):
    g = torch.Generator().manual_seed(5)
    prev = torch.randint(0, 12, (30_000,), generator=g, dtype=dtype)
    cur = torch.randint(0, 20, (30_000,), generator=g, dtype=dtype)
    ref, ref_sizes = D.rearrange(D.cyclic_delta(prev, cur, 20, backend="torch"), prev, 20, backend="torch")
    got, sizes = D.grouped_cyclic_delta(prev, cur, 20, backend=backend)
    assert got.dtype == dtype and torch.equal(got, ref) and torch.equal(sizes, ref_sizes)
    assert torch.equal(D.undo_grouped_cyclic_delta(prev, got, 20, backend=backend), cur)
    with pytest.raises(ValueError, match="cur codes"):
        D.grouped_cyclic_delta(prev, cur + 20, 20, backend=backend)


def test_rearrange_uses_no_comparison_sort(monkeypatch):
    def banned(*a, **k):
        raise AssertionError("rearrange must not sort")

    for name in ("sort", "argsort", "msort", "unique"):
        monkeypatch.setattr(torch, name, banned)
        monkeypatch.setattr(torch.Tensor, name, banned)
    g = torch.Generator().manual_seed(1)
    prev = torch.randint(0, 16, (1000,), generator=g)
    delta = torch.randint(0, 16, (1000,), generator=g)
    for backend in BACKENDS:
        out, _ = D.rearrange(delta, prev, 16, backend=backend)
        assert torch.equal(D.unrearrange(out, prev, 16, backend=backend), delta)
        ds, _ = D.grouped_cyclic_delta(prev, delta, 16, backend=backend)
        assert torch.equal(D.undo_grouped_cyclic_delta(prev, ds, 16, backend=backend), delta)


@pytest.mark.parametrize("device", DEVICES)
def test_rearrange_torch_reference_on_device(device):
    g = torch.Generator().manual_seed(2)
    prev = torch.randint(0, 20, (3000,), generator=g)
    delta = torch.randint(0, 20, (3000,), generator=g)
    out_cpu, _ = D.rearrange(delta, prev, 20, backend="torch")
    out, sizes = D.rearrange(delta.to(device), prev.to(device), 20)
    assert out.device.type == device
    assert torch.equal(out.cpu(), out_cpu)
    assert torch.equal(D.unrearrange(out, prev.to(device), 20).cpu(), delta)


def test_rearrange_empty():
    e = torch.zeros(0, dtype=torch.int64)
    for backend in BACKENDS:
        out, sizes = D.rearrange(e, e, 4, backend=backend)
        assert out.numel() == 0 and sizes.tolist() == [0, 0, 0, 0]
        assert D.unrearrange(out, e, 4, backend=backend).numel() == 0


# --------------------------------------------------------------------------- full pipeline


@pytest.mark.parametrize("rearrange,rle,coder", FLAGS)
def test_pipeline_round_trip_on_real_quantized_checkpoints(real_codes, rearrange, rle, coder):
    total = 0
    for name, seq in real_codes.items():
        key = encode_codes(None, seq[0], 16, rle=rle, coder=coder)
        assert torch.equal(decode_codes(key, None, 16), seq[0]), name
        for i in (1, 5, 9):                                     # early, middle, late pairs
            prev, cur = seq[i - 1], seq[i]
            buf = encode_codes(prev, cur, 16, rearrange=rearrange, rle=rle, coder=coder)
            got = decode_codes(buf, prev)  # a plain delta's codes come back narrow
            assert got.dtype == (torch.int64 if rearrange else torch.uint8) and torch.equal(got.long(), cur), name
            total += cur.numel()
    assert total == 3 * sum(seq[0].numel() for seq in real_codes.values())


def test_pipeline_level_count_change_uses_max(real_codes):
    seq = real_codes["fc2.weight"]
    prev = seq[4]                                               # 16 levels
    cur = uniform_codes(seq[5].float(), 32)                     # re-quantized to 32 levels
    for rearrange, rle in itertools.product([False, True], repeat=2):
        buf = encode_codes(prev, cur, 32, rearrange=rearrange, rle=rle)
        h = read_codes_header(buf)
        assert h == {"n": cur.numel(), "n_levels": 32, "delta": True, "rearrange": rearrange,
                     "rle": rle, "tuples": False, "coder": "huffman"}
        assert torch.equal(decode_codes(buf, prev, 32), cur)


def test_pipeline_compresses_real_deltas_near_entropy(real_codes):
    seq = real_codes["fc2.weight"]
    prev, cur = seq[8], seq[9]
    stream = D.cyclic_delta(prev, cur, 16)
    bound_bytes = entropy_bits(stream) / 8
    buf = encode_codes(prev, cur, 16, rearrange=False, rle=False, coder="huffman")
    # Huffman is within 1 bit/symbol of order-0 entropy; headers are a few dozen bytes
    assert bound_bytes <= len(buf) <= bound_bytes + cur.numel() / 8 + 64
    assert len(buf) < cur.numel() / 2                            # beats raw 4-bit packing


def test_rearrangement_helps_when_buckets_migrate_at_different_rates():
    # the situation of §6.3: bucket 0 churns, buckets 1..15 never move; interleaved they break
    # each other's zero runs, grouped they leave one long run per quiet bucket
    g = torch.Generator().manual_seed(3)
    n = 200_000
    prev = torch.randint(0, 16, (n,), generator=g)
    cur = prev.clone()
    churn = (prev == 0) & (torch.rand(n, generator=g) < 0.5)
    cur[churn] = torch.randint(1, 16, (int(churn.sum()),), generator=g)
    plain = len(encode_codes(prev, cur, 16, rearrange=False, rle=True))
    grouped = len(encode_codes(prev, cur, 16, rearrange=True, rle=True))
    assert grouped < 0.8 * plain
    assert torch.equal(decode_codes(encode_codes(prev, cur, 16), prev), cur)


@pytest.mark.parametrize("device", DEVICES)
def test_pipeline_result_follows_prev_device(device):
    g = torch.Generator().manual_seed(4)
    prev = torch.randint(0, 16, (4096,), generator=g).to(device)
    cur = torch.randint(0, 16, (4096,), generator=g).to(device)
    out = decode_codes(encode_codes(prev, cur, 16), prev)
    assert out.device.type == device and torch.equal(out.cpu(), cur.cpu())
    assert decode_codes(encode_codes(prev, cur, 16), prev, device="cpu").device.type == "cpu"


def test_pipeline_empty_and_constant():
    e = torch.zeros(0, dtype=torch.int64)
    assert decode_codes(encode_codes(None, e, 4)).numel() == 0
    assert decode_codes(encode_codes(e, e, 4), e).numel() == 0
    c = torch.full((100_000,), 3)
    buf = encode_codes(c, c, 16)
    assert len(buf) < 40                                        # one zero run: a header and a table
    assert torch.equal(decode_codes(buf, c), c)


def test_pipeline_caller_errors():
    prev = torch.randint(0, 16, (100,))
    cur = torch.randint(0, 16, (100,))
    buf = encode_codes(prev, cur, 16)
    with pytest.raises(ValueError, match="prev_codes"):
        decode_codes(buf)
    with pytest.raises(ValueError, match="n_levels"):
        decode_codes(buf, prev, 8)
    with pytest.raises(ValueError, match="prev_codes has"):
        decode_codes(buf, prev[:50])
    with pytest.raises(ValueError, match="coder"):
        encode_codes(prev, cur, 16, coder="lzma")
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        encode_codes(None, cur + 16, 16)


@pytest.mark.parametrize("coder", ["huffman", "ans", "rans", "zstd"])
def test_pipeline_corrupt_or_truncated_raises(real_codes, coder):
    prev, cur = real_codes["fc3.weight"][2], real_codes["fc3.weight"][3]
    buf = encode_codes(prev, cur, 16, coder=coder)
    for cut in range(len(buf)):                                 # every truncation
        with pytest.raises(CorruptCheckpointError):
            decode_codes(buf[:cut], prev)
    rng = random.Random(0)
    for bit in list(range(min(8 * len(buf), 200))) + rng.sample(range(8 * len(buf)), 200):
        bad = bytearray(buf)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptCheckpointError):
            decode_codes(bytes(bad), prev)
    with pytest.raises(CorruptCheckpointError):
        decode_codes(buf + b"\x00", prev)


def test_entropy_bits_matches_formula():
    x = torch.tensor([0, 0, 0, 1, 1, 7, -3, -3])
    counts = np.array([3, 2, 1, 2], dtype=np.float64)
    ref = float(-(counts * np.log2(counts / 8)).sum())
    assert entropy_bits(x) == pytest.approx(ref, rel=1e-12)
    assert entropy_bits(np.full(10, 5)) == 0.0
    assert entropy_bits(torch.zeros(0, dtype=torch.int64)) == 0.0
    sparse = torch.tensor([0, 1 << 40, 1 << 40, -(1 << 41)])   # span too wide for a count table
    assert entropy_bits(sparse) == pytest.approx(4 * 1.5, rel=1e-12)


GOLDEN_PREV = [0, 1, 2, 3, 3, 3, 2, 1, 0, 0, 0, 0]
GOLDEN_CUR = [0, 1, 2, 3, 3, 0, 2, 1, 0, 0, 1, 0]
GOLDEN = [  # (prev?, kwargs, exact bytes): pins the format of every layer; change = version bump
    (True, {}, "435101070c04efc5562b484601060405020203020202020261c050bc785c"),
    (False, {"coder": "ans"},
     "435101140c04c6d83635414e010c050500000001152b40552b0226df9a0d19ee0000a82eacde"),
    (True, {"rle": False, "rearrange": False, "coder": "rans"},
     "435101310c04cd5cb00b5241010c020002d5012b01026f0000003e359a75d0eef64d"),
    (True, {"rle": False, "rearrange": False, "coder": "zstd"},
     "435101210c04bdff96175a5301010c28b52ffd200c610000000000000003000000000300a1f82d39"),
]


@pytest.mark.parametrize("with_prev,kwargs,hexbytes", GOLDEN)
def test_golden_bytes(with_prev, kwargs, hexbytes):
    prev = torch.tensor(GOLDEN_PREV) if with_prev else None
    cur = torch.tensor(GOLDEN_CUR)
    assert encode_codes(prev, cur, 4, **kwargs).hex() == hexbytes
    assert torch.equal(decode_codes(bytes.fromhex(hexbytes), prev), cur)


def test_encode_codes_many_writes_encode_codes_bytes(real_codes, monkeypatch):
    # one kernel call for the order-0 rANS jobs (codec/rans.rans_encode_codes), the pipeline for the
    # rest: every job's bytes equal encode_codes's, in job order, whatever the mix of dtypes and flags
    g = torch.Generator().manual_seed(11)
    seq = real_codes["fc2.weight"]
    order0 = {"rearrange": False, "rle": False, "coder": "rans"}
    jobs = [(None, seq[0], 16, order0), (seq[0], seq[1], 16, order0), (seq[1], seq[2], 16, {"coder": "huffman"}),
            (seq[2].to(torch.uint8), seq[3].to(torch.uint8), 16, order0), (None, seq[4].to(torch.int16), 16, order0),
            (seq[3], seq[4], 16, {**order0, "rearrange": True}), (None, torch.zeros(0, dtype=torch.int64), 1, order0),
            (None, torch.full((50,), 3), 4, order0), (seq[4], seq[5], 16, {**order0, "rle": True}),
            (None, torch.randint(0, 3000, (4000,), generator=g).to(torch.int16), 3000, order0),
            (None, torch.tensor([0, 1 << 40]), 1 << 41, order0)]   # a sparse alphabet: rans_encode's path
    want = [encode_codes(p, c, b, **o) for p, c, b, o in jobs]
    assert encode_codes_many(jobs) == want
    import ckptzip.codec.entropy as E
    monkeypatch.setattr(E, "BATCH_CODES", 3000)  # batches of a few tensors, a large one alone
    assert encode_codes_many(jobs) == want
    for (p, c, b, o), buf in zip(jobs, want):
        assert torch.equal(decode_codes(buf, p), c.long())
    # a bad job raises what encode_codes raises (the kernel leaves it to the pipeline)
    for p, c, b in ((None, torch.tensor([0, 5]), 4), (torch.tensor([0, 9]), torch.tensor([1, 1]), 4),
                    (torch.tensor([0, 1, 2]), torch.tensor([1, 1]), 4)):
        with pytest.raises(ValueError, match="codes span|codes but prev has"):
            encode_codes_many([(None, seq[0], 16, order0), (p, c, b, order0)])


def test_entropy_bits_counts_by_numba_as_bincount(real_codes, monkeypatch):
    """Narrow codes on CPU are counted by a numba pass: the same counts as torch's bincount, so the
    same floats, for every integer dtype (negative values included)."""
    from ckptzip.codec import entropy as E

    g = torch.Generator().manual_seed(3)
    streams = [(c, d) for c in real_codes["fc2.weight"][:3] for d in (torch.uint8, torch.int16, torch.int64)]
    streams += [(torch.randint(-120, 100, (5000,), generator=g), d) for d in (torch.int8, torch.int16, torch.int32)]
    fast = [E.entropy_bits(c.to(d)) for c, d in streams]
    monkeypatch.setattr(E, "_count_kernel", None)
    assert fast == [E.entropy_bits(c.to(d)) for c, d in streams] and all(f > 0 for f in fast)


def test_conditional_bits_equals_its_torch_reference(real_codes):
    # the search's delta estimate: numba counts of narrow codes give the reference's floats exactly
    from ckptzip.codec import entropy as E

    seq = real_codes["fc2.weight"]
    g = torch.Generator().manual_seed(5)
    pairs = [(seq[3], seq[4], 16), (seq[0], seq[5], 16),
             (torch.randint(0, 300, (7000,), generator=g), torch.randint(0, 250, (7000,), generator=g), 300)]
    for prev, cur, B in pairs:
        want = entropy_bits(prev * B + torch.remainder(cur - prev, B)) - entropy_bits(prev)
        for dtype in (torch.uint8, torch.int16, torch.int64):
            if B > 256 and dtype == torch.uint8:
                continue
            assert E.conditional_bits(prev.to(dtype), cur.to(dtype), B) == want
    with pytest.raises(ValueError, match="outside"):
        E.conditional_bits(torch.tensor([0, 5]), torch.tensor([1, 1]), 4)


@pytest.mark.skipif(not D.HAVE_NUMBA, reason="the kernel needs numba")
def test_undo_in_range_is_undo_narrowed_and_refuses_what_is_out_of_range(real_codes):
    """A restore's plain delta: undo_cyclic_delta's codes as uint8 in one range-checking pass, or
    None (the caller checks and names the code) for a code outside [0, B), a negative one, or more
    than 256 levels; decode_codes then names a bad previous code as before."""
    seq = real_codes["fc1.weight"]
    prev, cur = seq[4], seq[5]
    delta = D.cyclic_delta(prev, cur, 16)
    for p, d in ((prev, delta), (prev.to(torch.uint8), delta.to(torch.uint8)), (prev.to(torch.int16), delta)):
        got = D.undo_in_range(p, d, 16)
        assert got.dtype == torch.uint8 and torch.equal(got.long(), cur)
    for bad, where in ((16, "delta"), (-1, "delta"), (16, "prev"), (-3, "prev")):
        p, d = prev.clone(), delta.clone()
        (d if where == "delta" else p)[7] = bad
        assert D.undo_in_range(p, d, 16) is None
    assert D.undo_in_range(prev, delta, 300) is None
    buf = encode_codes(prev, cur, 16)
    bad = prev.clone()
    bad[3] = 40
    with pytest.raises(ValueError, match=r"prev\w* codes span \[0, 40\]"):
        decode_codes(buf, bad)
