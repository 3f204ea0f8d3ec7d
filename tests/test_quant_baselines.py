"""The paper's three baseline quantizers (quant/uniform.py, adaptive.py, gobo.py) on real weights."""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from ckptzip.errors import ConfigError, CorruptCheckpointError, NonFiniteError
from ckptzip.quant import adaptive, gobo, uniform
from ckptzip.quant.adaptive import AdaptiveConfig, greedy_range
from ckptzip.quant.gobo import GoboConfig, kmeans_l1_1d
from ckptzip.quant.uniform import UniformConfig

MODULES = {"uniform": (uniform, UniformConfig()), "adaptive": (adaptive, AdaptiveConfig()),
           "adaptive-rows": (adaptive, AdaptiveConfig(row_wise=True)), "gobo": (gobo, GoboConfig())}


@pytest.fixture(autouse=True)
def _one_thread():
    # these tensors are small: on a shared, oversubscribed CPU torch's thread pool only adds
    # spin-waits (30x slower here); conftest restores the thread count after each test
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def real(digits_snapshots):
    """name -> fp32 tensor from the last checkpoint of the real digits run (weights and Adam moments)."""
    _, _, snaps, _ = digits_snapshots
    sd, st = snaps[-1].model, snaps[-1].optimizer["state"]
    # optimizer param order: fc1.weight, fc1.bias, norm.weight, norm.bias, fc2.weight, ...
    return {
        "fc1.weight": sd["fc1.weight"], "fc2.weight": sd["fc2.weight"], "fc1.bias": sd["fc1.bias"],
        "norm.weight": sd["norm.weight"], "fc3.bias": sd["fc3.bias"],
        "fc2.exp_avg": st[4]["exp_avg"], "fc2.exp_avg_sq": st[4]["exp_avg_sq"],
        "fc1.exp_avg": st[0]["exp_avg"],
    }


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b.double()) ** 2).mean())


def minmax_reference(x: np.ndarray, n_levels: int):
    """Plain numpy min-max grid with levels on both ends: (codes, values)."""
    x = x.astype(np.float32)
    lo, hi = np.float32(x.min()), np.float32(x.max())
    scale = np.float32((hi - lo) / np.float32(n_levels - 1)) if hi > lo else np.float32(1)
    codes = np.clip(np.rint((x - lo) / scale), 0, n_levels - 1).astype(np.int64)
    return codes, (codes.astype(np.float32) * scale + lo).astype(np.float32)


# --------------------------------------------------------------------------- uniform (QD+)
def test_uniform_entropy_rule_matches_numpy_reference(real):
    for name, x in real.items():
        for cfg in (UniformConfig(8, 256), UniformConfig(16, 64), UniformConfig(32, 32)):
            q = uniform.quantize(x, cfg)
            fine, _ = minmax_reference(x.numpy().ravel(), cfg.max_bins)
            p = np.bincount(fine, minlength=cfg.max_bins) / fine.size
            p = p[p > 0]
            h = float(-(p * np.log2(p)).sum())
            expect = min(max(2 ** math.ceil(h - 1e-9), cfg.min_bins), cfg.max_bins)
            assert q.meta["entropy_bits"] == pytest.approx(h, abs=1e-9), name
            assert q.n_levels == expect, (name, cfg, h)
            codes, values = minmax_reference(x.numpy().ravel(), q.n_levels)
            assert torch.equal(q.codes, torch.from_numpy(codes)), (name, cfg)
            assert torch.equal(uniform.dequantize(q).reshape(-1), torch.from_numpy(values)), (name, cfg)


def test_uniform_error_within_half_step_and_codes_in_range(real):
    for name, x in real.items():
        q = uniform.quantize(x, UniformConfig(8, 256))
        assert q.codes.dtype == torch.int64 and q.codes.numel() == x.numel()
        assert int(q.codes.min()) >= 0 and int(q.codes.max()) < q.n_levels
        err = (uniform.dequantize(q) - x).abs().max().item()
        ulp = 2 * torch.finfo(torch.float32).eps * x.abs().max().item()  # fp32 rounding of k * scale + lo
        assert err <= q.meta["scale"] / 2 + ulp, name
        # levels on both ends: min and max are reproduced exactly
        y = uniform.dequantize(q)
        assert y.min() == x.min() and y.max().item() == pytest.approx(x.max().item(), rel=1e-6)


def test_uniform_gives_more_bins_to_higher_entropy_tensors(real):
    w, v = real["fc2.weight"], real["fc2.exp_avg_sq"]  # spread-out weights vs skewed Adam v
    qw, qv = uniform.quantize(w), uniform.quantize(v)
    assert qv.meta["entropy_bits"] < qw.meta["entropy_bits"] - 1
    assert qv.n_levels < qw.n_levels
    assert (qw.n_levels, qv.n_levels) == (256, 64)  # H = 7.5 and 5.4 bits on this run
    # the floor and ceiling of the search space hold
    assert uniform.quantize(v, UniformConfig(128, 256)).n_levels == 128
    assert uniform.quantize(w, UniformConfig(8, 32)).n_levels == 32


