"""codec/tuples.py (stage tuple/1): codes of 2-32 levels packed a few to a symbol before the coder.
The numba kernels against the torch reference, the code buffer's flag and its checks, and a real
chain whose direction codes are packed restoring bit for bit what the unpacked chain restores."""
import struct
import zlib

import numpy as np
import pytest
from helpers import coded_stages
import torch

from ckptzip import CheckpointChain, KeyframePolicy
from ckptzip.codec import entropy, rans, tuples
from ckptzip.dcp.tools import flat_tensors
from ckptzip.errors import CorruptCheckpointError
from ckptzip.format import decode_container

numba_only = pytest.mark.skipif(tuples._numba is None, reason="numba not installed")


def test_codes_per_symbol():
    assert [tuples.size(B) for B in range(1, 8)] == [1, 5, 3, 2, 2, 2, 2]  # B**g <= 32, else pairs
    assert tuples.size(32) == 2 and tuples.size(33) == 1


@numba_only
@pytest.mark.parametrize("B", [2, 3, 4, 5, 17, 32])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int64])
def test_kernels_match_the_torch_reference(B, dtype):
    g = tuples.size(B)
    for n in (0, 1, g - 1, g, g + 1, 4099):
        codes = torch.randint(0, B, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int64).to(dtype)
        fast, ref = tuples.pack(codes, B, backend="numba"), tuples.pack(codes, B, backend="torch")
        assert fast.dtype == (np.uint8 if B ** g <= 256 else np.uint16)
        assert fast.dtype == ref.dtype and np.array_equal(fast, ref) and fast.size == -(-n // g)
        assert int(fast.max(initial=0)) < B ** g
        for backend in ("numba", "torch"):
            assert torch.equal(tuples.unpack(fast, n, B, backend=backend), codes.to(torch.uint8))
        prev = torch.randint(0, B, (n,), generator=torch.Generator().manual_seed(n + 1)).to(dtype)
        delta = torch.remainder(prev.long() - codes.long(), B)
        fast = tuples.pack(codes, B, prev=prev, backend="numba")
        assert np.array_equal(fast, tuples.pack(codes, B, prev=prev, backend="torch"))
        assert np.array_equal(fast, tuples.pack(delta, B))
        for backend in ("numba", "torch"):  # the delta undone in the unpacking pass
            assert torch.equal(tuples.unpack(fast, n, B, prev=prev, backend=backend), codes.to(torch.uint8))


@numba_only
def test_pack_many_is_pack_of_each_stream():
    g = torch.Generator().manual_seed(3)
    for Bs, dtype in (([3, 2, 3, 4, 5, 3], torch.uint8), ([17, 32, 20], torch.int16), ([6, 7, 8], torch.int64)):
        sizes = [0, 1, 5, 4099, 30, 2][:len(Bs)]
        codes = [torch.randint(0, B, (n,), generator=g).to(dtype).numpy() for B, n in zip(Bs, sizes)]
        prevs = [None if i % 2 else torch.randint(0, B, (n,), generator=g).to(torch.uint8).numpy()
                 for i, (B, n) in enumerate(zip(Bs, sizes))]
        got = tuples.pack_many(codes, Bs, prevs)
        want = [tuples.pack(c, B, prev=p) for c, B, p in zip(codes, Bs, prevs)]
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got, want))
    # a bad code (or a bad prev code) leaves its stream to the caller, the others packed
    codes = [np.ones(50, np.uint8), np.ones(50, np.uint8), np.ones(50, np.uint8)]
    codes[1][7] = 3
    prevs = [None, None, np.full(50, 9, np.uint8)]
    got = tuples.pack_many(codes, [3, 3, 3], prevs)
    assert got[1] is None and got[2] is None and np.array_equal(got[0], tuples.pack(codes[0], 3))
    with pytest.raises(ValueError, match="one symbol dtype"):
        tuples.pack_many([codes[0], codes[0]], [3, 32], [None, None])


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_pack_refuses_a_code_outside_the_alphabet(backend):
    for bad in (3, 200, -1):
        codes = torch.ones(100, dtype=torch.int16)
        codes[57] = bad
        with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
            tuples.pack(codes, 3, backend=backend)
        with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
            tuples.pack(torch.ones(100, dtype=torch.int16), 3, prev=codes, backend=backend)  # a bad parent code
    with pytest.raises(ValueError, match="not packed"):
        tuples.pack(torch.zeros(10, dtype=torch.uint8), 33, backend=backend)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_unpack_names_a_damaged_stream(backend):
    good = tuples.pack(torch.tensor([2, 1, 0, 1, 2], dtype=torch.uint8), 3)  # 2 symbols, one pad code
    with pytest.raises(CorruptCheckpointError, match="holds 3 symbols, 5 codes need 2"):
        tuples.unpack(np.append(good, 0), 5, 3, backend=backend)
    for symbol in (27, 255, -1):
        with pytest.raises(CorruptCheckpointError, match=r"outside \[0, 27\)"):
            tuples.unpack(np.array([5, symbol], dtype=np.int64), 5, 3, backend=backend)
    with pytest.raises(CorruptCheckpointError, match="pads its last symbol"):
        tuples.unpack(np.array([5, 3 + 9], dtype=np.int64), 5, 3, backend=backend)  # pad digit 1
    with pytest.raises(CorruptCheckpointError, match="never packed"):
        tuples.unpack(good, 5, 33, backend=backend)
    with pytest.raises(ValueError, match=r"prev codes must lie in \[0, 3\)"):
        tuples.unpack(good, 5, 3, prev=torch.tensor([0, 1, 2, 3, 0]), backend=backend)
    with pytest.raises(ValueError, match="a delta needs prev of 5 codes, got 4"):
        tuples.unpack(good, 5, 3, prev=torch.tensor([0, 1, 2, 0]), backend=backend)


