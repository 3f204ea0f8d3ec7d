"""ExCP tensor core (quant/excp.py) on a real digits run: masks, k-means, packing, round trips."""
import lzma
import math

import numpy as np
import pytest
import torch

from ckptzip.codec import bitpack
from ckptzip.codec.frames import xz_compress as lzma_compress
from ckptzip.codec.frames import xz_decompress
from ckptzip.errors import ConfigError, CorruptCheckpointError, NonFiniteError, UnsupportedStateError
from ckptzip.quant.excp import (
    EXCP_FAITHFUL,
    ExcpConfig,
    apply_residual,
    decode_tensor,
    dequantize,
    encode_tensor,
    kmeans_quantize,
    prune,
    prune_masks,
    quantize_nonzeros,
    residual,
)

EXCP_FIXED = ExcpConfig(codebook_dtype="float32")  # excp-fixed's codebooks
FP16_FLUSH = 2.0 ** -25  # fp16 rounds anything at or below this (~2.98e-8) to 0


def _state(snaps, t, name):
    """(dW_t float32, exp_avg_t, exp_avg_sq_t) of parameter `name` at snapshot t >= 1."""
    names = list(snaps[0].model.keys())  # optimizer state is indexed in parameter order
    st = snaps[t].optimizer["state"][names.index(name)]
    return residual(snaps[t].model[name], snaps[t - 1].model[name]), st["exp_avg"], st["exp_avg_sq"]