# --------------------------------------------------------------------------- adaptive (CNR+)
@pytest.mark.parametrize("n_bins", [8, 16, 64, 256])
def test_adaptive_mse_never_worse_than_minmax(real, n_bins):
    gains = []
    for name, x in real.items():
        plain = mse(x, uniform.dequantize(uniform.quantize(x, UniformConfig(n_bins, n_bins))))
        for steps, ratio in ((25, 0.1), (100, 0.5)):
            q = adaptive.quantize(x, AdaptiveConfig(n_bins, steps, ratio))
            assert int(q.codes.min()) >= 0 and int(q.codes.max()) < n_bins
            got = mse(x, adaptive.dequantize(q))
            assert got <= plain * (1 + 1e-6), (name, n_bins, steps, ratio)
            gains.append(got / plain if plain else 1.0)
    if n_bins <= 16:  # the clipping search pays at low bit widths
        assert min(gains) < 0.7


def _greedy_reference(row: np.ndarray, n_bins: int, n_step_bins: int, n_steps: int):
    """Scalar port of Guan et al.'s greedy loop (best visited range kept), losses in numpy."""
    row = row.astype(np.float32)
    lo0, hi0 = np.float32(row.min()), np.float32(row.max())
    step = np.float32((hi0 - lo0) / np.float32(n_step_bins))

    def loss(i, j):
        lo, hi = np.float32(lo0 + np.float32(i) * step), np.float32(hi0 - np.float32(j) * step)
        s = np.float32((hi - lo) / np.float32(n_bins - 1))
        s = s if s > 0 else np.float32(1)
        c = np.clip(np.rint((row - lo) / s), 0, n_bins - 1).astype(np.float32)
        d = row - (c * s + lo)
        return float(np.sum(d.astype(np.float64) * d))

    i = j = 0
    best, best_ij = loss(0, 0), (0, 0)
    for _ in range(n_steps):
        l1, l2 = loss(i + 1, j), loss(i, j + 1)
        i, j, cur = (i + 1, j, l1) if l1 < l2 else (i, j + 1, l2)
        if cur < best:
            best, best_ij = cur, (i, j)
    return best_ij


def test_adaptive_greedy_matches_scalar_reference_per_row(real):
    x = real["fc2.weight"]  # (128, 128): 128 independent greedy paths in one batched search
    cfg = AdaptiveConfig(bins=8, step_bins=50, range_ratio=0.4)
    for ev in ("direct", "sorted"):
        _, _, steps = greedy_range(x, cfg.bins, cfg.step_bins, cfg.n_steps, evaluator=ev)
        got = [(int(a), int(b)) for a, b in zip(steps[0, :, 0], steps[1, :, 0])]
        ref = [_greedy_reference(r, cfg.bins, cfg.step_bins, cfg.n_steps) for r in x.numpy()]
        assert got == ref, ev
    assert len(set(ref)) > 5  # rows really take different paths
    per_tensor = adaptive.quantize(x, cfg)
    assert (per_tensor.meta["steps_min"], per_tensor.meta["steps_max"]) == _greedy_reference(
        x.numpy().ravel(), cfg.bins, cfg.step_bins, cfg.n_steps)


def test_adaptive_sorted_evaluator_equals_direct(real):
    for name in ("fc1.weight", "fc2.exp_avg_sq"):
        X = real[name].reshape(1, -1)
        for B in (8, 256):
            a = greedy_range(X, B, 100, 30, evaluator="sorted")
            b = greedy_range(X, B, 100, 30, evaluator="direct")
            assert all(torch.equal(u, v) for u, v in zip(a, b)), (name, B)
    ls = adaptive._SortedLoss(real["fc2.weight"], 16)
    X = real["fc2.weight"]
    lo = X.amin(1, keepdim=True)[None] + torch.tensor([0.0, 0.01]).view(2, 1, 1)
    hi = X.amax(1, keepdim=True)[None] - torch.tensor([0.02, 0.0]).view(2, 1, 1)
    # rtol: a value within fp32 rounding of a rounding boundary may take the other level (same error)
    torch.testing.assert_close(ls(lo, hi), adaptive._sq_err(X, lo, hi, 16), rtol=1e-7, atol=0)