def _direction_like(n: int, seed: int = 0) -> torch.Tensor:
    """3-level codes as Adam's pruned directions: 90 % the middle level."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    return torch.where(u < 0.05, 0, torch.where(u < 0.95, 1, 2)).to(torch.uint8)


@numba_only
def test_a_packed_buffer_decodes_and_the_batch_writes_the_same_bytes():
    codes = _direction_like(20_000)
    buf = entropy.encode_codes(None, codes, 3, rle=False, coder="rans", tuples=True)
    h = entropy.read_codes_header(buf)
    assert h["tuples"] and h["n"] == 20_000 and h["n_levels"] == 3
    assert rans.rans_decode(entropy._split_codes(buf)[1]).size == -(-20_000 // 3)  # a third of the symbols
    decoded = entropy.decode_codes(buf)
    assert decoded.dtype == torch.uint8 and torch.equal(decoded, codes)  # every code < B <= 32
    options = {"rle": False, "coder": "rans", "rearrange": False, "tuples": True}
    plain = {**options, "tuples": False}
    many = entropy.encode_codes_many([(None, codes, 3, options), (None, codes, 3, plain), (None, codes[:7], 3, options)])
    assert many[0] == buf and many[1] == entropy.encode_codes(None, codes, 3, rle=False, coder="rans")
    assert torch.equal(entropy.decode_codes(many[2]), codes[:7].long())
    # on independent codes order-0 over triples costs what it does over codes, plus the larger
    # table (27 values and frequencies): real direction codes pay it back (docs/BENCHMARKS.md)
    assert len(many[1]) < len(buf) <= len(many[1]) + 80
    (symbols,) = entropy.decode_symbols_many([buf], 1 << 20)  # a restore's batch decode
    assert torch.equal(entropy.decode_codes(buf, symbols=symbols), codes)


def test_a_delta_and_every_coder_pack_through_the_general_path():
    prev, cur = _direction_like(5000, 1), _direction_like(5000, 2)
    for coder in ("huffman", "rans", "zstd"):
        buf = entropy.encode_codes(prev, cur, 3, rearrange=False, rle=False, coder=coder, tuples=True)
        assert entropy.read_codes_header(buf)["tuples"]
        assert torch.equal(entropy.decode_codes(buf, prev), cur.long())
    options = {"rle": False, "coder": "rans", "rearrange": False, "tuples": True}
    wide_prev, wide_cur = (torch.randint(0, 18, (6000,), generator=torch.Generator().manual_seed(s)) for s in (3, 4))
    many = entropy.encode_codes_many([(prev, cur, 3, options), (wide_prev, wide_cur, 18, options),
                                      (None, wide_cur, 18, options)])
    assert many[0] == entropy.encode_codes(prev, cur, 3, rearrange=False, rle=False, coder="rans", tuples=True)
    assert many[1] == entropy.encode_codes(wide_prev, wide_cur, 18, rearrange=False, rle=False, coder="rans",
                                           tuples=True)
    assert entropy.read_codes_header(many[1])["delta"] and not entropy.read_codes_header(many[2])["delta"]
    assert torch.equal(entropy.decode_codes(many[1], wide_prev), wide_cur)
    assert torch.equal(entropy.decode_codes(many[2]), wide_cur)


def test_packing_is_refused_with_rle_or_a_large_alphabet():
    codes = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="without RLE"):
        entropy.encode_codes(None, codes, 3, rle=True, coder="rans", tuples=True)
    with pytest.raises(ValueError, match="n_levels=33"):
        entropy.encode_codes(None, codes, 33, rle=False, coder="rans", tuples=True)
    bad = codes.clone()
    bad[3] = 3  # outside [0, 3): the batch leaves it to encode_codes, which names it
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\)"):
        entropy.encode_codes_many([(None, bad, 3, {"rle": False, "coder": "rans", "rearrange": False, "tuples": True})])


def _reflagged(buf: bytes, flags: int, n_levels: int | None = None) -> bytes:
    """``buf`` with its header's flags (and B) replaced and the header's CRC made good again."""
    h = entropy.read_codes_header(buf)
    head = bytearray(b"CQ\x01")
    head.append(flags)
    for v in (h["n"], h["n_levels"] if n_levels is None else n_levels):
        while True:
            head.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
            v >>= 7
            if not v:
                break
    rest = entropy._split_codes(buf)[1]
    return bytes(head) + struct.pack("<I", zlib.crc32(head)) + bytes(rest)


def test_the_packed_flag_is_checked_before_decoding():
    buf = entropy.encode_codes(None, _direction_like(300), 3, rle=False, coder="rans", tuples=True)
    coder = 3 << 4
    assert entropy.decode_codes(_reflagged(buf, coder | 8)).numel() == 300  # the helper changes nothing else
    with pytest.raises(CorruptCheckpointError, match="invalid flags 0x3c"):
        entropy.decode_codes(_reflagged(buf, coder | 8 | 4))  # packed with RLE
    with pytest.raises(CorruptCheckpointError, match="invalid flags 0x38 or n_levels 33"):
        entropy.decode_codes(_reflagged(buf, coder | 8, n_levels=33))  # an alphabet never packed
    with pytest.raises(CorruptCheckpointError, match="holds 100 symbols"):
        entropy.decode_codes(_reflagged(buf, coder))  # the flag cleared: the stream is a third too short


def test_a_chain_with_packed_codes_restores_what_the_unpacked_chain_does(tmp_path, digits_snapshots, monkeypatch):
    model, opt, snaps, _ = digits_snapshots

    def run(root, small, paired, steps=None):
        monkeypatch.setattr(tuples, "SMALL_CODES", small)
        monkeypatch.setattr(tuples, "PAIRED_CODES", paired)
        monkeypatch.setattr(tuples, "STEP_PAIRED_CODES", paired if steps is None else steps)
        ch = CheckpointChain(root, "dynaquant", keyframe=KeyframePolicy(every=3))
        entries = [ch.save({"model": s.model, "optimizer": s.optimizer}, s.step, model=model, optimizer=opt)
                   for s in snaps[:4]]
        pipes = {tuple(coded_stages(r["pipeline"])) for e in entries
                 for r in decode_container(ch.storage.read(e.file)).manifest["records"].values()}
        restored = [torch.cat([t.reshape(-1).double() for _, t in flat_tensors(ch.load(e.step))]) for e in entries]
        return restored, pipes, sum(e.nbytes for e in entries)

    default, pipes, nbytes = run(tmp_path / "default", tuples.SMALL_CODES, tuples.PAIRED_CODES,
                                 tuples.STEP_PAIRED_CODES)
    assert ("moment-direction/1", "tuple/1", "rans/1") in pipes
    # exp_avg_sq's deltas pair from STEP_PAIRED_CODES codes (64 here: every one), the weights' from PAIRED_CODES
    steps, step_pipes, _ = run(tmp_path / "steps", tuples.SMALL_CODES, tuples.PAIRED_CODES, 64)
    assert ("moment-grid/1", "cyclic-delta/1", "tuple/1", "rans/1") in step_pipes
    assert ("moment-grid/1", "cyclic-delta/1", "rans/1") not in step_pipes
    assert ("dynaquant/1", "cyclic-delta/1", "tuple/1", "rans/1") not in step_pipes
    everything, all_pipes, _ = run(tmp_path / "all", 1, 1)  # every delta too: pairs of 6-32 levels
    assert {("dynaquant/1", "cyclic-delta/1", "tuple/1", "rans/1"),
            ("moment-grid/1", "cyclic-delta/1", "tuple/1", "rans/1")} <= all_pipes
    plain, plain_pipes, plain_nbytes = run(tmp_path / "plain", 1 << 40, 1 << 40)  # the writer packs nothing
    assert not any("tuple/1" in p for p in plain_pipes)
    assert nbytes <= plain_nbytes * 1.01
    for a, b, c, d in zip(default, everything, plain, steps):
        assert torch.equal(a, c) and torch.equal(b, c) and torch.equal(d, c)  # lossless: the same restores


# FORMAT.md M.3's example: 11 codes of 3 levels, packed (flags 0x38: rans, packed), as 4 symbols
# 13 = 1 + 3*1 + 9*1, 21, 22 and 4 (the last padded with a 0) in a rans/1 stream
GOLDEN = "435101380b03266444d552410104040808070040404040010280000000400e00000428956b"
GOLDEN_CODES = [1, 1, 1, 0, 1, 2, 1, 1, 2, 1, 1]


def test_the_documented_buffer_is_what_the_writer_writes_and_the_reader_reads():
    codes = torch.tensor(GOLDEN_CODES, dtype=torch.uint8)
    assert entropy.encode_codes(None, codes, 3, rle=False, coder="rans", tuples=True).hex() == GOLDEN
    assert entropy.decode_codes(bytes.fromhex(GOLDEN)).tolist() == GOLDEN_CODES
    assert rans.rans_decode(entropy._split_codes(bytes.fromhex(GOLDEN))[1]).tolist() == [13, 21, 22, 4]
