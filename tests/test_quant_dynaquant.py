import math
from dataclasses import replace

import pytest
import torch

from ckptzip.errors import ConfigError, NonFiniteError
from ckptzip.quant.dynaquant import (DynaQuantConfig, adam_denominator, adam_direction_error, config_for_role,
                                     denormalize_exp_avg, dequantize, fit_layer_thresholds, is_quantizable,
                                     normalize_exp_avg, quantize)

W = ("fc1.weight", "fc2.weight", "fc3.weight")


def _exact_lower_quantile(x: torch.Tensor, q: float) -> float:
    s = torch.sort(x.reshape(-1).double()).values
    return float(s[int(math.floor(q * (s.numel() - 1)))])


def _parts(q):
    codes = q.codes
    return codes == 0, (codes > 0) & (codes < q.n_levels - 1), codes == q.n_levels - 1


@pytest.fixture(scope="module")
def ckpt(request):
    _, _, snaps, _ = request.getfixturevalue("digits_snapshots")  # built single-threaded by conftest
    return snaps[-1]


def test_partition_fractions_per_layer_type(ckpt):
    # fc1/fc2 share "linear"; fc3 alone in "other": each type gets its own thresholds
    lts = {"fc1.weight": "linear", "fc2.weight": "linear", "fc3.weight": "other"}
    cfg = DynaQuantConfig(prune_fraction=0.2, protect_fraction=0.02)
    plan = fit_layer_thresholds({n: (ckpt.model[n], lts[n]) for n in W}, cfg, grads=ckpt.grads)
    assert set(plan.layer_types) == {"linear", "other"}
    for lt in ("linear", "other"):
        names = [n for n in W if lts[n] == lt]
        x = torch.cat([ckpt.model[n].reshape(-1) for n in names])
        s = torch.cat([(ckpt.model[n] * ckpt.grads[n]).abs().reshape(-1) for n in names])
        ltp = plan.layer_types[lt]
        assert not ltp.sensitivity_fallback
        # thresholds are sketch quantiles of the MERGED type: within alpha of the exact ones
        for got, exact in ((ltp.protect_magnitude, _exact_lower_quantile(x.abs(), 1 - 0.01)),
                           (ltp.protect_sensitivity, _exact_lower_quantile(s, 1 - 0.01)),
                           (ltp.prune_threshold, _exact_lower_quantile(x.abs(), 0.2))):
            assert abs(got - exact) <= cfg.alpha * exact * 1.0001
        qs = [quantize(ckpt.model[n], n, plan) for n in names]
        pruned = torch.cat([_parts(q)[0] for q in qs])
        prot = torch.cat([_parts(q)[2] for q in qs])
        n = x.numel()
        assert abs(float(pruned.sum()) / n - 0.2) < 0.01
        by_mag = float((x.abs() > ltp.protect_magnitude).sum()) / n
        by_sens = float((s > ltp.protect_sensitivity).sum()) / n
        assert abs(by_mag - 0.01) < 0.003 and abs(by_sens - 0.01) < 0.003
        # protected = union of the two sets exactly, so between max and sum of the halves
        union = (x.abs() > ltp.protect_magnitude) | (s > ltp.protect_sensitivity)
        assert torch.equal(prot, union)
        assert max(by_mag, by_sens) <= float(prot.sum()) / n <= by_mag + by_sens
        assert sum(q.meta["n_protected"] for q in qs) == int(prot.sum())
    # per layer type, not per tensor: the linear tensors keep different shares under one threshold
    q1, q2 = (quantize(ckpt.model[n], n, plan) for n in W[:2])
    assert abs(q1.meta["n_protected"] / q1.numel - q2.meta["n_protected"] / q2.numel) > 0.002


