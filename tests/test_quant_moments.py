"""quant/moments.py: v on a fixed log grid of Adam's denominator, m as a few-bit direction."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from ckptzip.errors import ConfigError, NonFiniteError
from ckptzip.quant import moments as M


@pytest.fixture(scope="module")
def adam_pair(digits_snapshots):
    """(m, v, hp) of the digits MLP's 256x64 first layer at its last checkpoint (real Adam state)."""
    _, _, snaps, _ = digits_snapshots
    st = snaps[-1].optimizer["state"][0]
    return st["exp_avg"], st["exp_avg_sq"], M.AdamHP(float(st["step"]))


@pytest.mark.parametrize("step", [0.5, 1.0])
@pytest.mark.parametrize("factored", [False, True])
def test_grid_bounds_the_denominator(adam_pair, step, factored):
    m, v, hp = adam_pair
    q = M.quantize_v(v, hp, step=step, factored=factored, m=m)
    assert q.meta["factored"] is factored and q.codebook.numel() == 0
    D, D_q = M.denominator(v, hp), M.decode_denominator(q, hp)
    ratio = torch.log2(D_q / D).abs()
    assert float(ratio.max()) <= step / 2 + 1e-4  # within half a level, in log2 units
    # factored codes are the same absolute levels, coded as residuals
    assert torch.equal(M.decode_grid(q), M.grid_codes(v, hp, step, m))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_float64_decode_equals_one_pass(adam_pair, monkeypatch, dtype):
    """D and v are computed chunk by chunk through one float64 buffer on the CPU: bit for bit what
    the one-pass float64 maps give, over chunk edges (a chunk of 7 elements) and narrow codes."""
    m, v, hp = adam_pair
    q = M.quantize_v(v, hp, step=0.5, m=m)
    c = M.decode_grid(q)
    step = float(q.meta["step"])
    want_D = c.to(torch.float64).mul(step).exp2().mul(hp.eps).to(torch.float32)
    want_v = want_D.to(torch.float64).sub(hp.eps).clamp_min(0).square().mul(hp.bc2).to(dtype).reshape(v.shape)
    monkeypatch.setattr(M, "_CHUNK", 7)
    for codes in (c, c.to(torch.uint8) if int(c.max()) < 256 else c.to(torch.int16)):
        D = M.decode_denominator(q, hp, codes)
        assert D.dtype == torch.float32 and torch.equal(D, want_D)
        got = M.v_from_denominator(D, hp, v.shape, dtype)
        assert got.dtype == dtype and got.shape == v.shape and torch.equal(got, want_v)
    assert M.decode_denominator(q, hp, c[:0]).numel() == 0


@pytest.mark.parametrize("step", [2.0, 0.5, 0.3, 3.0])
def test_grid_codes_are_log2_rounded_half_up_exactly(step):
    """c = #{k: y >= B[k]} is round(log2(y) / step) half up, computed exactly (no log2 call): checked
    against float64 log2 on 10^6 values over 2**0 .. 2**60, and the bounds and their fp32
    neighbours fall on the right sides."""
    lo, thr, table, width = M.grid_bounds(step)
    bounds = torch.from_numpy(table[1:len(table) - width])
    g = torch.Generator().manual_seed(0)
    y = torch.exp2(torch.rand(10 ** 6, generator=g, dtype=torch.float64) * 60).float()
    got = torch.bucketize(y, bounds, right=True)
    assert torch.equal(got, torch.floor(torch.log2(y.double()) / step + 0.5).long())
    near = bounds[bounds < 2.0 ** 60]
    k = torch.arange(1, near.numel() + 1)
    assert torch.equal(torch.bucketize(near, bounds, right=True), k)
    assert torch.equal(torch.bucketize(torch.nextafter(near, torch.zeros(())), bounds, right=True), k - 1)
    assert bool((near.double() >= torch.exp2(step * (k.double() - 0.5))).all())  # the least fp32 above
    assert bool((torch.nextafter(near, torch.zeros(())).double() < torch.exp2(step * (k.double() - 0.5))).all())
    assert width == math.ceil(1 / step)  # the most bounds in one binade
    with pytest.raises(ConfigError, match="step must be >= 2"):
        M.grid_bounds(1e-4)


