"""BitSnap cluster-based quantization (quant/cluster8.py) on real Adam moments."""
import pathlib
import sys

import numpy as np
import pytest
import torch
from scipy.stats import norm

from ckptzip.errors import ConfigError, CorruptCheckpointError, NonFiniteError
from ckptzip.quant import cluster8 as c8

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))  # the paper's baselines
import paper_baselines as pb  # noqa: E402


def _moments(snaps, key):
    state = snaps[-1].optimizer["state"]
    return [state[i][key] for i in sorted(state)]


def _mre_mse(xs, ys):
    # MRE = mean over nonzero x of |x - x'| / |x|; MSE over all elements; both pooled over tensors
    num = torch.cat([(x - y).abs()[x != 0] / x.abs()[x != 0] for x, y in zip(xs, ys)])
    sq = torch.cat([((x - y) ** 2).reshape(-1) for x, y in zip(xs, ys)])
    return float(num.double().mean()), float(sq.double().mean())


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_error_within_half_step_of_each_cluster(digits_snapshots, key):
    _, _, snaps, _ = digits_snapshots
    for x in _moments(snaps, key):
        q = c8.quantize(x)
        y = c8.dequantize(q)
        assert y.shape == x.shape and y.dtype == x.dtype
        labels, vals = q.codes // 256, q.codes % 256
        scale, cmin = q.side["scale"], q.side["min"]
        xf = x.reshape(-1)
        # labels follow the fitted normal's quantiles (independent reference: scipy)
        mu, sd = float(xf.double().mean()), float(xf.double().std(unbiased=False))
        ref_b = mu + sd * norm.ppf(np.arange(1, 16) / 16)
        np.testing.assert_allclose(q.meta["boundaries"], ref_b, rtol=1e-5, atol=1e-30)
        ref_labels = np.searchsorted(np.asarray(q.meta["boundaries"], dtype=np.float32), xf.numpy(), side="left")
        assert np.array_equal(labels.numpy(), ref_labels)
        # per-cluster asymmetric grid: |x - x'| <= scale/2 (+ fp32 rounding of min + q*scale)
        err = (xf - y.reshape(-1)).abs()
        ulp = torch.finfo(torch.float32).eps
        tol = scale[labels] / 2 * (1 + 1e-5) + 4 * ulp * (cmin[labels].abs() + xf.abs())
        assert bool((err <= tol).all()), float((err - tol).max())
        assert int(vals.min()) >= 0 and int(vals.max()) <= 255
        for l in labels.unique():
            members = xf[labels == l]
            assert float(cmin[l]) == float(members.min())
            top = float(cmin[l] + 255 * scale[l])
            assert abs(top - float(members.max())) <= 4 * ulp * (abs(float(cmin[l])) + abs(top))


def test_beats_naive_uint8_on_real_moments(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    for key in ("exp_avg", "exp_avg_sq"):
        xs = _moments(snaps, key)
        ours = _mre_mse(xs, [c8.dequantize(c8.quantize(x)) for x in xs])
        naive = _mre_mse(xs, [pb.naive_uint8_dequantize(pb.naive_uint8_quantize(x)) for x in xs])
        assert ours[1] < naive[1] / 5, (key, ours, naive)  # MSE
        assert ours[0] < naive[0] / 2, (key, ours, naive)  # MRE


def test_naive_is_one_min_max_grid(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    x = _moments(snaps, "exp_avg_sq")[4]
    q = pb.naive_uint8_quantize(x)
    lo, hi = float(x.min()), float(x.max())
    assert q.n_levels == 256 and float(q.codebook[0]) == lo
    assert float(q.codebook[255]) == pytest.approx(hi, rel=1e-5)
    err = (x - pb.naive_uint8_dequantize(q)).abs().max()
    assert float(err) <= (hi - lo) / 255 / 2 * (1 + 1e-5)
    # one cluster of cluster8 is the same quantizer
    assert torch.equal(c8.dequantize(c8.quantize(x, c8.Cluster8Config(n_clusters=1))), pb.naive_uint8_dequantize(q))


@pytest.mark.parametrize("n", [1, 2, 7, 1001])
def test_pack_unpack_round_trip(digits_snapshots, n):
    _, _, snaps, _ = digits_snapshots
    x = _moments(snaps, "exp_avg")[0].reshape(-1)[:n].clone()
    q = c8.quantize(x)
    blobs = c8.pack(q)
    assert sum(len(b) for b in blobs.values()) == c8.packed_nbytes(n, 16) == (n + 1) // 2 + n + 128
    # low nibble holds the even element
    assert blobs["labels"][0] & 0x0F == int(q.codes[0] // 256)
    q2 = c8.unpack(blobs, q.shape, q.dtype)
    assert torch.equal(q2.codes, q.codes) and torch.equal(q2.codebook, q.codebook)
    assert torch.equal(c8.dequantize(q2), c8.dequantize(q))


def test_unpack_rejects_corrupt_records():
    x = torch.linspace(-1, 1, 11)
    blobs = c8.pack(c8.quantize(x, c8.Cluster8Config(n_clusters=4)))
    bad = [
        {k: v for k, v in blobs.items() if k != "values"},
        {**blobs, "values": blobs["values"][:-1]},
        {**blobs, "labels": blobs["labels"] + b"\0"},
        {**blobs, "scale": blobs["scale"][:-4]},
        {**blobs, "labels": b"\x55" * 5 + b"\x05"},  # label 5 >= 4 clusters
        {**blobs, "labels": blobs["labels"][:-1] + bytes([blobs["labels"][-1] | 0x10])},  # padding nibble
        {**blobs, "min": np.array([np.nan, 0, 0, 0], "<f4").tobytes()},
    ]
    for b in bad:
        with pytest.raises(CorruptCheckpointError):
            c8.unpack(b, (11,), "float32")


def test_edge_cases_and_validation():
    const = torch.full((5, 3), 0.25)
    assert torch.equal(c8.dequantize(c8.quantize(const)), const)  # one-valued cluster: scale 0, exact
    empty = c8.quantize(torch.zeros(0, 4))
    assert c8.dequantize(empty).shape == (0, 4)
    xb = torch.randn(100, generator=torch.Generator().manual_seed(0)).bfloat16()
    yb = c8.dequantize(c8.quantize(xb))
    assert yb.dtype == torch.bfloat16 and float((yb.float() - xb.float()).abs().max()) < 0.02
    for bad in (0, 17, 2.0):
        with pytest.raises(ConfigError, match="n_clusters"):
            c8.Cluster8Config(n_clusters=bad)
    with pytest.raises(NonFiniteError):
        c8.quantize(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ConfigError):
        c8.quantize(torch.arange(4))
