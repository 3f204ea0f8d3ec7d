"""quant/moments.py: v on a fixed log grid of Adam's denominator, m as a few-bit direction."""
import dataclasses

import pytest
import torch

from ckptzip.errors import ConfigError
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


def test_chunked_grid_codes_equal_one_pass(adam_pair, monkeypatch):
    """The kernel's grid codes, chunk by chunk through one buffer, are those of one pass over the
    whole tensor (a chunk of 1024: a multiple of the SIMD widths, as the default), with Adam's eps
    and with one eps per element, and the reference's where the kernel gives up."""
    m, v, hp = adam_pair
    vf, mf = v.reshape(-1).float(), m.reshape(-1).float()
    D = M._denominator(vf, hp.bc2, hp.eps)
    per_element = torch.full_like(vf, hp.eps)
    want = {k: M._grid_codes(vf, D, e, 0.5, mf) for k, e in (("eps", hp.eps), ("per element", per_element))}
    monkeypatch.setattr(M, "_CHUNK", 1024)
    assert vf.numel() > 3 * 1024
    for k, e in (("eps", hp.eps), ("per element", per_element)):
        c, top = M._grid_codes(vf, D, e, 0.5, mf)
        assert torch.equal(c, want[k][0]) and top == want[k][1] == int(c.max()), k
    huge = D.clone()
    huge[-1] = float("inf")  # the kernel gives up on its chunk: the reference codes the whole tensor
    c, top = M._grid_codes(vf, huge, hp.eps, 0.5, mf)
    assert top is None and c.dtype == torch.int64


@pytest.mark.parametrize("prune", [0.0, 0.9])
@pytest.mark.parametrize("normalized", [False, True])
def test_chunked_sign_direction_equals_one_pass(adam_pair, monkeypatch, prune, normalized):
    """A large tensor's 1-bit direction, row chunk by row chunk through reused buffers, has the
    codes, scales and meta of the one-pass batch path (forced here by a small chunk)."""
    m, v, hp = adam_pair
    mf = m.reshape(-1).float()
    D = M._denominator(v.reshape(-1).float(), hp.bc2, hp.eps) if normalized else None
    want = M._quantize_ms(mf, D, [m], bits=1, group=256, prune=prune)[0]
    monkeypatch.setattr(M, "_CHUNK", 1024)  # 4 rows of 256 a chunk; the tensor is over the chunk size
    assert mf.numel() > 1024 and mf.numel() % 256 == 0
    got = M._quantize_ms(mf, D, [m], bits=1, group=256, prune=prune)[0]
    assert torch.equal(got.codes, want.codes) and got.codes.dtype == want.codes.dtype
    assert torch.equal(got.side["scale"], want.side["scale"]) and torch.equal(got.codebook, want.codebook)
    assert got.meta == want.meta and got.shape == want.shape and got.n_levels == want.n_levels


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
                                   M.GridCodec(m_bits=0)])
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


@pytest.mark.parametrize("codec", [M.GridCodec(), M.GridCodec(prune=0.0, group=100)])
@pytest.mark.parametrize("overflow", [False, True])
def test_numba_tails_equal_the_torch_reference(codec, overflow, monkeypatch):
    """quant/momentkernels.py (grid codes' integer tail, 1-bit direction codes) against the plain-torch
    code beside them; ``overflow``: a denominator whose log is inf (the grid kernel hands it back)."""
    if not M.K.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    g = torch.Generator().manual_seed(5)
    pairs = []
    for i, n in enumerate((1000, 4096, 333)):
        m, v = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) ** 4 * 1e-5
        v[::5] = 0
        m[::10] = 0
        pairs.append((m, v, M.AdamHP(step=5 + i, eps=1e-45 if overflow and not i else 1e-8)))
    calls = []
    tail = M.K.grid_tail
    monkeypatch.setattr(M.K, "grid_tail", lambda *a: calls.append(1) or tail(*a))
    fast = M.encode_pairs_levels(pairs, codec)
    assert calls
    monkeypatch.setattr(M, "_use_kernels", lambda x: False)
    for (qm, qv, c), (rm, rv, rc) in zip(fast, M.encode_pairs_levels(pairs, codec)):
        assert torch.equal(c, rc) and torch.equal(qv.codes, rv.codes)
        bits = lambda q: q.side["scale"].view(torch.int16)  # noqa: E731 (NaN scales where D / eps is inf)
        assert torch.equal(qm.codes, rm.codes) and torch.equal(bits(qm), bits(rm))