def test_grid_is_stable_and_never_zero_where_m_is_not(adam_pair):
    m, v, hp = adam_pair
    v = v.clone()
    v.reshape(-1)[:10] = 0  # v == 0: zero level only where m is zero too
    m = m.clone()
    m.reshape(-1)[:5] = 0
    c = M.grid_codes(v, hp, 1.0, m)
    both = (v.reshape(-1) == 0) & (m.reshape(-1) == 0)
    assert torch.equal(c == 0, both) and bool((c[5:10] >= 1).all())
    v_q = M.v_from_denominator(M.decode_denominator(M.quantize_v(v, hp, step=1.0, m=m), hp), hp, v.shape)
    assert bool((v_q.reshape(-1)[5:10] > 0).all()) and bool((v_q.reshape(-1)[:5] == 0).all())
    # the grid is absolute: a 1 % drift of v keeps almost every code (what makes deltas cheap)
    c2 = M.grid_codes(v * 1.01, hp, 1.0, m)
    assert float((c2 == c).float().mean()) > 0.95


@pytest.mark.parametrize("bits,prune", [(1, 0.0), (2, 0.0), (3, 0.0), (1, 0.5)])
def test_direction_codes(adam_pair, bits, prune):
    m, v, hp = adam_pair
    D = M.denominator(v, hp)
    q = M.quantize_m(m, D, bits=bits, group=100, prune=prune)  # 100 does not divide 16384: a short group
    assert q.n_levels == 2 ** bits + (prune > 0) and q.side["scale"].dtype == torch.bfloat16
    m_q = M.dequantize_m(q, D)
    assert m_q.shape == m.shape and m_q.dtype == m.dtype
    u, u_q = m.reshape(-1) / D, m_q.reshape(-1) / D
    kept = (u_q != 0) & (u != 0)
    assert bool((torch.sign(u_q[kept]) == torch.sign(u[kept])).all())
    if prune:
        assert abs(float((~kept).float().mean()) - prune) < 0.02
    err = float((u_q - u).norm() / u.norm())
    assert err < {1: 0.75, 2: 0.45, 3: 0.3}[bits]


def test_pair_roundtrip_in_bf16_and_errors(adam_pair):
    m, v, hp = adam_pair
    qm, qv = M.encode_pair(m.bfloat16(), v.bfloat16(), hp, M.GridCodec(v_step=0.5, m_bits=3, prune=0.0))
    m_q, v_q = M.decode_pair(qm, qv, hp)
    assert m_q.dtype == v_q.dtype == torch.bfloat16
    assert torch.equal(m_q == 0, (m == 0) & (v == 0))  # exact zeros stay zero, nothing else does
    qm.side["scale"] = qm.side["scale"][:-1]
    with pytest.raises(ValueError, match="scales"):
        M.dequantize_m(qm, None)
    with pytest.raises(ConfigError, match="m_bits"):
        M.GridCodec(m_bits=4)
    with pytest.raises(ConfigError, match="step"):
        M.AdamHP(0)
    none_m, _ = M.decode_pair(*M.encode_pair(m, v, hp, M.GridCodec(m_bits=0)), hp)
    assert not bool(none_m.any())


