"""Bitmask sparsification (codec/bitmask.py): exact round trips on real deltas, kind choice, errors."""
import math
import pathlib
import sys

import numpy as np
import pytest
import torch

from ckptzip.codec import bitmask as bm
from ckptzip.errors import ConfigError, CorruptCheckpointError

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def _ref_changed(cur: torch.Tensor, base: torch.Tensor) -> int:
    # independent reference: numpy on the raw bytes, one element = `width` bytes
    w = cur.element_size()
    a = cur.contiguous().view(INT_VIEW[cur.dtype]).numpy().view(np.uint8).reshape(-1, w)
    b = base.contiguous().view(INT_VIEW[base.dtype]).numpy().view(np.uint8).reshape(-1, w)
    return int((a != b).any(axis=1).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_deltas_round_trip_exactly(digits_snapshots, dtype):
    _, _, snaps, _ = digits_snapshots
    kinds, changed, total = set(), 0, 0
    for prev, nxt in [(snaps[0], snaps[1]), (snaps[7], snaps[8])]:
        for name, base in prev.model.items():
            base = base.to(dtype)
            cur = nxt.model[name].to(dtype)
            kind, payload, meta = bm.encode_delta(cur, base)
            k = _ref_changed(cur, base)
            assert meta["n_changed"] == k
            n, w = cur.numel(), cur.element_size()
            sizes = {"same": 0, "bitmask": math.ceil(n / 8) + k * w, "dense": n * w}
            assert kind == ("same" if k == 0 else "bitmask" if sizes["bitmask"] < sizes["dense"] else "dense")
            assert len(payload) == sizes[kind]
            assert _same_bits(bm.decode_delta(kind, payload, base, meta), cur)
            kinds.add(kind)
            changed, total = changed + k, total + n
    if dtype == torch.float32:
        # fp32 Adam moves nearly every element (all but the weights of always-zero pixels)
        assert changed / total > 0.95 and "dense" in kinds
    else:
        assert "bitmask" in kinds  # bf16 copies change much less: the bitmask is chosen somewhere


def test_bf16_copies_change_less_at_small_lr():
    # a fresh real run, 1-step interval at a late-training-like lr: fp32 Adam still moves nearly
    # every weight, but most moves are below bf16's resolution, so the bitmask pays off there
    from ckptzip.demo.workloads import digits_run

    _, _, snaps, _ = digits_run(n_checkpoints=2, steps_between=1, lr=1e-4)
    n = k32 = k16 = bytes16 = 0
    for name, w0 in snaps[0].model.items():
        w1 = snaps[1].model[name]
        n += w0.numel()
        k32 += _ref_changed(w1, w0)
        k16 += _ref_changed(w1.bfloat16(), w0.bfloat16())
        kind, payload, _ = bm.encode_delta(w1.bfloat16(), w0.bfloat16())
        bytes16 += len(payload)
    assert k32 / n > 0.8 and k16 / n < 0.5
    assert bytes16 == pytest.approx(n / 8 + 2 * k16, rel=0.02) and bytes16 < 0.6 * 2 * n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_changed_and_none_changed(dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(37, 3, generator=g).to(dtype)
    cur = base + 1  # every element differs
    kind, payload, meta = bm.encode_delta(cur, base)
    assert kind == "dense" and meta["n_changed"] == base.numel()
    assert _same_bits(bm.decode_delta(kind, payload, base, meta), cur)

    kind, payload, meta = bm.encode_delta(base.clone(), base)
    assert (kind, payload, meta["n_changed"]) == ("same", b"", 0)
    out = bm.decode_delta(kind, payload, base, meta)
    assert _same_bits(out, base) and out.data_ptr() != base.data_ptr()


@pytest.mark.parametrize("n", [1, 7, 8, 9, 13, 1003])
def test_odd_sizes_round_trip_and_pack_matches_numpy(n):
    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) < 0.2
    mask[0] = True
    cur = torch.where(mask, base * 3 + 1, base)
    ref = np.packbits(mask.numpy(), bitorder="little")
    assert np.array_equal(bm.pack_bits(mask).numpy(), ref)
    assert torch.equal(bm.unpack_bits(bm.pack_bits(mask), n), mask)
    kind, payload, meta = bm.encode_delta(cur, base)
    assert kind == ("bitmask" if math.ceil(n / 8) + 4 * int(mask.sum()) < 4 * n else "dense")
    if kind == "bitmask":
        assert payload[: math.ceil(n / 8)] == ref.tobytes()
    assert _same_bits(bm.decode_delta(kind, payload, base, meta), cur)


@pytest.mark.parametrize("dtype,k_bitmask", [(torch.float16, 59), (torch.bfloat16, 59), (torch.float32, 61)])
def test_kind_follows_byte_counts_at_break_even(dtype, k_bitmask):
    # n = 64: bitmask = 8 + k*w bytes vs dense 64*w; a tie goes to dense (no mask to unpack)
    base = torch.zeros(64, dtype=dtype)
    for k, want in [(k_bitmask, "bitmask"), (k_bitmask + 1, "dense")]:
        cur = base.clone()
        cur[:k] = 1
        kind, payload, meta = bm.encode_delta(cur, base)
        assert kind == want, (dtype, k)
        assert _same_bits(bm.decode_delta(kind, payload, base, meta), cur)
    assert bm.break_even_fraction(dtype) == (k_bitmask + 1) / 64  # 93.75 % for 2-byte, 96.875 % for fp32


def test_signed_zero_and_nan_payloads_are_exact():
    base = torch.tensor([0.0, float("nan"), 1.0, -2.0])
    cur = base.clone()
    cur[0] = -0.0
    cur.view(torch.int32)[1] = 0x7FC00001  # another quiet-NaN payload
    assert bm.changed_mask(cur, base).tolist() == [True, True, False, False]
    kind, payload, meta = bm.encode_delta(cur, base)
    assert meta["n_changed"] == 2
    assert _same_bits(bm.decode_delta(kind, payload, base, meta), cur)


def _paper_baselines():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))  # COO lives with the bench
    import paper_baselines

    return paper_baselines