def test_adaptive_clips_outside_the_range_and_row_wise_round_trips(real):
    x = real["fc2.exp_avg"]
    q = adaptive.quantize(x, AdaptiveConfig(8, 100, 0.5))
    lo, hi = q.meta["lo"], q.meta["hi"]
    assert q.meta["steps_min"] + q.meta["steps_max"] > 0
    y = adaptive.dequantize(q)
    below, above = x < lo, x > hi
    assert bool(below.any() or above.any())
    assert torch.all(y[below] == q.codebook[0]) and torch.all(y[above] == q.codebook[-1])
    inside = ~(below | above)
    ulp = 2 * torch.finfo(torch.float32).eps * x.abs().max().item()
    assert (y[inside] - x[inside]).abs().max() <= q.meta["scale"] / 2 + ulp
    qr = adaptive.quantize(x, AdaptiveConfig(8, 100, 0.5, row_wise=True))
    assert qr.side["lo"].shape == (x.shape[0],) and torch.isnan(qr.codebook).all()
    yr = adaptive.dequantize(qr)
    assert yr.shape == x.shape and mse(x, yr) < mse(x, y)  # own range per row fits better


# --------------------------------------------------------------------------- gobo (GOBO+)
def test_gobo_outliers_are_exact_and_follow_the_gaussian_rule(real):
    total = 0
    for name, x in real.items():
        q = gobo.quantize(x, GoboConfig(bins=8))
        xd = x.double().reshape(-1)
        mu, sd = xd.mean(), xd.std(unbiased=False)
        log_p = -0.5 * ((xd - mu) / sd) ** 2 - torch.log(sd) - 0.5 * math.log(2 * math.pi)
        mask = q.codes == 8
        assert torch.equal(mask, log_p < -4.0), name
        y = gobo.dequantize(q).reshape(-1)
        assert torch.equal(y[mask], x.reshape(-1)[mask]), name
        assert torch.equal(q.side["outliers"], x.reshape(-1)[mask])
        assert int(q.codes.max()) <= 8 and q.n_levels == 9 and torch.isnan(q.codebook[8])
        total += int(mask.sum())
    assert total >= 50  # the Adam moments of this run do have outliers
    q.side["outliers"] = q.side["outliers"][1:]  # a record whose outliers do not match its codes
    with pytest.raises(CorruptCheckpointError, match="outlier codes"):
        gobo.dequantize(q)


def test_gobo_mse_decreases_with_k(real):
    for name in ("fc2.weight", "fc1.exp_avg"):
        x = real[name]
        errs = [mse(x, gobo.dequantize(gobo.quantize(x, GoboConfig(bins=k)))) for k in (8, 16, 32, 64, 128, 256)]
        assert all(b < a for a, b in zip(errs, errs[1:])), (name, errs)