def _reference_masks(dw, m, v, alpha, beta):
    """Straightforward eq. 5/6: sort for the lower median, float64 threshold, strict >."""
    a = dw.double().abs().reshape(-1).sort().values
    median = a[(a.numel() - 1) // 2]                      # lower middle value
    mean_v = v.double().mean().item()
    f = 2.5 if mean_v == 0 else min(2.5, alpha / math.sqrt(mean_v))
    w = dw.double().abs() > median * f
    mm = (m.double().abs() > beta * m.double().abs().mean()) & w
    return w, mm


# ---------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------
def test_masks_match_reference_on_real_snapshots(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    n_checked = 0
    for t in (1, 4, 9):
        for name in snaps[0].model:
            dw, m, v = _state(snaps, t, name)
            w_mask, m_mask = prune_masks(dw, m, v, EXCP_FAITHFUL)
            w_ref, m_ref = _reference_masks(dw, m, v, 5e-5, 2.0)
            assert torch.equal(w_mask, w_ref), (t, name)
            assert torch.equal(m_mask, m_ref), (t, name)
            assert not bool((m_mask & ~w_mask).any())
            n_checked += w_mask.numel()
    assert n_checked > 3 * 25_000
    # on this run the momentum mask is the selective one: it keeps well under half of the kept residual
    dw, m, v = _state(snaps, 5, "fc2.weight")
    w_mask, m_mask = prune_masks(dw, m, v)
    assert 0.5 < w_mask.float().mean() <= 1.0
    assert 0.02 < m_mask.float().mean() < 0.5


def test_mask_semantics_by_hand():
    # |dW| sorted: 0 1 2 3 4 5 6 7 -> lower median 3 (the midpoint convention would give 3.5)
    dw = torch.tensor([0.0, -1.0, 2.0, 3.0, -4.0, 5.0, -6.0, 7.0])
    ones = torch.ones(8)
    m = torch.tensor([0.0, 9.0, 0.0, 0.0, 1.0, 1.0, 9.0, 1.0])   # mean |m| = 2.625 -> beta 2: |m| > 5.25
    # f = alpha / sqrt(1) = 1.25: threshold 3.75 keeps 4 (it would not with the 3.5 midpoint: 4.375)
    r = prune(dw, m, ones, ExcpConfig(alpha=1.25))
    assert r.f == 1.25 and r.threshold == 3.75 and r.m_threshold == 5.25
    assert r.w_mask.tolist() == [False, False, False, False, True, True, True, True]
    # m = 9 at index 1 passes its own threshold but the residual there is pruned
    assert r.m_mask.tolist() == [False, False, False, False, False, False, True, False]
    # f = 2: threshold 6 exactly; strict > drops the 6
    w, _ = prune_masks(dw, m, ones, ExcpConfig(alpha=2.0))
    assert w.tolist() == [False] * 7 + [True]
    # f capped at 2.5 -> threshold 7.5 keeps nothing
    assert not prune(dw, m, ones, ExcpConfig(alpha=100.0)).w_mask.any()
    # mean(v) == 0 -> f = 2.5 (documented choice, = min(2.5, inf))
    r0 = prune(dw, m, torch.zeros(8), ExcpConfig(alpha=1.25))
    assert r0.f == 2.5 and r0.threshold == 7.5


def test_prune_rejects_bad_input():
    x = torch.ones(4)
    with pytest.raises(NonFiniteError, match="dW"):
        prune(torch.tensor([1.0, float("nan"), 0.0, 0.0]), x, x)
    with pytest.raises(NonFiniteError, match="exp_avg_sq"):
        prune(x, x, torch.tensor([1.0, float("inf"), 0.0, 0.0]))
    with pytest.raises(ValueError, match="share one shape"):
        prune(x, torch.ones(5), x)
    with pytest.raises(UnsupportedStateError, match="negative mean"):
        prune(x, x, -x)
    for bad in (dict(bits=3), dict(codebook_dtype="bfloat16"), dict(alpha=0.0), dict(beta=-1.0),
                dict(seed=-1), dict(kmeans_max_iter=0)):
        with pytest.raises(ConfigError):
            ExcpConfig(**bad)


# ---------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------
def test_v01_codes_were_packed_high_nibble_first():
    # ckptzip 0.1 wrote ExCP codes FIRST element in the HIGH bits; the reader of those files remains
    unpack = bitpack.unpack_msb_first
    assert unpack(bytes([0x12, 0x3F, 0xA0]), 5, 4).tolist() == [1, 2, 3, 15, 10]  # odd tail: low nibble 0
    assert unpack(b"\x07", 2, 4).tolist() == [0, 7] and unpack(b"", 0, 4).tolist() == []
    assert unpack(bytes([0b01101100, 0b11000000]), 5, 2).tolist() == [1, 2, 3, 0, 3]
    assert unpack(bytes([0b10110001, 0b10000000]), 9, 1).tolist() == [1, 0, 1, 1, 0, 0, 0, 1, 1]
    with pytest.raises(CorruptCheckpointError):
        unpack(b"\x12\x34", 5, 4)


def test_codes_are_packed_by_the_one_packer(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    blobs, meta = encode_tensor(*_state(snaps, 3, "fc1.weight"))
    assert meta["format"] == "excp-tensor/2" and meta["parts"]["dw"]["mode"] == "kmeans"
    codes = bitpack.unpack(blobs["dw.codes"], 128 * 64, 4)
    assert blobs["dw.codes"] == bitpack.pack(codes, 4).numpy().tobytes()
    assert codes[0] == blobs["dw.codes"][0] & 0x0F  # LSB first: element 0 in the low nibble
    # a 0.1 record (MSB first) of the same codes decodes to the same tensors
    n = 128 * 64
    msb = {k: ((c[0::2] << 4) | c[1::2]).numpy().tobytes() for k, b in blobs.items() if k.endswith(".codes")
           for c in [bitpack.unpack(b, n, 4)]}
    old = decode_tensor({**blobs, **msb}, {**meta, "format": "excp-tensor/1"})
    assert all(torch.equal(a, b) for a, b in zip(old, decode_tensor(blobs, meta)))


# ---------------------------------------------------------------------------------------------
# k-means
# ---------------------------------------------------------------------------------------------
def test_kmeans_is_a_lloyd_fixed_point_with_nearest_assignment(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    dw, _, _ = _state(snaps, 3, "fc2.weight")
    x = dw[dw != 0]
    codes, centers = kmeans_quantize(x, bits=4, seed=0, max_iter=200)
    assert codes.dtype == torch.uint8 and centers.dtype == torch.float32 and centers.shape == (15,)
    assert int(codes.min()) >= 1 and int(codes.max()) <= 15
    assert bool((centers[1:] >= centers[:-1]).all())
    # every value sits on its nearest center (brute force)
    dist = (x.double()[:, None] - centers.double()[None, :]).abs()
    chosen = dist.gather(1, (codes.long() - 1)[:, None]).squeeze(1)
    assert torch.allclose(chosen, dist.min(1).values, rtol=0, atol=1e-9)
    # and every used center is the mean of its cluster (converged Lloyd)
    for c in range(1, 16):
        sel = x[codes == c].double()
        if sel.numel():
            assert abs(sel.mean().item() - centers[c - 1].item()) <= 1e-6 * abs(sel.mean().item()) + 1e-12
    # one center = the mean
    _, c1 = kmeans_quantize(x, bits=1)
    assert c1.item() == pytest.approx(x.double().mean().item(), rel=1e-6)


def test_kmeans_error_falls_with_bits_and_matches_sklearn(digits_snapshots):
    sklearn_cluster = pytest.importorskip("sklearn.cluster")
    _, _, snaps, _ = digits_snapshots
    dw, _, _ = _state(snaps, 6, "fc2.weight")
    x = dw[dw != 0]
    mse = []
    for bits in (1, 2, 3, 4, 5, 6):
        codes, centers = kmeans_quantize(x, bits=bits, seed=0)
        mse.append(((centers[codes.long() - 1] - x).double() ** 2).mean().item())
    assert all(b < 0.8 * a for a, b in zip(mse, mse[1:])), mse
    km = sklearn_cluster.KMeans(n_clusters=15, n_init=3, random_state=0).fit(x.double().numpy()[:, None])
    assert mse[3] <= 1.05 * km.inertia_ / x.numel()


def test_kmeans_determinism_and_degenerate_input(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    dw, m, v = _state(snaps, 2, "fc1.weight")
    for cfg in (EXCP_FAITHFUL, EXCP_FIXED):
        b1, meta1 = encode_tensor(dw, m, v, cfg)
        b2, meta2 = encode_tensor(dw.clone(), m.clone(), v.clone(), cfg)
        assert b1 == b2 and meta1 == meta2
    # fewer distinct values than centers: exact, duplicates stay empty
    codes, centers = kmeans_quantize(torch.tensor([0.5, -0.25, 0.5, 0.5, 2.0]), bits=4, seed=3)
    assert centers[codes.long() - 1].tolist() == [0.5, -0.25, 0.5, 0.5, 2.0]
    with pytest.raises(ValueError):
        kmeans_quantize(torch.zeros(0))


def test_quantize_nonzeros_keeps_zeros_exact(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    dw, m, v = _state(snaps, 4, "fc1.weight")
    w_mask, _ = prune_masks(dw, m, v)
    x = torch.where(w_mask, dw, 0.0)
    q = quantize_nonzeros(x, bits=4, codebook_dtype="float32")
    assert q.n_levels == 16 and q.codebook[0].item() == 0.0 and q.shape == (128, 64)
    assert torch.equal(q.codes.reshape(x.shape) == 0, x == 0)
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype
    rel = ((y - x).norm() / x.norm()).item()
    assert rel < 0.13, rel  # 15 MSE-optimal levels on a heavy-tailed residual: ~0.11


# ---------------------------------------------------------------------------------------------
# one tensor: encode / decode
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [EXCP_FAITHFUL, EXCP_FIXED], ids=["faithful", "fixed"])
def test_round_trip_real_tensors(digits_snapshots, cfg):
    _, _, snaps, _ = digits_snapshots
    for name in snaps[0].model:
        dw, m, v = _state(snaps, 7, name)
        blobs, meta = encode_tensor(dw, m, v, cfg)
        assert meta["format"] == "excp-tensor/2" and meta["codebook_dtype"] == cfg.codebook_dtype
        dw_hat, m_hat, v_hat = decode_tensor(blobs, meta)
        w_mask, m_mask = prune_masks(dw, m, v, cfg)
        for got, ref in ((dw_hat, dw), (m_hat, m), (v_hat, v)):
            assert got.shape == dw.shape and got.dtype == torch.float32
        assert not dw_hat[~w_mask].any() and not m_hat[~m_mask].any() and not v_hat[~m_mask].any()
        for part, got, ref, mask in (("dw", dw_hat, dw, w_mask), ("m", m_hat, m, m_mask), ("v", v_hat, v, m_mask)):
            info = meta["parts"][part]
            assert info["nnz"] == int(mask.sum())
            if info["mode"] == "dense":
                assert info["nnz"] <= 15 and torch.equal(got, torch.where(mask, ref, 0.0))
                continue
            n = dw.numel()
            assert len(blobs[f"{part}.codes"]) == (n + 1) // 2
            assert len(blobs[f"{part}.codebook"]) == 15 * (2 if cfg.codebook_dtype == "float16" else 4)
            centers = torch.from_numpy(np.frombuffer(blobs[f"{part}.codebook"], dtype=cfg.codebook_dtype).copy())
            # each kept value decodes to a stored center, the nearest one up to codebook rounding
            dist = (ref[mask].double()[:, None] - centers.double()[None, :]).abs()
            err = (got[mask].double() - ref[mask].double()).abs()
            slack = 1e-7 if cfg.codebook_dtype == "float32" else 2.0 ** -24 + 1e-3 * ref.abs().max().item()
            assert bool((err <= dist.min(1).values + slack).all()), (name, part)
            assert ((got[mask] - ref[mask]).norm() / ref[mask].norm()).item() < 0.15, (name, part)


def test_round_trip_odd_sizes_and_bf16(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    w_prev = snaps[5].model["fc2.weight"][:127, :33].bfloat16()      # 4,191 elements: odd
    w_t = snaps[6].model["fc2.weight"][:127, :33].bfloat16()
    st = snaps[6].optimizer["state"][4]
    m, v = st["exp_avg"][:127, :33].bfloat16(), st["exp_avg_sq"][:127, :33].bfloat16()
    dw = residual(w_t, w_prev)
    assert dw.dtype == torch.float32 and torch.equal(dw, w_t.float() - w_prev.float())
    blobs, meta = encode_tensor(dw, m, v, EXCP_FIXED)
    assert len(blobs["dw.codes"]) == 2096
    dw_hat, m_hat, v_hat = decode_tensor(blobs, meta)
    assert dw_hat.dtype == torch.float32 and m_hat.dtype == torch.bfloat16 and v_hat.dtype == torch.bfloat16
    assert dw_hat.shape == m_hat.shape == v_hat.shape == (127, 33)
    w_hat = apply_residual(w_prev, dw_hat)
    assert w_hat.dtype == torch.bfloat16 and w_hat.shape == (127, 33)
    # the reconstruction is closer to W_t than the previous weights were
    assert (w_hat.float() - w_t.float()).norm() < 0.3 * (w_prev.float() - w_t.float()).norm()
    # 1-D odd size and a scalar-like 1-element tensor
    for n in (1, 17, 4191):
        x = dw.reshape(-1)[:n]
        b, mt = encode_tensor(x, m.reshape(-1)[:n], v.reshape(-1)[:n], EXCP_FAITHFUL)
        out = decode_tensor(b, mt)
        assert all(t.shape == (n,) for t in out)


def test_dense_fallback_at_most_15_nonzeros(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    dw, m, v = _state(snaps, 8, "fc2.weight")
    keep_all = ExcpConfig(alpha=1e-30, beta=0.0)  # f ~ 0: every non-zero residual and momentum kept
    for n, mode in ((15, "dense"), (16, "kmeans")):
        x, mx, vx = dw.reshape(-1)[:n], m.reshape(-1)[:n], v.reshape(-1)[:n]
        assert bool((x != 0).all())
        blobs, meta = encode_tensor(x, mx, vx, keep_all)
        assert {p["mode"] for p in meta["parts"].values()} == {mode}
        dw_hat, m_hat, v_hat = decode_tensor(blobs, meta)
        if mode == "dense":
            assert set(blobs) == {"dw.dense", "m.dense", "v.dense"} and len(blobs["dw.dense"]) == 60
            assert torch.equal(dw_hat, x) and torch.equal(m_hat, mx) and torch.equal(v_hat, vx)
        else:
            assert set(blobs) == {f"{p}.{s}" for p in ("dw", "m", "v") for s in ("codes", "codebook")}
            assert len(torch.unique(dw_hat)) <= 15
    # the real 10-element fc3.bias is stored dense, exactly
    dw, m, v = _state(snaps, 8, "fc3.bias")
    blobs, meta = encode_tensor(dw, m, v)
    assert meta["parts"]["dw"]["mode"] == "dense"
    w_mask, _ = prune_masks(dw, m, v)
    assert torch.equal(decode_tensor(blobs, meta)[0], torch.where(w_mask, dw, 0.0))


def test_decode_rejects_damaged_records(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    blobs, meta = encode_tensor(*_state(snaps, 3, "fc1.weight"))
    with pytest.raises(CorruptCheckpointError):
        decode_tensor({k: b for k, b in blobs.items() if k != "m.codes"}, meta)
    with pytest.raises(CorruptCheckpointError):
        decode_tensor({**blobs, "dw.codes": blobs["dw.codes"][:-1]}, meta)
    with pytest.raises(CorruptCheckpointError):
        decode_tensor(blobs, {**meta, "format": "excp-tensor/9"})
    with pytest.raises(CorruptCheckpointError):
        decode_tensor(blobs, {k: x for k, x in meta.items() if k != "shape"})
    with pytest.raises(CorruptCheckpointError):
        decode_tensor(blobs, {**meta, "parts": {**meta["parts"], "v": {"mode": "zstd", "nnz": 1}}})


# ---------------------------------------------------------------------------------------------
# the fp16 codebook defect
# ---------------------------------------------------------------------------------------------
def test_fp16_codebook_flushes_small_second_moment_centers(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    names = list(snaps[0].model.keys())
    # exp_avg_sq after 20 steps (the first snapshot) is still small: its lowest 4-bit center is < 3e-8
    v = snaps[0].optimizer["state"][names.index("fc2.weight")]["exp_avg_sq"]
    q16 = quantize_nonzeros(v, bits=4, codebook_dtype="float16")
    q32 = quantize_nonzeros(v, bits=4, codebook_dtype="float32")
    assert torch.equal(q16.codes, q32.codes)  # same clustering; only the stored codebook differs
    tiny = (q32.codebook[1:] > 0) & (q32.codebook[1:] < FP16_FLUSH)
    assert int(tiny.sum()) >= 1
    assert bool((q16.codebook[1:][tiny] == 0).all())          # faithful: flushed to exactly 0
    v16, v32 = dequantize(q16).reshape(-1), dequantize(q32).reshape(-1)
    hit = (v.reshape(-1) > 0) & tiny.nonzero().squeeze(1).add(1).eq(q32.codes[:, None]).any(1)
    assert int(hit.sum()) > 100
    assert bool((v16[hit] == 0).all()) and bool((v32[hit] > 0).all())
    # the same through encode/decode at a real (dW_t, m_t, v_t) triple: 8 bits and beta = 0 give
    # second-moment centers below 3e-8 at every later snapshot too
    dw, m, v = _state(snaps, 5, "fc2.weight")
    lost = {}
    for dtype in ("float16", "float32"):
        cfg = ExcpConfig(bits=8, beta=0.0, codebook_dtype=dtype)
        _, m_hat, v_hat = decode_tensor(*encode_tensor(dw, m, v, cfg))
        lost[dtype] = int(((m_hat != 0) & (v_hat == 0) & (v > 0)).sum())
    assert lost["float16"] > 10 and lost["float32"] == 0, lost


# ---------------------------------------------------------------------------------------------
# LZMA stage
# ---------------------------------------------------------------------------------------------
def lzma_decompress(blob, max_bytes=None):
    return xz_decompress(blob, max_bytes=max_bytes)


def test_lzma_round_trip_and_damage(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    blobs, _ = encode_tensor(*_state(snaps, 9, "fc2.weight"))
    payload = b"".join(blobs[k] for k in sorted(blobs))
    z = lzma_compress(payload)
    assert z[:6] == b"\xfd7zXZ\x00" and len(z) < len(payload)
    assert lzma_decompress(z) == payload
    assert lzma_decompress(lzma_compress(b"")) == b""
    # the dictionary shrink must not cost ratio against plain preset 9 | EXTREME
    assert len(z) <= len(lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME))
    with pytest.raises(CorruptCheckpointError):
        lzma_decompress(z[:-7])
    with pytest.raises(CorruptCheckpointError):
        lzma_decompress(z[:20] + bytes([z[20] ^ 0xFF]) + z[21:])
    with pytest.raises(CorruptCheckpointError, match="max_bytes"):
        lzma_decompress(z, max_bytes=len(payload) - 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    dw, m, v = _state(snaps, 4, "fc2.weight")
    b_cpu, meta_cpu = encode_tensor(dw, m, v, EXCP_FIXED)
    b_gpu, meta_gpu = encode_tensor(dw.cuda(), m.cuda(), v.cuda(), EXCP_FIXED)
    assert meta_cpu["prune"]["w_kept"] == meta_gpu["prune"]["w_kept"]
    same = sum(b_cpu[k] == b_gpu[k] for k in b_cpu)
    assert same >= len(b_cpu) - 2  # float64 sums may differ in the last bit on another device
    out = decode_tensor(b_gpu, meta_gpu, device="cuda")
    assert all(t.is_cuda for t in out)


def test_malformed_meta_is_corrupt():
    from ckptzip.quant.excp import FORMAT, read_meta

    with pytest.raises(CorruptCheckpointError, match=r"ExCP record meta is malformed \(KeyError\('shape'\)\)"):
        read_meta({"format": FORMAT})
    with pytest.raises(CorruptCheckpointError, match="has format 'x/9'"):  # our own error passes unchanged
        read_meta({"format": "x/9"})
    with pytest.raises(CorruptCheckpointError, match="unknown dtype name 'f8'"):
        read_meta({"format": FORMAT, "shape": [2], "bits": 4, "codebook_dtype": "float32", "parts": {},
                   "dtypes": {"m": "f8", "v": "float32"}})
