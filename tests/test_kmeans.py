"""approx_kmeans (DynaQuant Algorithm 1) against scikit-learn KMeans and exact references."""
from __future__ import annotations

import pytest
import torch

from ckptzip.errors import ConfigError, NonFiniteError
from ckptzip.kmeans import (approx_kmeans, approx_kmeans_from_sketch, assign, bucket_weights,
                            weighted_kmeans_1d)
from ckptzip.sketch import LogSketch

KINDS = ["weight", "grad", "exp_avg", "exp_avg_sq"]


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny tensors: intra-op threads only add barrier stalls on a busy shared box (10-80x here);
    # conftest restores the thread count after each test
    torch.set_num_threads(1)


def last_snapshot(snapshots, kind: str) -> list[torch.Tensor]:
    s = snapshots[2][-1]
    if kind == "weight":
        return [v.reshape(-1) for v in s.model.values() if v.is_floating_point()]
    if kind == "grad":
        return [g.reshape(-1) for g in s.grads.values()]
    return [st[kind].reshape(-1) for st in s.optimizer["state"].values()]


def sk_kmeans(points, k: int, sample_weight=None):
    """scikit-learn KMeans(n_init=1) centers, sorted; one thread (OpenMP spin-waits badly on a busy box)."""
    sklearn_cluster = pytest.importorskip("sklearn.cluster")
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        km = sklearn_cluster.KMeans(n_clusters=k, n_init=1, random_state=0).fit(
            points.to(torch.float64).numpy().reshape(-1, 1),
            sample_weight=None if sample_weight is None else sample_weight.numpy())
    return torch.sort(torch.tensor(km.cluster_centers_.ravel())).values


def mse(x: torch.Tensor, centers: torch.Tensor) -> float:
    x = x.to(torch.float64)
    c = centers.to(torch.float64)
    return float((x - c[assign(x, c)]).square().mean())


def test_deterministic_for_a_seed(digits_snapshots):
    x = torch.cat(last_snapshot(digits_snapshots, "exp_avg"))
    a = approx_kmeans(x, 16, seed=3)
    b = approx_kmeans(x, 16, seed=3)
    assert torch.equal(a, b)
    g = torch.cat(last_snapshot(digits_snapshots, "grad"))
    assert torch.equal(approx_kmeans(g, 7, seed=0, n_init=1, n_local_trials=1),
                       approx_kmeans(g, 7, seed=0, n_init=1, n_local_trials=1))


def test_sorted_distinct_and_k_levels_for_every_k(digits_snapshots):
    x = torch.cat(last_snapshot(digits_snapshots, "weight"))
    for k in range(2, 34):
        c = approx_kmeans(x, k)
        assert c.dtype == torch.float32 and c.shape == (k,), k
        assert bool((c[1:] > c[:-1]).all()), f"k={k}: centers not strictly ascending"
        # centers are means of bucket representatives: inside the data range up to alpha
        lo, hi = float(x.min()), float(x.max())
        assert lo - 0.01 * abs(lo) <= float(c[0]) and float(c[-1]) <= hi + 0.01 * abs(hi), k
        codes = assign(x, c)
        assert int(codes.min()) >= 0 and int(codes.max()) < k


@pytest.mark.parametrize("kind", KINDS)
def test_sigma1_mse_within_10pct_of_sklearn(digits_snapshots, kind):
    x = torch.cat(last_snapshot(digits_snapshots, kind))
    for k in [4, 8, 16, 32]:
        ref = mse(x, sk_kmeans(x, k))
        ours = mse(x, approx_kmeans(x, k, sigma=1.0))
        assert ours <= 1.10 * ref, f"{kind} k={k}: approx MSE {ours:.4g} > 1.10 x sklearn {ref:.4g}"


@pytest.mark.parametrize("kind", KINDS)
def test_sigma_02_gives_large_values_more_resolution(digits_snapshots, kind):
    # the reason for sigma (paper 4.4): frequency-only k-means starves the rare large values
    x = torch.cat(last_snapshot(digits_snapshots, kind)).to(torch.float64)
    top = x.abs() >= torch.quantile(x.abs(), 0.99)
    for k in [8, 16]:
        c1 = approx_kmeans(x, k, sigma=1.0).double()
        c2 = approx_kmeans(x, k, sigma=0.2).double()
        e1 = (x - c1[assign(x, c1)]).square()
        e2 = (x - c2[assign(x, c2)]).square()
        assert float(e2[top].mean()) < 0.7 * float(e1[top].mean()), f"{kind} k={k}"


