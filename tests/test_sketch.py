"""LogSketch against exact quantiles (torch.sort) and the reference `ddsketch` package."""
from __future__ import annotations

import json
import math

import pytest
import torch

from ckptzip.errors import ConfigError, NonFiniteError
from ckptzip.sketch import LogSketch

QS = torch.cat([torch.linspace(0, 1, 401, dtype=torch.float64),
                torch.tensor([1e-4, 1e-3, 0.999, 0.9995, 0.9999], dtype=torch.float64)])
SLACK = 1 + 1e-9  # float64 rounding at bucket boundaries


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny tensors: intra-op threads only add barrier stalls on a busy shared box (10-80x here);
    # conftest restores the thread count after each test
    torch.set_num_threads(1)


def exact_lower(x: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Element of rank floor(q * (n - 1)) (numpy method="lower"), as float64."""
    s = torch.sort(x.reshape(-1).to(torch.float64)).values
    return s[torch.floor(qs * (s.numel() - 1)).long()]


def assert_within_alpha(est: torch.Tensor, exact: torch.Tensor, alpha: float, min_value: float = 1e-30):
    err = (est - exact).abs()
    bound = alpha * exact.abs() * SLACK + min_value
    bad = err > bound
    assert not bool(bad.any()), (
        f"{int(bad.sum())} quantiles off by more than alpha; worst rel err "
        f"{float((err / exact.abs().clamp_min(1e-300)).max()):.3g} > {alpha}")


def real_tensors(snapshots, kind: str) -> list[torch.Tensor]:
    snaps = snapshots[2]
    if kind == "weight":
        return [v.reshape(-1) for s in snaps for v in s.model.values() if v.is_floating_point()]
    if kind == "grad":
        return [g.reshape(-1) for s in snaps for g in s.grads.values()]
    return [st[kind].reshape(-1) for s in snaps for st in s.optimizer["state"].values()]


def heavy_tailed(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Student-t (2 dof: normal / sqrt(chi2_2 / 2)) mixed with log-normal magnitudes spanning
    # ~20 decades, random signs, 2% exact zeros
    t = torch.randn(n, generator=g) / torch.sqrt(torch.empty(n).exponential_(1.0, generator=g))
    mag = torch.exp(torch.randn(n, generator=g) * 10.0)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = torch.where(torch.rand(n, generator=g) < 0.5, t, sign * mag)
    x[torch.rand(n, generator=g) < 0.02] = 0.0
    return x.to(torch.float32)


@pytest.mark.parametrize("kind", ["weight", "grad", "exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("alpha", [0.01, 0.05])
def test_quantiles_within_alpha_on_real_checkpoints(digits_snapshots, kind, alpha):
    parts = real_tensors(digits_snapshots, kind)
    x = torch.cat(parts)
    s = LogSketch(alpha)
    for i, p in enumerate(parts):
        s.add(p, name=f"{kind}[{i}]")
    assert s.count == x.numel()
    assert_within_alpha(s.quantile(QS), exact_lower(x, QS), alpha)
    # also on magnitudes, which is what pruning/protection thresholds read
    sa = LogSketch(alpha).add(x.abs())
    assert_within_alpha(sa.quantile(QS), exact_lower(x.abs(), QS), alpha)
    # the paper's observation: a few thousand buckets at most for a whole model
    assert s.num_buckets < 4000


@pytest.mark.parametrize("alpha,n", [(0.001, 200_000), (0.01, 2_500_000), (0.1, 200_000)])
def test_quantiles_within_alpha_on_heavy_tailed_data(alpha, n):
    x = heavy_tailed(n)  # 2.5M spans many internal chunks
    s = LogSketch(alpha).add(x)
    assert_within_alpha(s.quantile(QS), exact_lower(x, QS), alpha)


def test_agrees_with_ddsketch_package(digits_snapshots):
    ddsketch = pytest.importorskip("ddsketch")
    alpha = 0.01
    qs = torch.linspace(0, 1, 201, dtype=torch.float64)
    for kind in ["weight", "grad", "exp_avg", "exp_avg_sq"]:
        x = real_tensors(digits_snapshots, kind)[-4:]  # last snapshot's tensors
        x = torch.cat(x)
        ref = ddsketch.DDSketch(relative_accuracy=alpha)
        for v in x.tolist():
            ref.add(v)
        theirs = torch.tensor([ref.get_quantile_value(float(q)) for q in qs], dtype=torch.float64)
        ours = LogSketch(alpha).add(x).quantile(qs)
        exact = exact_lower(x, qs)
        assert_within_alpha(ours, exact, alpha)
        assert_within_alpha(theirs, exact, alpha)
        # same mapping (gamma, ceil(log_gamma), 2 gamma^i / (gamma + 1)) and rank rule: same answers
        agree = ((ours - theirs).abs() <= 1e-9 * theirs.abs()).double().mean()
        assert float(agree) == 1.0, f"{kind}: agreement with ddsketch {float(agree):.3f}"


def test_vectorized_quantile_equals_scalar_calls():
    s = LogSketch(0.02).add(heavy_tailed(10_000, seed=3))
    qs = [0.0, 0.01, 0.25, 0.5, 0.75, 0.999, 1.0]
    vec = s.quantile(qs)
    assert vec.dtype == torch.float64 and vec.shape == (7,)
    assert vec.tolist() == [s.quantile(q) for q in qs]
    assert isinstance(s.quantile(0.5), float)
    assert s.quantile(torch.tensor([[0.1, 0.9]])).shape == (1, 2)


def test_merge_equals_sketch_of_concatenation(digits_snapshots):
    parts = real_tensors(digits_snapshots, "weight") + [heavy_tailed(1_300_000, seed=1)]
    whole = LogSketch().add(torch.cat(parts))
    per_part = [LogSketch().add(p) for p in parts]
    merged = LogSketch()
    for p in reversed(per_part):  # order must not matter
        merged.merge(p)
    assert merged == whole
    assert merged.count == whole.count == sum(p.numel() for p in parts)
    # across "ranks": through JSON, the way an all-gather would carry it
    a = LogSketch().add(torch.cat(parts[: len(parts) // 2]))
    b = LogSketch().add(torch.cat(parts[len(parts) // 2:]))
    wire = json.loads(json.dumps(b.to_dict()))
    assert LogSketch.from_dict(a.to_dict()).merge(LogSketch.from_dict(wire)) == whole
    assert torch.equal(merged.quantile(QS), whole.quantile(QS))


def test_merge_requires_same_alpha():
    with pytest.raises(ConfigError, match="alpha"):
        LogSketch(0.01).merge(LogSketch(0.02))
    with pytest.raises(ConfigError):
        LogSketch(0.01).merge(LogSketch(0.01, min_value=1e-20))


def test_nonfinite_raises_naming_tensor_and_count():
    x = torch.randn(5000)
    x[7], x[100], x[4000] = float("nan"), float("inf"), -float("inf")
    with pytest.raises(NonFiniteError, match=r"layer1\.weight holds 3 non-finite"):
        LogSketch().add(x, name="layer1.weight")
    with pytest.raises(NonFiniteError):
        LogSketch().add(torch.tensor([float("nan")], dtype=torch.bfloat16))
    s = LogSketch().add(torch.ones(3))
    with pytest.raises(NonFiniteError):
        s.add(torch.tensor([1.0, float("inf")]))
    assert s.count == 3  # a failed add leaves the sketch unchanged


def test_negative_zero_and_tiny_values():
    x = torch.tensor([-5.0, -5.0, -1e-3, -0.0, 0.0, 0.0, 1e-35, -1e-33, 2e-3, 7.0], dtype=torch.float32)
    s = LogSketch(0.01).add(x)
    centers, counts = s.histogram()
    assert counts.sum() == x.numel() == s.count
    assert bool((centers[1:] > centers[:-1]).all())
    assert centers[0] < 0 and centers[-1] > 0 and bool((centers == 0).any())
    assert s.zero_count == 5  # -0.0, 0.0, 0.0 and the two |x| < min_value
    assert int(counts[centers == 0]) == 5
    assert s.quantile(0.0) == pytest.approx(-5.0, rel=0.01)
    assert s.quantile(0.5) == 0.0  # rank 4 of 10 is inside the zero bucket
    assert s.quantile(1.0) == pytest.approx(7.0, rel=0.01)
    assert_within_alpha(s.quantile(QS), exact_lower(x, QS), 0.01)
    # all negative
    neg = -heavy_tailed(50_000, seed=5).abs()
    assert_within_alpha(LogSketch(0.01).add(neg).quantile(QS), exact_lower(neg, QS), 0.01)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_inputs(digits_snapshots, dtype):
    x = torch.cat(real_tensors(digits_snapshots, "exp_avg")[-4:]).to(dtype)
    s = LogSketch(0.01).add(x)
    assert s == LogSketch(0.01).add(x.to(torch.float64))
    assert_within_alpha(s.quantile(QS), exact_lower(x, QS), 0.01)


def test_bucket_index_rounds_to_representative():
    x = heavy_tailed(20_000, seed=7)
    s = LogSketch(0.01).add(x)
    centers, _ = s.histogram()
    rep = centers[s.bucket_index(x)]
    big = x.abs() > 1e-30
    assert bool(((rep[big] - x[big].double()).abs() <= 0.01 * x[big].double().abs() * SLACK).all())
    assert bool((rep[~big] == 0).all())
    with pytest.raises(ConfigError, match="never saw"):
        s.bucket_index(torch.tensor([1e30]))


@pytest.mark.parametrize("alpha,min_value", [(0.01, 1e-30), (0.001, 1e-30), (0.05, 1e-8)])
def test_representatives_are_the_formulas_bits(alpha, min_value):
    # ordinal_values reads a table built once; each value must be the formula's, bit for bit, in
    # any order and size of request, past the table's end and past its limit (computed directly)
    s = LogSketch(alpha, min_value=min_value)
    gamma = (1 + alpha) / (1 - alpha)
    ords = torch.cat([torch.arange(-9000, 9000), torch.tensor([0, 70_000, -123_456, 3, -3])])
    key = ords.abs().double() + s._zero_key
    want = torch.copysign(torch.exp(key * math.log1p(2 * alpha / (1 - alpha))) * (2 / (1 + gamma)), ords.double())
    want[ords == 0] = 0.0
    for got in (s.ordinal_values(ords), torch.cat([s.ordinal_values(o) for o in ords.split(777)]),
                LogSketch(alpha, min_value=min_value).ordinal_values(ords.flip(0)).flip(0)):
        assert torch.equal(got.view(torch.int64), want.view(torch.int64))
    assert s.ordinal_values(torch.zeros(0, dtype=torch.int64)).numel() == 0


def test_empty_sketch_and_validation():
    s = LogSketch()
    assert s.count == 0 and s.num_buckets == 0
    assert math.isnan(s.quantile(0.5))
    assert s.add(torch.zeros(0)).count == 0
    for bad in [0.0, 1.0, -0.1, float("nan")]:
        with pytest.raises(ConfigError):
            LogSketch(bad)
    with pytest.raises(ConfigError):
        LogSketch().add(torch.ones(3)).quantile(1.5)
    with pytest.raises(ConfigError):
        LogSketch().add(torch.arange(3))
    with pytest.raises(ConfigError):
        LogSketch.from_dict({"format": "something-else"})
    d = LogSketch().add(torch.tensor([1.0, -2.0, 0.0])).to_dict()
    d["positive"]["counts"] = [0]
    with pytest.raises(ConfigError):
        LogSketch.from_dict(d)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu(digits_snapshots):
    x = torch.cat([torch.cat(real_tensors(digits_snapshots, "exp_avg_sq")), heavy_tailed(100_000)])
    cpu = LogSketch().add(x)
    gpu = LogSketch().add(x.cuda())
    assert gpu.device.type == "cuda"
    assert gpu == cpu
    assert torch.equal(gpu.quantile(QS).cpu(), cpu.quantile(QS))


# ----------------------------------------------------------------------------- fast kernels vs reference
def _boundary_values(alpha: float) -> torch.Tensor:
    """float32 values on, just below and just above every bucket boundary (both signs), plus zeros,
    tiny values below min_value and the float32 extremes."""
    from ckptzip.logbuckets import boundary_table

    b = boundary_table(alpha).float()
    b = b[torch.isfinite(b)]
    x = torch.cat([b, torch.nextafter(b, torch.zeros_like(b)), torch.nextafter(b, torch.full_like(b, math.inf)),
                   torch.tensor([0.0, -0.0, 1e-45, 1e-38, 3.4e38, 1.0, 0.5])])
    x = x[torch.isfinite(x)]
    return torch.cat([x, -x])


@pytest.mark.parametrize("alpha", [0.01, 0.05, 0.001])
def test_kernel_ordinals_equal_the_reference(alpha):
    from ckptzip.logbuckets import ordinals, ordinals_reference

    x = torch.cat([_boundary_values(alpha), heavy_tailed(50_000, seed=3)])
    assert torch.equal(ordinals(x, alpha), ordinals_reference(x, alpha))
    b = x.to(torch.bfloat16)
    b = b[torch.isfinite(b)]  # float32 values above bfloat16's range round to inf
    assert torch.equal(ordinals(b, alpha), ordinals_reference(b, alpha))


def test_segment_histograms_equal_per_segment_sketches(digits_snapshots):
    from ckptzip.logbuckets import segment_histograms

    parts = real_tensors(digits_snapshots, "exp_avg")[:6] + [torch.zeros(0), heavy_tailed(3000, seed=1)]
    flat = torch.cat(parts)
    offsets = torch.tensor([0] + [p.numel() for p in parts]).cumsum(0)
    fast = segment_histograms(flat, offsets, kinds=("signed", "abs"))
    ref = segment_histograms(flat.double(), offsets, kinds=("signed", "abs"))  # float64: the torch reference
    for f, r in zip(fast, ref):
        assert all(torch.equal(a, b) for a, b in zip(f, r))
    (ords, counts, ptr), absolute = fast
    for i, p in enumerate(parts):
        s = LogSketch(0.01).add(p) if p.numel() else LogSketch(0.01)
        a = LogSketch(0.01).add(p.abs()) if p.numel() else LogSketch(0.01)
        sl = slice(int(ptr[i]), int(ptr[i + 1]))
        assert torch.equal(ords[sl], s._ord) and torch.equal(counts[sl], s._counts)
        assl = slice(int(absolute[2][i]), int(absolute[2][i + 1]))
        assert torch.equal(absolute[0][assl], a._ord) and torch.equal(absolute[1][assl], a._counts)
    bad = flat.clone()
    bad[int(offsets[2]) + 3] = float("nan")
    with pytest.raises(NonFiniteError, match="w2"):
        segment_histograms(bad, offsets, names=[f"w{i}" for i in range(len(parts))])
    bad = flat.clone()
    bad[-1500] = -float("inf")  # in the last segment's second block of values
    with pytest.raises(NonFiniteError, match="w7"):
        segment_histograms(bad, offsets, names=[f"w{i}" for i in range(len(parts))])