def test_roundtrip_error_bounded_and_protected_exact(ckpt):
    errs = {}
    for bins in (8, 32):
        cfg = DynaQuantConfig(bins=bins, prune_fraction=0.1)
        plan = fit_layer_thresholds({n: (ckpt.model[n], "linear") for n in W}, cfg, grads=ckpt.grads)
        tot = 0.0
        for n in W:
            x = ckpt.model[n]
            q = quantize(x, n, plan)
            y = dequantize(q)
            assert y.shape == x.shape and y.dtype == x.dtype
            pr, qu, pt = _parts(q)
            xf, yf = x.reshape(-1), y.reshape(-1)
            centers = q.codebook[1:-1]
            assert q.n_levels == centers.numel() + 2 <= bins + 2
            assert bool((centers[1:] > centers[:-1]).all()) and q.codebook[0] == 0 and math.isnan(q.codebook[-1])
            # quantized values go to their nearest center
            near = (xf[qu, None] - centers[None, :]).abs().min(1).values
            torch.testing.assert_close((yf[qu] - xf[qu]).abs(), near, rtol=0, atol=1e-7)
            # pruned are zero and were below the pruning threshold; protected are x in bf16
            tau_p = plan.layer_types["linear"].prune_threshold
            assert bool((yf[pr] == 0).all()) and bool((xf[pr].abs() <= tau_p).all())
            assert torch.equal(yf[pt], xf[pt].to(torch.bfloat16).float())
            assert q.side["protected"].dtype == torch.bfloat16
            tot += float(((yf - xf)[qu] ** 2).sum()) / float((xf[qu] ** 2).sum())
        errs[bins] = math.sqrt(tot / len(W))
    assert errs[8] < 0.15 and errs[32] < 0.04 and errs[32] < errs[8] / 2


def test_embedding_bins_and_no_pruning(ckpt):
    x = ckpt.model["fc1.weight"].clone()
    x[:, :3] = 0.0  # exact zeros still go to level 0 (lossless)
    cfg = DynaQuantConfig(bins=8, embedding_bins=24, prune_fraction=0.4)
    plan = fit_layer_thresholds({"emb": (x, "embedding"), "lin": (ckpt.model["fc2.weight"], "linear")}, cfg)
    assert plan.layer_types["embedding"].prune_threshold is None
    q = quantize(x, "emb", plan)
    assert q.n_levels == 24 + 2
    assert q.meta["n_pruned"] == int((x == 0).sum())
    y = dequantize(q)
    assert bool((y[:, :3] == 0).all()) and int((y == 0).sum()) == int((x == 0).sum())
    ql = quantize(ckpt.model["fc2.weight"], "lin", plan)
    assert ql.n_levels == 8 + 2 and abs(ql.meta["n_pruned"] / ql.numel - 0.4) < 0.02


def test_sensitivity_fallback_flag(ckpt):
    cfg = DynaQuantConfig(prune_metric="sensitivity", protect_fraction=0.02)
    ts = {n: (ckpt.model[n], "linear") for n in W}
    plan = fit_layer_thresholds(ts, cfg)  # no gradients
    x = torch.cat([ckpt.model[n].reshape(-1) for n in W])
    qs = [quantize(ckpt.model[n], n, plan) for n in W]
    assert all(q.meta["sensitivity_fallback"] is True for q in qs)
    assert plan.layer_types["linear"].protect_sensitivity is None
    # fallback protects the top F by magnitude and prunes by magnitude
    frac = sum(q.meta["n_protected"] for q in qs) / x.numel()
    assert abs(frac - 0.02) < 0.004
    assert abs(sum(q.meta["n_pruned"] for q in qs) / x.numel() - 0.1) < 0.01
    # a gradient missing for one tensor of the type also falls back
    partial = {n: ckpt.grads[n] for n in W[:2]}
    assert fit_layer_thresholds(ts, cfg, grads=partial).layer_types["linear"].sensitivity_fallback
    plan_g = fit_layer_thresholds(ts, cfg, grads=ckpt.grads)
    assert quantize(ckpt.model["fc1.weight"], "fc1.weight", plan_g).meta["sensitivity_fallback"] is False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(ckpt, dtype):
    x = ckpt.model["fc2.weight"].to(dtype)
    plan = fit_layer_thresholds({"w": (x, "linear")}, DynaQuantConfig(bins=16), grads={"w": ckpt.grads["fc2.weight"]})
    q = quantize(x, "w", plan)
    assert q.dtype == str(dtype).removeprefix("torch.") and q.codes.dtype == torch.int64
    assert int(q.codes.min()) >= 0 and int(q.codes.max()) < q.n_levels
    y = dequantize(q)
    assert y.dtype == dtype and y.shape == x.shape
    pt = _parts(q)[2].reshape(x.shape)
    assert torch.equal(y[pt].float(), x[pt].float().to(torch.bfloat16).float())
    rel = float((y.float() - x.float()).norm() / x.float().norm())
    assert rel < 0.1