def test_weighted_kmeans_1d_is_a_lloyd_fixed_point_and_matches_sklearn():
    g = torch.Generator().manual_seed(0)
    pts = torch.randn(3000, generator=g, dtype=torch.float64) * torch.rand(3000, generator=g, dtype=torch.float64)
    w = torch.rand(3000, generator=g, dtype=torch.float64) ** 3
    for k in [3, 6, 12]:
        c = weighted_kmeans_1d(pts, w, k, seed=1, tol=0.0, max_iter=1000)
        a = assign(pts, c)
        means = torch.zeros(k, dtype=torch.float64).index_add_(0, a, w * pts) / \
            torch.zeros(k, dtype=torch.float64).index_add_(0, a, w)
        torch.testing.assert_close(means, c, rtol=1e-9, atol=1e-12)
        ours = float((w * (pts - c[a]).square()).sum())
        cs = sk_kmeans(pts, k, sample_weight=w)
        ref = float((w * (pts - cs[assign(pts, cs)]).square()).sum())
        assert ours <= 1.10 * ref, (k, ours, ref)


def test_bucket_weights_follow_algorithm_1():
    centers = torch.tensor([-2.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    counts = torch.tensor([1, 5, 3, 1])
    w = bucket_weights(centers, counts, 0.2)
    expect = 0.2 * counts / 10 + 0.8 * centers.abs() / 6
    torch.testing.assert_close(w, expect)
    torch.testing.assert_close(bucket_weights(centers, counts, 1.0), counts / 10, check_dtype=False)


def test_merged_sketch_gives_same_centers_as_concatenation(digits_snapshots):
    parts = last_snapshot(digits_snapshots, "weight")
    s = LogSketch(0.01)
    for p in parts:
        s.merge(LogSketch(0.01).add(p))
    for sigma in [0.2, 1.0]:
        assert torch.equal(approx_kmeans_from_sketch(s, 12, sigma=sigma, seed=5),
                           approx_kmeans(torch.cat(parts), 12, sigma=sigma, seed=5))


def test_degenerate_inputs():
    # all equal: one level, the bucket representative (within alpha of the value)
    c = approx_kmeans(torch.full((1000,), 0.37), 8)
    assert c.shape == (1,) and abs(float(c[0]) - 0.37) <= 0.01 * 0.37
    # all zeros
    assert approx_kmeans(torch.zeros(500), 4).tolist() == [0.0]
    # fewer distinct values than k: one level per value, and assign maps each value to its own
    vals = torch.tensor([-1.5, 0.0, 0.25, 2.0, 9.0])
    x = vals.repeat_interleave(torch.tensor([3, 50, 7, 7, 1]))
    c = approx_kmeans(x, 16, sigma=0.2)
    assert c.shape == (5,)
    assert bool(((c.double() - vals.double()).abs() <= 0.01 * vals.double().abs() + 1e-12).all())
    assert torch.equal(assign(vals, c), torch.arange(5))
    # exactly k distinct values
    assert approx_kmeans(x, 5).shape == (5,)
    # empty input
    assert approx_kmeans(torch.zeros(0), 4).numel() == 0
    # k = 1: the weighted mean
    x = torch.tensor([1.0, 2.0, 3.0, 10.0])
    c = approx_kmeans(x, 1, sigma=1.0)
    assert abs(float(c[0]) - 4.0) < 0.05
    # sigma = 0 with a zero bucket (zero weight) still returns k distinct levels
    x = torch.cat([torch.zeros(100), torch.linspace(0.1, 1.0, 50)])
    c = approx_kmeans(x, 6, sigma=0.0)
    assert c.shape == (6,) and bool((c[1:] > c[:-1]).all())


def test_assign_is_nearest_center():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20_000, generator=g)
    c = torch.sort(torch.randn(9, generator=g)).values
    brute = (x[:, None] - c[None, :]).abs().argmin(1)
    codes = assign(x, c)
    d_codes = (x - c[codes]).abs()
    d_brute = (x - c[brute]).abs()
    assert torch.equal(d_codes, d_brute)  # identical distances (ties may pick either index)
    assert codes.dtype == torch.int64 and codes.shape == x.shape
    assert torch.equal(assign(x.reshape(100, 200), c), codes.reshape(100, 200))
    assert torch.equal(assign(x.to(torch.bfloat16), c), assign(x.to(torch.bfloat16).float(), c))


def test_low_precision_inputs(digits_snapshots):
    x = torch.cat(last_snapshot(digits_snapshots, "exp_avg"))
    for dt in [torch.float16, torch.bfloat16]:
        c = approx_kmeans(x.to(dt), 16)
        assert c.dtype == torch.float32 and c.shape == (16,)
        assert torch.equal(c, approx_kmeans(x.to(dt).float(), 16))


def test_validation():
    x = torch.randn(100)
    for bad in [0, -3, 2.5, True]:
        with pytest.raises(ConfigError):
            approx_kmeans(x, bad)
    with pytest.raises(ConfigError, match="sigma"):
        approx_kmeans(x, 4, sigma=1.5)
    with pytest.raises(ConfigError):
        approx_kmeans(x, 4, max_iter=0)
    with pytest.raises(ConfigError):
        approx_kmeans(x, 4, n_init=0)
    with pytest.raises(NonFiniteError, match="w1"):
        approx_kmeans(torch.tensor([1.0, float("nan")]), 2, name="w1")
    with pytest.raises(ConfigError, match="sorted"):
        assign(x, torch.tensor([1.0, 0.0]))
    with pytest.raises(NonFiniteError):
        assign(torch.tensor([float("inf")]), torch.tensor([0.0, 1.0]))
    with pytest.raises(ConfigError):
        weighted_kmeans_1d(torch.ones(3), -torch.ones(3), 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu(digits_snapshots):
    x = torch.cat(last_snapshot(digits_snapshots, "exp_avg_sq"))
    c_cpu = approx_kmeans(x, 16)
    c_gpu = approx_kmeans(x.cuda(), 16)
    assert c_gpu.device.type == "cuda"
    assert torch.equal(c_gpu.cpu(), c_cpu)
    assert torch.equal(assign(x.cuda(), c_gpu).cpu(), assign(x, c_cpu))


# ----------------------------------------------------------------------------- batched, deterministic
def _histograms(snapshots, kind, sigma, min_numel=1):
    rows = []
    for x in last_snapshot(snapshots, kind):
        if x.numel() < min_numel:
            continue
        c, n = LogSketch(0.01).add(x).histogram()
        rows.append((c, n))
    return rows


@pytest.mark.parametrize("kind", KINDS)
def test_kmeans_rows_numba_equals_torch_and_rows_are_independent(digits_snapshots, kind):
    from ckptzip.kmeans import kmeans_packed, kmeans_rows

    # with rows of two and three points, and one without counts (weights by magnitude, or none at sigma 1)
    rows = _histograms(digits_snapshots, kind, 0.2) + [
        (torch.tensor([-1.0, 2.0], dtype=torch.float64), torch.tensor([3, 1])),
        (torch.tensor([0.0, 0.5, 4.0], dtype=torch.float64), torch.tensor([0, 0, 0]))]
    for k, sigma in ((1, 0.2), (2, 1.0), (4, 0.2), (16, 0.2), (16, 1.0), (33, 0.2)):
        fast = kmeans_rows([c for c, _ in rows], [n for _, n in rows], k, sigma=sigma)
        ref = kmeans_rows([c for c, _ in rows], [n for _, n in rows], k, sigma=sigma, backend="torch")
        assert all(torch.equal(a, b) for a, b in zip(fast, ref)), k
        alone = [kmeans_rows([c], [n], k, sigma=sigma)[0] for c, n in rows]
        assert all(torch.equal(a, b) for a, b in zip(fast, alone)), k
        sizes = torch.tensor([c.numel() for c, _ in rows])
        for backend in ("numba", "torch"):  # the packed rows (a save's histograms) as the rows apart
            packed = kmeans_packed(torch.cat([c for c, _ in rows]), torch.cat([n for _, n in rows]), sizes, k,
                                   sigma=sigma, backend=backend)
            assert all(torch.equal(a, b) for a, b in zip(fast, packed)) and len(packed) == len(rows), k
        for (c, _), out in zip(rows, fast):
            assert out.numel() == min(k, c.numel()) and bool((out[1:] > out[:-1]).all())


@pytest.mark.parametrize("kind", KINDS)
def test_kmeans_rows_is_as_good_as_kmeanspp(digits_snapshots, kind):
    """The deterministic density seeding (the quantizer's default) against Algorithm 3 best of 3, on
    the tensors DynaQuant quantizes (>= 1024 values; below, a histogram of a few dozen points can
    trap it: 1.5-8x on 10-128-value tensors)."""
    from ckptzip.kmeans import _nearest, kmeans_rows

    for sigma in (0.2, 1.0):
        ratios = []
        for c, n in _histograms(digits_snapshots, kind, sigma, min_numel=1024):
            if c.numel() <= 16:
                continue
            w = bucket_weights(c, n, sigma)
            cost = lambda ctr: float((w * (c - ctr[_nearest(c, ctr)]).square()).sum())  # noqa: E731
            ratios.append(cost(kmeans_rows([c], [n], 16, sigma=sigma)[0]) / cost(weighted_kmeans_1d(c, w, 16)))
        r = torch.tensor(ratios)
        assert float(r.mean()) <= 1.03 and float(r.max()) <= 1.15, (sigma, r)