def test_coo_round_trip_and_size(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    base = snaps[3].model["fc1.weight"].bfloat16()
    cur = snaps[4].model["fc1.weight"].bfloat16()
    pb = _paper_baselines()
    payload, meta = pb.coo_encode(cur, base)
    k = _ref_changed(cur, base)
    assert len(payload) == k * (4 + 2) == bm.encoded_sizes(cur.numel(), k, 2)["coo"]
    assert _same_bits(pb.coo_decode(payload, base, meta), cur)
    with pytest.raises(CorruptCheckpointError):
        pb.coo_decode(payload[:-1], base, meta)


def test_validation_errors():
    base = torch.zeros(10)
    with pytest.raises(ConfigError, match="shape"):
        bm.encode_delta(torch.zeros(11), base)
    with pytest.raises(ConfigError, match="dtype"):
        bm.encode_delta(torch.zeros(10, dtype=torch.bfloat16), base)
    cur = base.clone()
    cur[3] = 1
    kind, payload, meta = bm.encode_delta(cur, base)
    assert kind == "bitmask"
    with pytest.raises(ConfigError, match="base"):
        bm.decode_delta(kind, payload, torch.zeros(10, dtype=torch.float16), meta)
    for bad in (payload[:-1], payload + b"\0", payload[:1]):
        with pytest.raises(CorruptCheckpointError):
            bm.decode_delta(kind, bad, base, meta)
    bad = bytearray(payload)
    bad[1] |= 0x80  # a padding bit of the last mask byte (n = 10)
    with pytest.raises(CorruptCheckpointError, match="padding"):
        bm.decode_delta(kind, bytes(bad), base, meta)
    with pytest.raises(CorruptCheckpointError):
        bm.decode_delta("zstd", payload, base, meta)
    with pytest.raises(CorruptCheckpointError):
        bm.decode_delta("dense", b"\0" * 39, base, meta)
    with pytest.raises(CorruptCheckpointError):
        bm.decode_delta("same", b"\0", base, meta)