def test_codes_in_range_and_layer_type_codebook(ckpt):
    cfg = DynaQuantConfig(bins=6, center_scope="layer_type")
    plan = fit_layer_thresholds({n: (ckpt.model[n], "linear") for n in W}, cfg, grads=ckpt.grads)
    qs = [quantize(ckpt.model[n], n, plan) for n in W]
    for q in qs:
        assert q.n_levels == 8 and int(q.codes.min()) >= 0 and int(q.codes.max()) < q.n_levels
        assert torch.equal(q.codebook[1:-1], qs[0].codebook[1:-1])  # one codebook per layer type


def test_moment_domains(ckpt):
    st = ckpt.optimizer["state"]
    v = st[4]["exp_avg_sq"]  # fc2.weight's second moment, >= 0, spans orders of magnitude
    m = st[4]["exp_avg"]
    p99, dir_err = {}, {}
    for dom in ("identity", "sqrt", "log"):
        cfg = replace(config_for_role(DynaQuantConfig(bins=16), "exp_avg_sq"), domain=dom)
        assert cfg.prune_fraction == 0.0 and cfg.sigma == 1.0
        plan = fit_layer_thresholds({"v": (v, "linear", "exp_avg_sq")}, cfg)
        y = dequantize(quantize(v, "v", plan))
        assert bool((y >= 0).all()) and bool((y[v == 0] == 0).all())
        nz = v > 0
        p99[dom] = float(((y[nz] - v[nz]).abs() / v[nz]).quantile(0.99))
        dir_err[dom] = adam_direction_error(m, v, m, y, st[4]["step"])
    # log keeps every order of magnitude: the relative-error tail collapses, and so does the
    # error v alone causes in Adam's direction
    assert p99["log"] < 0.7 < 1.0 < p99["sqrt"] < 5.0 < p99["identity"]
    assert dir_err["log"] < 0.1 < dir_err["sqrt"] < dir_err["identity"]
    assert config_for_role(DynaQuantConfig(), "exp_avg_sq").domain == "log"
    with pytest.raises(ConfigError, match="non-negative"):
        fit_layer_thresholds({"m": (m, "linear", "exp_avg")}, DynaQuantConfig(domain="log"))
    # signed sqrt: codebook ordered by value, each value at the nearest center in sqrt space
    plan = fit_layer_thresholds({"m": (m, "linear", "exp_avg")}, DynaQuantConfig(domain="sqrt", prune_fraction=0))
    q = quantize(m, "m", plan)
    assert bool((q.codebook[2:-1] > q.codebook[1:-2]).all())
    f = lambda t: t.sign() * t.abs().sqrt()  # noqa: E731
    qu = _parts(q)[1]
    fx, fy, fc = f(m.reshape(-1)[qu].double()), f(dequantize(q).reshape(-1)[qu].double()), f(q.codebook[1:-1].double())
    torch.testing.assert_close((fy - fx).abs(), (fx[:, None] - fc[None]).abs().min(1).values, rtol=0, atol=1e-6)


def test_adam_direction_error_and_normalized_moment(ckpt):
    st = ckpt.optimizer["state"][4]  # fc2.weight
    m, v, step = st["exp_avg"], st["exp_avg_sq"], st["step"]
    assert adam_direction_error(m, v, m, v, step) == 0.0
    torch.testing.assert_close(adam_denominator(v, step), (v / (1 - 0.999 ** 200)).sqrt() + 1e-8)
    # 4x larger v halves every direction (eps aside)
    nz = v > 0  # eps=0 below: leave out the exact zeros (0/0)
    assert abs(adam_direction_error(m[nz], v[nz], m[nz], 4 * v[nz], step, eps=0.0) - 0.5) < 1e-6
    # lists/dicts of tensors are concatenated
    assert adam_direction_error([m, m], [v, v], [m, m], [v, 4 * v], step) > 0.1
    # the normalized moment makes the restored direction u_q / (1 - beta1^t) whatever v_q is
    v_q = v * 1.5
    u = normalize_exp_avg(m, v, step)
    torch.testing.assert_close(denormalize_exp_avg(u, v, step), m, rtol=1e-5, atol=1e-12)
    m_back = denormalize_exp_avg(u, v_q, step)
    assert adam_direction_error(m, v, m_back, v_q, step) < 1e-5
    assert adam_direction_error(m, v, m, v_q, step) > 0.1  # while keeping m as is does not
    with pytest.raises(ValueError):
        adam_direction_error(m, v, m[:3], v, step)