@pytest.mark.parametrize("n", [1, 2, 129, 70_001, 140_003])
def test_prune_cut_selection_equals_its_torch_reference(n):
    # ties (values on a coarse grid) and the strided sample of a large tensor, as quantize_m takes it
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 8).round().abs()[:: max(1, n // 65536)]
    for q in (0.0, 0.5, 0.9, 0.999):
        got, ref = M._quantile(x, q), M._quantile_reference(x, q)
        assert got.dtype == ref.dtype == torch.float32 and torch.equal(got, ref), (n, q)
        assert torch.allclose(got, torch.quantile(x, q))


@pytest.mark.skipif(not M.K.HAVE_NUMBA, reason="the selection kernel needs numba")
def test_batched_order_statistics_equal_kthvalue_on_every_segment():
    # segments of every shape the radix select meets: one value, all equal (the bucket is the whole
    # segment), the rank's bucket its last (the next value lies in a later bucket), signed values,
    # a range of 2**200, and segments of a strided sample's length
    g = torch.Generator().manual_seed(0)
    segs = [torch.tensor([3.5]), torch.full((500,), 0.25), torch.tensor([1.0, 1.0 + 2**-20, 7.0]),
            torch.randn(1000, generator=g), torch.randn(4000, generator=g).mul(2.0 ** 100).abs(),
            torch.randn(4000, generator=g).exp().mul(1e-30), (torch.randn(65536, generator=g) * 8).round().abs(),
            torch.rand(70_001, generator=g)]
    x = torch.cat(segs)
    at = np.array([0] + [s.numel() for s in segs]).cumsum()
    for q in (0.0, 0.01, 0.5, 0.999, 1.0):
        got = M._quantiles(x.numpy(), at, q)
        for s, seg in enumerate(segs):
            ref = M._quantile_reference(seg, q)
            assert got[s].dtype == torch.float32 and torch.equal(got[s], ref), (s, q, got[s], ref)
    # many segments at once: their interpolations in one torch.lerp call over a vector (its vectorized
    # loop and its tail) give each the bits of the reference's lerp with a Python float weight
    many = [torch.rand(int(n), generator=g) for n in torch.randint(2, 400, (300,), generator=g)]
    at = np.array([0] + [s.numel() for s in many]).cumsum()
    for q in (0.37, 0.9, 0.999):
        got = M._quantiles(torch.cat(many).numpy(), at, q)
        ref = torch.stack([M._quantile_reference(seg, q) for seg in many])
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), q
    lo, hi = np.empty(2, np.float32), np.empty(2, np.float32)
    M.K.order_pairs(np.array([2.0, -0.0, 0.0, -3.0], np.float32), np.array([0, 4, 4]), np.array([1, 0]), lo, hi)
    assert str(lo[0]) == "-0.0" and str(hi[0]) == "0.0"  # -0 below +0: a sort's order


@pytest.mark.skipif(not M.K.HAVE_NUMBA, reason="the selection kernel needs numba")
def test_prune_cuts_a_tensor_at_a_time_equal_the_whole_batchs_sample():
    # abs_cuts (each tensor's |m / D| sample and its two order statistics, a tensor at a time) against
    # the batch's sample (numpy's IEEE division) through order_pairs, and the torch reference: empty
    # tensors, strided samples (from 131072 values), no D (u = m), ties and -0
    g = torch.Generator().manual_seed(1)
    ns = [0, 1, 7, 300, 0, 5000, 131_073, 200_000, 64]
    m = torch.randn(sum(ns), generator=g)
    m[:400] = torch.tensor([0.0, -0.0]).repeat(200)
    D = torch.rand(sum(ns), generator=g).add_(1e-3)
    offsets = M.segment_offsets(ns)
    strides = np.array([M._cut_stride(n) for n in ns], dtype=np.int64)
    sizes = [-(-n // int(st)) for n, st in zip(ns, strides)]
    for q in (0.0, 0.37, 0.9, 1.0):
        ranks, w = M._ranks(sizes, q)
        for d in (D.numpy(), D.numpy()[:0]):
            lo, hi = np.zeros(len(ns), np.float32), np.zeros(len(ns), np.float32)
            M.K.abs_cuts(m.numpy(), d, offsets, strides, ranks, lo, hi, np.empty(max(sizes), np.float32))
            got = M._lerp(lo, hi, w)
            at = M.segment_offsets(sizes)
            sample = np.concatenate([np.abs(m.numpy()[a:e:st] / d[a:e:st] if d.size else m.numpy()[a:e:st])
                                     for a, e, st in zip(offsets[:-1], offsets[1:], strides)])
            some = [i for i, n in enumerate(ns) if n]
            want = M._quantiles(sample, np.array([0] + [sizes[i] for i in some]).cumsum(), q)
            assert torch.equal(got[some].view(torch.int32), want.view(torch.int32)), (q, d.size)
            for i in some:
                seg = sample[at[i]:at[i + 1]]
                assert torch.equal(got[i], M._quantile_reference(torch.from_numpy(seg), q)), (q, i)


@pytest.mark.skipif(not M.K.HAVE_NUMBA, reason="the effects kernel needs numba")
def test_factored_effects_are_torchs_rounded_means():
    # the keyframe's row and column effects: exact integer sums and one fp32 division give torch's
    # mean bit for bit, round half to even as torch.round (rows and columns of mean exactly k + 1/2)
    g = torch.Generator().manual_seed(2)
    grids = [torch.randint(0, 60, (int(r), int(c)), generator=g, dtype=torch.int32)
             for r, c in torch.randint(2, 200, (40, 2), generator=g)]
    half = torch.zeros(6, 8, dtype=torch.int32)
    half[:, :4], half[1, :] = 1, 5  # row means 0.5 (to 0) and 5; column means of c - a k + 1/2
    grids += [half, torch.tensor([[0, 3], [1, 0], [2, 7]], dtype=torch.int32)]
    for c in grids:
        rows, cols = c.shape
        a, b = torch.empty(rows), torch.empty(cols)
        eff = M.K.factored_effects(c.reshape(-1).numpy(), rows, cols, a.numpy(), b.numpy())
        c2 = c.to(torch.float32)
        ra = torch.round(c2.mean(1))
        rb = torch.round((c2 - ra[:, None]).mean(0))
        assert torch.equal(a, ra) and torch.equal(b, rb), c.shape
        assert eff == max(float(ra.abs().max()), float(rb.abs().max()))


@pytest.mark.skipif(not M.K.HAVE_NUMBA, reason="the grid kernels need numba")
@pytest.mark.parametrize("step", [2.0, 4.0, 8.0, 64.0, 1024.0])
def test_power_of_two_steps_code_without_the_tables(step):
    # y = D / eps >= 1 at every exponent, at and around each power of two, inf, and v == 0 == m
    s = M._pow2(step)
    assert s >= 1 and M._pow2(step * 1.5) == 0 and M._pow2(1.0) == 0
    lo, thr, _, width = M.grid_bounds(step)
    e = np.arange(127, 256, dtype=np.uint32)
    y = np.concatenate([(e << 23) | m for m in (0, 1, 0x400000, 0x7FFFFF)]).view(np.float32)
    y = np.concatenate([y, np.random.default_rng(0).uniform(1, 2 ** 60, 10_000).astype(np.float32)])
    vb = np.ones(y.size, np.uint32)
    vb[::7] = 0  # with m == 0 as well: code 0
    mb = np.zeros(y.size, np.uint32)
    want, got = y.view(np.int32).copy(), y.view(np.int32).copy()
    top1 = M.K._grid_codes1(vb, mb, lo, thr, want)
    top2 = M.K._grid_codes_pow2(vb, mb, s, got)
    assert width == 1 and top1 == top2 and np.array_equal(want, got)


def test_all_finite_is_finite_in_fp32():
    from ckptzip.quant.base import all_finite

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = torch.randn(1000).to(dtype)
        assert all_finite(x) and all_finite(x[:0])
        for bad in (float("nan"), float("inf"), -float("inf")):
            y = x.clone()
            y[517] = bad
            assert not all_finite(y), (dtype, bad)
    # an fp64 moment beyond fp32's range is not codable (quantize_m would see inf)
    assert not all_finite(torch.tensor([1.0, 1e300], dtype=torch.float64))


@pytest.mark.parametrize("factored", [False, True])
def test_pair_levels_are_the_decoded_grid(adam_pair, factored):
    m, v, hp = adam_pair
    qm, qv, c = M.encode_pair_levels(m, v, hp, M.GridCodec(factored=factored, normalize="decoded"))
    assert qv.meta["factored"] is factored and torch.equal(c, M.decode_grid(qv))
    assert torch.equal(qm.codes, M.encode_pair(m, v, hp, M.GridCodec(factored=factored, normalize="decoded"))[0].codes)


def test_zigzag_by_shifts_is_the_where_form():
    r = torch.cat([torch.arange(-5000, 5000), torch.tensor([(1 << 62) - 1, -(1 << 62)])])
    assert torch.equal(M._zigzag(r), torch.where(r >= 0, 2 * r, -2 * r - 1))
    z = torch.cat([torch.arange(-5000, 10000), torch.tensor([(1 << 63) - 1, -(1 << 63)])])
    assert torch.equal(M._unzigzag(z), torch.where(z % 2 == 0, z // 2, -(z + 1) // 2))
    assert torch.equal(M._unzigzag(M._zigzag(r)), r)


@pytest.mark.parametrize("n,group", [(8192, 100), (8192, 256), (50, 256), (512, 256)])
def test_dequantize_m_is_the_repeated_scale_product(adam_pair, n, group):
    m, v, hp = adam_pair
    n = min(n, m.numel())
    m, D = m.reshape(-1)[:n], M.denominator(v, hp)[:n]
    q = M.quantize_m(m, D, bits=1, group=group, prune=0.9)
    want = q.codebook[q.codes.long()] * q.side["scale"].float().repeat_interleave(group)[:n] * D
    assert torch.equal(M.dequantize_m(q, D), want)


@pytest.mark.parametrize("codec", [M.GridCodec(), M.GridCodec(factored=True, m_bits=3, prune=0.0, group=100),
                                   M.GridCodec(normalize="decoded", m_bits=2, prune=0.5, group=64),
                                   M.GridCodec(m_bits=0), M.GridCodec(factored=False)])
def test_batched_pairs_equal_one_by_one(codec):
    """encode_pairs_levels (one pass over every parameter's moments) gives each pair the codes,
    scales and levels it gets alone: sizes that do not fill a group, zeros, bf16, per-pair hparams."""
    g = torch.Generator().manual_seed(3)
    pairs = []
    for i, (shape, dtype) in enumerate([((300,), torch.float32), ((64, 96), torch.bfloat16), ((7, 13), torch.float32),
                                        ((5, 256), torch.float32)]):
        m, v = torch.randn(shape, generator=g) * 1e-3, torch.rand(shape, generator=g) ** 4 * 1e-5
        v.view(-1)[::5] = 0
        m.view(-1)[::10] = 0
        hp = M.AdamHP(step=3 + 7 * (i % 2), beta2=0.999 - 0.009 * (i % 2), eps=1e-8 * (1 + i % 2))
        pairs.append((m.to(dtype), v.to(dtype), hp))
    for (m, v, hp), (qm, qv, c) in zip(pairs, M.encode_pairs_levels(pairs, codec)):
        em, ev, ec = M.encode_pair_levels(m, v, hp, codec)
        assert torch.equal(ec, c) and torch.equal(ev.codes, qv.codes) and ev.meta == qv.meta
        assert all(torch.equal(ev.side[k], qv.side[k]) for k in ev.side)
        assert (qm is None) == (em is None) == (codec.m_bits == 0)
        if qm is not None:
            assert torch.equal(em.codes, qm.codes) and torch.equal(em.side["scale"], qm.side["scale"])


@pytest.mark.parametrize("v_step", [0.5, 0.004])
def test_factored_tail_kernel_equals_the_torch_reference(monkeypatch, v_step):
    """The fused residual + zigzag of factored v codes (momentkernels.factored_tail) against the torch
    code beside it, on 2-D moments with row and column structure, zeros and a wide range; a fine
    step makes codes in the thousands (the kernel's output then int32, else uint8 / int16)."""
    if not M.K.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    g = torch.Generator().manual_seed(7)
    pairs = []
    for i, (r, c) in enumerate(((64, 48), (3, 1000), (257, 2))):
        v = (torch.rand(r, 1, generator=g) * torch.rand(1, c, generator=g)) ** 6 * 10.0 ** -(i + 3)
        v[::7] = 0
        m = torch.randn(r, c, generator=g) * v.sqrt()
        pairs.append((m, v, M.AdamHP(step=3 + i)))
    calls = []
    tail = M.K.factored_tail
    monkeypatch.setattr(M.K, "factored_tail", lambda *a: calls.append(1) or tail(*a))
    codec = M.GridCodec(v_step=v_step)
    fast = M.encode_pairs_levels(pairs, codec)
    assert len(calls) == 3
    assert (max(qv.n_levels for _, qv, _ in fast) > 1000) == (v_step < 0.1)
    # the decoder's inverse (momentkernels.factored_levels), and a damaged record's negative level
    levels = [M.decode_grid(qv) for _, qv, _ in fast]
    bad = dataclasses.replace(fast[0][1], side={**fast[0][1].side, "row": fast[0][1].side["row"] - 10 ** 4})
    with pytest.raises(ValueError, match="negative level"):
        M.decode_grid(bad)
    monkeypatch.setattr(M, "_use_kernels", lambda x: False)
    with pytest.raises(ValueError, match="negative level"):
        M.decode_grid(bad)
    for (_, qv, lv), (_, rv, _), got in zip(fast, M.encode_pairs_levels(pairs, codec), levels):
        assert qv.meta["factored"] and rv.meta["factored"]
        assert torch.equal(qv.codes, rv.codes) and qv.n_levels == rv.n_levels
        assert all(torch.equal(qv.side[k], rv.side[k]) for k in ("row", "col"))
        want = M.decode_grid(qv)
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want) and torch.equal(got, lv)


@pytest.mark.parametrize("codec", [M.GridCodec(), M.GridCodec(prune=0.0, group=100), M.GridCodec(v_step=0.5),
                                   M.GridCodec(v_step=0.3, normalize="decoded", group=64),
                                   # a delta save's: plain records, narrowed once a batch (codes < 256),
                                   # or one at a time (codes in the thousands)
                                   M.GridCodec(factored=False), M.GridCodec(factored=False, v_step=0.004)])
@pytest.mark.parametrize("overflow", [False, True])
def test_numba_kernels_equal_the_torch_reference(codec, overflow, monkeypatch):
    """quant/momentkernels.py (D and the grid codes in one pass, the prune cut's sample, the 1-bit
    direction's scales and codes) against the plain-torch code beside them: per-tensor hparams
    (bc2, eps), exact zeros of both signs, v over 30 decades, a tensor of 300k values (a strided
    cut sample), groups cut short; ``overflow``: an eps whose D / eps is inf (the top level)."""
    if not M.K.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    g = torch.Generator().manual_seed(5)
    pairs = []
    for i, n in enumerate((1000, 4096, 333, 300_000)):
        m = torch.randn(n, generator=g) * 1e-3
        v = torch.rand(n, generator=g) ** 4 * 10.0 ** -torch.randint(0, 30, (n,), generator=g).float()
        v[::5] = 0
        m[::10] = 0
        m[5::20] = -0.0
        eps = 1e-45 if overflow and not i else 1e-8
        pairs.append((m, v, M.AdamHP(step=5 + i, beta2=0.999 - 0.01 * (i % 2), eps=eps)))
    calls = []
    for name in ("grid_kernel", "sign_kernel"):
        kernel = getattr(M.K, name)
        monkeypatch.setattr(M.K, name, lambda *a, k=kernel, n=name: calls.append(n) or k(*a))
    fast = M.encode_pairs_levels(pairs, codec)
    assert calls == ["grid_kernel"] + ["sign_kernel"] * (codec.m_bits == 1)
    if overflow:
        assert fast[0][1].n_levels == M.grid_bounds(codec.v_step)[0][255] + 1  # inf: every bound below it
    monkeypatch.setattr(M, "_use_kernels", lambda x: False)
    for (qm, qv, c), (rm, rv, rc) in zip(fast, M.encode_pairs_levels(pairs, codec)):
        assert torch.equal(c, rc) and torch.equal(qv.codes, rv.codes) and qv.n_levels == rv.n_levels
        assert qv.codes.dtype == rv.codes.dtype and qv.meta == rv.meta and qv.shape == rv.shape
        bits = lambda q: q.side["scale"].view(torch.int16)  # noqa: E731 (inf scales where D / eps is inf)
        assert torch.equal(qm.codes, rm.codes) and torch.equal(bits(qm), bits(rm))
    # the moment that is not finite is named, by either path
    bad = [(m, v.clone(), hp) for m, v, hp in pairs]
    bad[2][1][7] = float("nan")
    for use in (True, False):
        monkeypatch.setattr(M, "_use_kernels", lambda x, u=use: u)
        with pytest.raises(NonFiniteError, match="exp_avg_sq"):
            M.encode_pairs_levels(bad, codec)


@pytest.mark.parametrize("codec", [M.GridCodec(), M.GridCodec(m_bits=3, prune=0.0, group=100),
                                   M.GridCodec(normalize="decoded", m_bits=2, prune=0.5, group=64)])
def test_direction_values_equal_the_torch_reference(codec, monkeypatch):
    """dequantize_m's kernel (momentkernels.direction_values: levels[c] * scale (* D) in one pass
    over narrow codes) against the reference's gather and multiplies, bit for bit; codes outside
    the levels are named by both."""
    if not M.K.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    g = torch.Generator().manual_seed(7)
    pairs = [(torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6, M.AdamHP(step=3))
             for n in (1000, 333, 70_000)]
    for (qm, qv, _), (_, _, hp) in zip(M.encode_pairs_levels(pairs, codec), pairs):
        D = M.decode_denominator(qv, hp)
        got = {}
        for use in (True, False):
            monkeypatch.setattr(M, "_use_kernels", lambda x, u=use: u)
            got[use] = M.dequantize_m(qm, D)
            bad = dataclasses.replace(qm, codes=qm.codes.clone())
            bad.codes[5] = qm.n_levels + 3
            with pytest.raises((ValueError, IndexError)):
                M.dequantize_m(bad, D)
        assert qm.codes.dtype == torch.uint8 and got[True].dtype == got[False].dtype
        assert torch.equal(got[True].view(torch.int32), got[False].view(torch.int32))


def test_sqrt_rn_is_correctly_rounded_and_decodes_adam():
    """base.sqrt_rn is the fp64 root rounded once to fp32 (the correctly rounded one: torch's CPU fp32
    sqrt is not, and differs by CPU vendor) over 60 decades, subnormals and zeros; Adam's decoded
    denominator and the grid's D use it."""
    from ckptzip.quant.adam import adam_denominator
    from ckptzip.quant.base import sqrt_rn

    g = torch.Generator().manual_seed(1)
    x = torch.rand(200_000, generator=g) * 10.0 ** -torch.randint(0, 45, (200_000,), generator=g).float()
    x[::97] = 0
    want = x.double().sqrt().float()
    assert torch.equal(sqrt_rn(x), want) and torch.equal(sqrt_rn(x.reshape(400, 500)), want.reshape(400, 500))
    hp = M.AdamHP(step=7)
    assert torch.equal(adam_denominator(x, 7), sqrt_rn(x / hp.bc2) + hp.eps)
    assert torch.equal(M.denominator(x, hp), sqrt_rn(x / hp.bc2) + hp.eps)


def _grid_records(step: float, factored: bool):
    """(qm, qv, codes of v, hp) of random Adam pairs on a grid of ``step``: every pair has exact
    zeros (v's zero level) and a wide range of v."""
    g = torch.Generator().manual_seed(11)
    pairs = []
    for n in (1000, 333, 70_000):
        m, v = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) ** 8 * 1e-4
        m[:7], v[:7] = 0, 0
        pairs.append((m.reshape(-1, 1) if factored else m, v.reshape(-1, 1) if factored else v, M.AdamHP(step=5)))
    codec = M.GridCodec(v_step=step, factored=factored)
    return [(qm, qv, c, hp) for (qm, qv, c), (*_, hp) in zip(M.encode_pairs_levels(pairs, codec), pairs)]


@pytest.mark.skipif(not M.K.HAVE_NUMBA, reason="the table kernels need numba")
@pytest.mark.parametrize("step", [2.0, 0.5, 0.37, 1 / 3])
@pytest.mark.parametrize("factored", [False, True])
def test_decode_tables_give_the_elementwise_floats(step, factored):
    """decode_v's per-level tables and decode_pair's direction pass by v's codes (momentkernels
    level_values, direction_by_level) against the elementwise float64 maps and the per-element D
    with the masked write, bit for bit, for uint8 and int64 codes. At steps 0.5 and 0.37 float64
    exp2 differs between torch's vectorized and scalar paths on some levels; fp32 rounds it away."""
    for qm, qv, c, hp in _grid_records(step, factored):
        D = M.decode_denominator(qv, hp, c)
        want_v = M.v_from_denominator(D, hp, qv.shape)
        want_m = M.dequantize_m(qm, D)
        want_m.reshape(-1)[c.reshape(-1) == 0] = 0
        assert int((c == 0).sum()) >= 7 and bool((want_m == 0).any())
        for codes in (c.to(torch.int64), c.to(torch.uint8)) if int(c.max()) < 256 else (c.to(torch.int64),):
            v, none, table = M.decode_v(qv, hp, codes)
            assert none is None and table is not None and table.dtype == torch.float32
            assert torch.equal(v.view(torch.int32), want_v.view(torch.int32))
            m = M.dequantize_m(qm, None, v_codes=codes, d_table=table)
            assert torch.equal(m.view(torch.int32), want_m.view(torch.int32))
        m, v = M.decode_pair(qm, qv, hp)
        assert torch.equal(m.view(torch.int32), want_m.view(torch.int32)) and torch.equal(v, want_v)


@pytest.mark.skipif(not M.K.HAVE_NUMBA, reason="the table kernels need numba")
def test_decode_tables_fall_back_where_torchs_paths_differ(monkeypatch):
    """A table is kept only if every level's D is the same alone (torch's scalar tail) and in whole
    vectors: a map whose scalar path differs gets no table, and decode_v computes per element."""
    qm, qv, c, hp = _grid_records(0.5, False)[2]
    exact = M._d_map

    def scalar_differs(step, eps):  # a lone element a few fp32 ulps off, as a scalar exp2 could be
        f = exact(step, eps)
        return lambda w: f(w).mul_(1 + 2 ** -20) if w.numel() == 1 else f(w)

    monkeypatch.setattr(M, "_d_map", scalar_differs)
    M._level_tables.cache_clear()
    M._d_table.cache_clear()
    try:
        assert M._level_tables(0.5, hp.eps, hp.bc2, 64) is None
        v, D, table = M.decode_v(qv, hp, c)
        assert table is None and D is not None and torch.equal(v, M.v_from_denominator(D, hp, qv.shape))
    finally:
        M._level_tables.cache_clear()
        M._d_table.cache_clear()


@pytest.mark.skipif(not M.K.HAVE_NUMBA, reason="the table kernels need numba")
def test_decode_tables_refuse_codes_past_them(monkeypatch):
    """A code past the tables (a top the caller got wrong, a negative int64) raises, and reads
    nothing past them; the torch path of dequantize_m by level gives the kernel's floats."""
    qm, qv, c, hp = _grid_records(2.0, False)[0]
    for bad in (70, -1):
        codes = c.to(torch.int64).clone()
        codes[3] = bad
        with pytest.raises(ValueError, match="outside the 64 levels"):
            M.decode_v(qv, hp, codes, top=5)
    _, _, table = M.decode_v(qv, hp, c)
    codes = c.to(torch.int64)
    codes[3] = table.numel()
    with pytest.raises(ValueError, match="exp_avg_sq codes outside"):
        M.dequantize_m(qm, None, v_codes=codes, d_table=table)
    with pytest.raises(ValueError, match="needs the codes"):
        M.dequantize_m(qm, None, d_table=table)
    got = {}
    for use in (True, False):
        monkeypatch.setattr(M, "_use_kernels", lambda x, u=use: u)
        got[use] = M.dequantize_m(qm, None, v_codes=c, d_table=table)
    assert torch.equal(got[True].view(torch.int32), got[False].view(torch.int32))