def _kmedians_reference(v: torch.Tensor, k: int, iters: int):
    """Naive k-medians: (n, k) argmin assignment, median of each cluster, linear init."""
    v = v.to(torch.float32)
    c = torch.linspace(0.0, 1.0, k) * (v.max() - v.min()) + v.min()
    for _ in range(iters):
        a = (v[:, None] - c[None, :]).abs().argmin(dim=1)
        new = c.clone()
        for j in range(k):
            m = torch.sort(v[a == j]).values
            if m.numel():
                new[j] = (m[(m.numel() - 1) // 2] + m[m.numel() // 2]) / 2
        if torch.equal(new, c):
            break
        c = new
    return c


def test_gobo_kmedians_matches_naive_reference_and_soft_stop(real):
    v = real["fc1.weight"].reshape(-1)
    for k in (4, 8):
        c, it, l1 = kmeans_l1_1d(v, k, max_iter=1000, rel_tol=0.0)
        ref = _kmedians_reference(v, k, 1000)
        assert torch.equal(c, ref), k
        assert l1 == pytest.approx(float((v.double()[:, None] - ref.double()[None]).abs().min(1).values.sum()), rel=1e-9)
        # the soft stop ends sooner, at nearly the same L1 error
        c2, it2, l1b = kmeans_l1_1d(v, k, max_iter=1000, rel_tol=1e-3)
        assert it2 <= it and l1b <= l1 * 1.01
    # every inlier sits at its nearest centre
    q = gobo.quantize(v, GoboConfig(bins=16))
    inl = q.codes < 16
    d = (v[inl, None] - q.codebook[None, :16]).abs()
    assert torch.all(d.gather(1, q.codes[inl, None]).squeeze(1) <= d.min(1).values + 1e-7)
    assert gobo.quantize(v, GoboConfig(bins=8, embedding_bins=32), embedding=True).n_levels == 33


# --------------------------------------------------------------------------- all three
@pytest.mark.parametrize("which", list(MODULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_shape_restored_and_deterministic(real, which, dtype):
    mod, cfg = MODULES[which]
    x = real["fc1.weight"].to(dtype)
    q1, q2 = mod.quantize(x, cfg), mod.quantize(x, cfg)
    assert torch.equal(q1.codes, q2.codes) and torch.equal(q1.codebook.nan_to_num(7.0), q2.codebook.nan_to_num(7.0))
    assert q1.side.keys() == q2.side.keys() and all(torch.equal(q1.side[k], q2.side[k]) for k in q1.side)
    assert q1.meta == q2.meta
    y = mod.dequantize(q1)
    assert y.dtype == dtype and y.shape == x.shape and q1.dtype == str(dtype).removeprefix("torch.")
    # the math runs in fp32: same codes as the fp32 copy of the same values, output cast back
    q32 = mod.quantize(x.float(), cfg)
    assert torch.equal(q1.codes, q32.codes)
    assert torch.equal(y, mod.dequantize(q32).to(dtype))
    assert mse(x, y) < 5e-2 * float(x.float().var())  # >= 8 levels: well under 1/8^2 of the variance


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("which", list(MODULES))
def test_cuda_matches_cpu(real, which):
    mod, cfg = MODULES[which]
    x = real["fc2.exp_avg"]
    qc, qg = mod.quantize(x, cfg), mod.quantize(x.cuda(), cfg)
    assert qg.codes.is_cuda and torch.equal(qc.codes, qg.codes.cpu())
    torch.testing.assert_close(mod.dequantize(qg).cpu(), mod.dequantize(qc), rtol=0, atol=1e-7)


@pytest.mark.parametrize("which", list(MODULES))
def test_degenerate_tensors(which):
    mod, cfg = MODULES[which]
    cases = [torch.full((7, 5), 0.375), torch.zeros(4, 16), torch.tensor([2.5]), torch.tensor([-1.0, 3.0]),
             torch.zeros(0), torch.zeros(3, 0)]
    for x in cases:
        q = mod.quantize(x, cfg)
        y = mod.dequantize(q)
        assert y.shape == x.shape and y.dtype == x.dtype
        if x.numel():
            assert int(q.codes.min()) >= 0 and int(q.codes.max()) < q.n_levels
            assert torch.equal(y, x), (which, x)  # <= 2 distinct values fit any grid exactly


def test_validation_errors(real):
    with pytest.raises(ConfigError, match="min_bins"):
        UniformConfig(min_bins=64, max_bins=16)
    with pytest.raises(ConfigError, match="bins"):
        AdaptiveConfig(bins=1)
    with pytest.raises(ConfigError, match="range_ratio"):
        AdaptiveConfig(range_ratio=1.5)
    with pytest.raises(ConfigError, match="init"):
        GoboConfig(init="random")
    with pytest.raises(ConfigError, match="evaluator"):
        greedy_range(real["fc1.weight"], 8, 10, 1, evaluator="fast")
    bad = real["fc1.weight"].clone()
    bad[3, 4] = float("nan")
    for mod, cfg in (MODULES["uniform"], MODULES["adaptive"], MODULES["gobo"]):
        with pytest.raises(NonFiniteError):
            mod.quantize(bad, cfg)
        with pytest.raises(ConfigError, match="float tensors"):
            mod.quantize(torch.arange(10), cfg)


def test_search_spaces_are_the_papers_and_build_configs():
    assert uniform.SEARCH_SPACE == {"min_bins": (8, 16, 32, 64, 128, 256), "max_bins": (8, 16, 32, 64, 128, 256)}
    assert adaptive.SEARCH_SPACE == {"bins": (8, 16, 32, 64, 128, 256), "step_bins": (10, 25, 50, 100),
                                     "range_ratio": (0.1, 0.2, 0.3, 0.4, 0.5)}
    assert gobo.SEARCH_SPACE["bins"] == (8, 16, 32, 64, 128, 256)
    assert gobo.SEARCH_SPACE["embedding_bins"] == (16, 32)
    assert gobo.SEARCH_SPACE["outlier_log_prob"] == (-4.0,) and gobo.SEARCH_SPACE["max_iter"] == (1000,)
    for mod, cls in ((uniform, UniformConfig), (adaptive, AdaptiveConfig), (gobo, GoboConfig)):
        fields = {f.name for f in dataclasses.fields(cls)}
        assert set(mod.SEARCH_SPACE) <= fields
        built = 0
        for combo in itertools.product(*mod.SEARCH_SPACE.values()):
            kw = dict(zip(mod.SEARCH_SPACE, combo))
            if kw.get("min_bins", 0) > kw.get("max_bins", 1 << 20):
                continue
            built += isinstance(cls(**kw), cls)
        assert built > 0
    # n_steps: the range shrinks by range_ratio, exactly (0.3 * 10 is 3 moves, not 4)
    assert [AdaptiveConfig(step_bins=s, range_ratio=r).n_steps for s, r in ((10, 0.3), (25, 0.3), (100, 0.5))] == [3, 8, 50]