def test_validation_and_rules(ckpt):
    for bad in (dict(bins=0), dict(prune_fraction=1.0), dict(protect_fraction=-0.1), dict(prune_metric="hessian"),
                dict(alpha=0.0), dict(sigma=2.0), dict(min_numel=0), dict(domain="exp"),
                dict(center_scope="global"), dict(prune_fraction=0.6, protect_fraction=0.5)):
        with pytest.raises(ConfigError):
            DynaQuantConfig(**bad)
    assert is_quantizable("linear", "weight", 4096) and is_quantizable("embedding", "exp_avg_sq", 4096)
    assert not is_quantizable("bias", "weight", 10**6) and not is_quantizable("norm", "weight", 10**6)
    assert not is_quantizable("linear", "weight", 1000) and not is_quantizable("linear", "buffer", 10**6)
    sd = ckpt.model
    plan = fit_layer_thresholds({"fc1.weight": (sd["fc1.weight"], "linear"), "fc1.bias": (sd["fc1.bias"], "bias"),
                                 "norm.weight": (sd["norm.weight"], "norm")}, DynaQuantConfig())
    assert set(plan.skipped) == {"fc1.bias", "norm.weight"} and set(plan.tensors) == {"fc1.weight"}
    with pytest.raises(ConfigError, match="kept exact"):
        quantize(sd["fc1.bias"], "fc1.bias", plan)
    bad = sd["fc1.weight"].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(NonFiniteError):
        quantize(bad, "fc1.weight", plan)
    with pytest.raises(ConfigError):
        fit_layer_thresholds({"x": (sd["fc1.weight"], "attention")}, DynaQuantConfig())


def test_prune_cap_keeps_a_small_magnitude_layer_alive():
    # one layer type, two tensors of very different scale (like BERT's pooler beside its encoder)
    g = torch.Generator().manual_seed(0)
    big = torch.randn(256, 256, generator=g) * 0.05
    small = torch.randn(256, 256, generator=g) * 0.005
    spec = {"big": (big, "linear"), "small": (small, "linear")}
    paper = fit_layer_thresholds(spec, DynaQuantConfig(prune_fraction=0.5, max_prune_ratio=None))
    capped = fit_layer_thresholds(spec, DynaQuantConfig(prune_fraction=0.5))  # default cap 1.0 x F
    pruned = lambda plan, n, x: float((quantize(x, n, plan).codes == 0).float().mean())  # noqa: E731
    assert pruned(paper, "small", small) > 0.8           # the paper's per-type threshold takes most of it
    assert abs(pruned(capped, "small", small) - 0.5) < 0.02
    assert pruned(capped, "big", big) == pytest.approx(pruned(paper, "big", big), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_dequantize_kernel_is_the_reference(ckpt, dtype):
    """The numba lookup (every narrow code dtype) gives the plain-torch reference's tensor, and a
    wrong protected count or a code past the codebook raises the reference's error."""
    from ckptzip.quant.dynaquant import dequantize_reference

    x = ckpt.model["fc1.weight"]
    plan = fit_layer_thresholds({"fc1.weight": (x, "linear")}, DynaQuantConfig(bins=8, protect_fraction=0.01))
    q = quantize(x, "fc1.weight", plan)
    q = replace(q, codes=q.codes.to(dtype), dtype="bfloat16")
    assert q.meta["n_protected"] > 0
    y = dequantize(q)
    assert y.dtype == torch.bfloat16 and torch.equal(y, dequantize_reference(q))
    for qq in (q, replace(q, dtype="float32")):
        for out in (torch.empty(q.shape), torch.empty(q.shape, dtype=torch.bfloat16), torch.empty(q.shape[::-1]).t()):
            assert dequantize(qq, out=out) is out and torch.equal(out, dequantize_reference(qq).to(out.dtype))
    with pytest.raises(ValueError, match="out has shape"):
        dequantize(q, out=torch.empty(3))
    short = replace(q, side={"protected": q.side["protected"][:-1]})
    with pytest.raises(ValueError, match="protected values"):
        dequantize(short)
    extra = replace(q, side={"protected": torch.cat([q.side["protected"], q.side["protected"][:1]])})
    with pytest.raises(ValueError, match="protected values"):
        dequantize(extra)
    bad = q.codes.clone()
    bad.view(-1)[5] = q.n_levels + 3
    with pytest.raises(IndexError):
        dequantize(replace(q, codes=bad))
