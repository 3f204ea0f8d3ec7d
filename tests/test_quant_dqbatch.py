"""Batched DynaQuant (quant/dqbatch.py, dqkernels.py) and the search's sketch (dqsearch.py) against
the plain-torch per-tensor reference: the same plan, codes, codebooks and protected values."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from ckptzip.errors import NonFiniteError
from ckptzip.quant import dqbatch, dynaquant as dq
from ckptzip.quant.dqbatch import CHUNK, Sketched, quantize_tensors
from ckptzip.sketch import LogSketch

LTS = {"fc1.weight": "linear", "fc2.weight": "linear", "fc3.weight": "other"}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest restores the thread count


@pytest.fixture(scope="module")
def snap(request):
    return request.getfixturevalue("digits_snapshots")[2][-1]


def _specs(snap, dtype=None, role="weight"):
    out = {}
    for n, lt in LTS.items():
        x = snap.model[n] if role == "weight" else snap.optimizer["state"][list(LTS).index(n) * 2][role]
        out[n] = (x.to(dtype) if dtype is not None else x, lt, role)
    out["fc1.bias"] = (snap.model["fc1.bias"], "bias", "weight")  # skipped: kept exact
    return out


def _same(a, b):
    nan = torch.isnan(a.codebook)
    return (torch.equal(a.codes.long(), b.codes.long()) and torch.equal(nan, torch.isnan(b.codebook))
            and torch.equal(a.codebook[~nan], b.codebook[~nan]) and a.n_levels == b.n_levels
            and torch.equal(a.side["protected"], b.side["protected"]) and a.meta == b.meta
            and a.shape == b.shape and a.dtype == b.dtype)


CONFIGS = [dict(), dict(prune_metric="sensitivity", prune_fraction=0.3, protect_fraction=0.02),
           dict(center_scope="layer_type", bins=8), dict(kmeans="kmeans++", bins=4), dict(max_prune_ratio=None),
           dict(bins=33, prune_fraction=0.0), dict(domain="sqrt")]


@pytest.mark.parametrize("overrides", CONFIGS)
def test_batched_equals_reference(snap, overrides):
    cfg = replace(dq.DynaQuantConfig(), **overrides)
    specs = _specs(snap)
    ref_plan = dq.fit_layer_thresholds_reference(specs, cfg, snap.grads)
    ref = {n: dq.quantize_reference(specs[n][0], n, ref_plan) for n in ref_plan.tensors}
    plan, out = quantize_tensors(specs, cfg, snap.grads)
    assert plan.tensor_prune == ref_plan.tensor_prune and plan.skipped == ref_plan.skipped
    assert {lt: p.to_meta() for lt, p in plan.layer_types.items()} == \
        {lt: p.to_meta() for lt, p in ref_plan.layer_types.items()}
    assert set(out) == set(ref) and all(_same(out[n], ref[n]) for n in ref)
    assert all(q.codes.dtype == torch.uint8 for q in out.values())
    # the per-tensor API on CPU takes the kernels too, and agrees
    assert all(_same(dq.quantize(specs[n][0], n, ref_plan), ref[n]) for n in ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_and_moment_domains(snap, dtype):
    for role in ("exp_avg_sq", "exp_avg"):
        specs = {n: v for n, v in _specs(snap, dtype, role).items() if n != "fc1.bias"}
        cfg = dq.config_for_role(dq.DynaQuantConfig(), role)
        ref_plan = dq.fit_layer_thresholds_reference(specs, cfg)
        _, out = quantize_tensors(specs, cfg)
        assert all(_same(out[n], dq.quantize_reference(specs[n][0], n, ref_plan)) for n in ref_plan.tensors)


def test_chunks_threads_and_errors(snap, monkeypatch):
    monkeypatch.setattr("ckptzip.quant.dqbatch.CHUNK", 20_000)  # several chunks: each tensor its own
    specs = _specs(snap)
    _, one = quantize_tensors(specs, dq.DynaQuantConfig(), snap.grads)
    _, two = quantize_tensors(specs, dq.DynaQuantConfig(), snap.grads, threads=2)
    assert CHUNK > 20_000 and all(_same(one[n], two[n]) for n in one)
    bad = dict(specs)
    x = specs["fc2.weight"][0].clone()
    x[3, 4] = float("inf")
    bad["fc2.weight"] = (x, "linear", "weight")
    with pytest.raises(NonFiniteError, match="fc2.weight"):
        quantize_tensors(bad, dq.DynaQuantConfig())
    plan = dq.fit_layer_thresholds(specs, dq.DynaQuantConfig())
    with pytest.raises(NonFiniteError, match="fc2.weight"):
        dq.quantize(x, "fc2.weight", plan)


def test_a_batch_takes_the_threads_spare_buffer_and_never_shares_it(snap, monkeypatch):
    # quantize_tensors packs into the thread's spare buffer and hands it back; a batch alive beside
    # another (the config search's) packs into a fresh one, and every result is the fresh-buffer one
    monkeypatch.setattr(dqbatch, "_spare", type(dqbatch._spare)())
    specs = _specs(snap)
    want = quantize_tensors(specs, dq.DynaQuantConfig())[1]
    spare = dqbatch._spare.buf
    assert spare is not None and spare.numel() >= sum(t.numel() for n, (t, *_) in specs.items() if n != "fc1.bias")
    held = Sketched(specs, dq.DynaQuantConfig())  # takes the spare ...
    assert held.chunks[0].x._base is spare and dqbatch._spare.buf is None
    got = quantize_tensors(specs, dq.DynaQuantConfig())[1]  # ... so this batch packs into a fresh one
    assert held.chunks[0].x._base is spare and all(_same(got[n], want[n]) for n in want)
    other = dqbatch._spare.buf
    assert other is not None and other is not spare
    plan = held.plan(dq.DynaQuantConfig())
    assert all(_same(q, want[n]) for n, q in held.quantize(plan).items())  # its buffer was not overwritten
    monkeypatch.setattr(dqbatch, "SPARE_KEEP", 16)  # a buffer over the limit is not kept
    monkeypatch.setattr(dqbatch, "_spare", type(dqbatch._spare)())
    quantize_tensors(specs, dq.DynaQuantConfig())
    assert getattr(dqbatch._spare, "buf", None) is None


def test_search_sketch_quantizes_exactly_and_estimates_closely(snap, monkeypatch):
    from ckptzip.methods import qrecord
    from ckptzip.logbuckets import HAVE_NUMBA
    from ckptzip.quant.dqsearch import SearchSketch, joint_counts, joint_counts_reference
    from ckptzip.search.strategies import estimate_bits

    specs = {n: v for n, v in _specs(snap).items() if n != "fc1.bias"}
    base = dq.DynaQuantConfig()
    prev = quantize_tensors(specs, replace(base, bins=8), snap.grads)[1]
    ref = {n: qrecord.Codes(q.codes, q.n_levels) for n, q in prev.items()}
    for coding, reference in (("plain", None), ("conditional", ref), ("delta", ref)):
        prep = SearchSketch(specs, base, snap.grads, reference, coding)
        for knobs in ({"bins": 16}, {"bins": 4, "prune_fraction": 0.3}, {"prune_metric": "sensitivity"}):
            qs = prep.quantize(knobs)
            direct = quantize_tensors(specs, replace(base, **knobs), snap.grads)[1]
            assert all(_same(qs[n], direct[n]) for n in direct)
            est, raw = prep.estimate(knobs)
            exact, raw2 = estimate_bits(qs, type("R", (), {"weights": ref})() if reference else None, coding=coding)
            # a sensitivity candidate is estimated with magnitude thresholds (dqsearch docstring)
            tol = 0.25 if knobs.get("prune_metric") == "sensitivity" else 0.15
            assert raw == raw2 and abs(est - exact) <= tol * exact, (coding, knobs, est, exact)
    sk = Sketched(specs, base)
    rows = {n: r[2] for n, r in sk.rows().items()}
    fast, slow = joint_counts(sk, rows, ref), joint_counts_reference(sk, rows, ref)
    key = lambda j: torch.sort(j[0] * 10**9 + j[1] * 10**6 + j[2]).indices  # noqa: E731
    assert all(torch.equal(f[key(fast)], s[key(slow)]) for f, s in zip(fast, slow))
    monkeypatch.setattr(dqbatch, "CHUNK", 3000)  # several chunks: one count table, zero again after each
    sk = Sketched(specs, base)
    assert len(sk.chunks) > 2
    rows = {n: r[2] for n, r in sk.rows().items()}
    fast, slow = joint_counts(sk, rows, ref), joint_counts_reference(sk, rows, ref)
    assert all(torch.equal(f[key(fast)], s[key(slow)]) for f, s in zip(fast, slow))
    if HAVE_NUMBA:  # a NaN after the sketch pass: named, no count written
        sk = Sketched({n: (t.clone(), lt, role) for n, (t, lt, role) in specs.items()}, base)  # a chunk may be the tensor
        rows = {n: r[2] for n, r in sk.rows().items()}
        c = sk.chunks[0]
        i = next(i for i, n in enumerate(c.names) if n in ref)
        c.x[c.seg(i).start + 5] = float("nan")
        with pytest.raises(NonFiniteError, match=c.names[i].replace(".", r"\.")):
            joint_counts(sk, rows, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_gives_the_cpu_kernels_result(snap):
    """On CUDA the plain-torch reference runs per tensor; it must match the CPU kernels bit for bit."""
    cfg = dq.DynaQuantConfig(prune_metric="sensitivity", prune_fraction=0.2)
    specs = _specs(snap)
    _, cpu = quantize_tensors(specs, cfg, snap.grads)
    gpu_specs = {n: (t.cuda(), lt, role) for n, (t, lt, role) in specs.items()}
    _, gpu = quantize_tensors(gpu_specs, cfg, {n: g.cuda() for n, g in snap.grads.items()})
    for n in cpu:
        q = gpu[n]
        q.codes, q.codebook = q.codes.cpu(), q.codebook.cpu()
        q.side = {k: v.cpu() for k, v in q.side.items()}
        assert _same(cpu[n], q), n


def test_search_sketch_estimates_candidates_in_one_batch_as_one_by_one(snap, monkeypatch):
    """estimate_many clusters the distinct rows of all candidates together; each candidate's
    estimate must be the one it gets alone (a row's k-means does not depend on the batch)."""
    from ckptzip.methods import qrecord
    from ckptzip.quant import dqsearch
    from ckptzip.quant.dqsearch import SearchSketch

    specs = {n: v for n, v in _specs(snap).items() if n != "fc1.bias"}
    base = dq.DynaQuantConfig()
    prev = quantize_tensors(specs, replace(base, bins=8), snap.grads)[1]
    ref = {n: qrecord.Codes(q.codes, q.n_levels) for n, q in prev.items()}
    cands = [{"bins": 4}, {"bins": 16}, {"bins": 4, "prune_fraction": 0.3}, {"bins": 4, "protect_fraction": 0.01},
             {"bins": 4, "embedding_bins": 32}, {"bins": 4}, {"domain": "sqrt"}, {"sigma": 0.5, "bins": 16}]
    for coding, reference in (("plain", None), ("conditional", ref), ("delta", ref)):
        prep = SearchSketch(specs, base, snap.grads, reference, coding)
        many = prep.estimate_many(cands)
        alone = [SearchSketch(specs, base, snap.grads, reference, coding).estimate(k) for k in cands]
        assert many == alone, coding
        assert many[0] == many[5] and len({e for e, _ in many}) > 4
        with monkeypatch.context() as mp:  # large cell spaces are binned by a sort: the same floats
            mp.setattr(dqsearch, "DENSE_CELLS", 0)
            assert prep.estimate_many(cands) == many


def test_level_bounds_row_by_row():
    from ckptzip.quant.levels import level_bounds

    g = torch.Generator().manual_seed(3)
    for domain in ("identity", "sqrt", "log"):
        rows = [torch.sort(torch.randn(n, generator=g)).values.float() for n in (1, 3, 7)]
        if domain == "log":
            rows = [r.exp().log() for r in rows]
        pad = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=math.inf)
        b = level_bounds(pad, domain)
        for i, r in enumerate(rows):
            one = level_bounds(r, domain)
            assert torch.equal(b[i, :one.numel()], one) and bool(torch.isinf(b[i, one.numel():]).all())


def test_trimmed_sketch_rows_equal_the_partition_pass():
    # without gradients the partition's rows are the sketch's signed rows less the pruned values
    # (smallest |x| of each sign) and the protected ones (largest): equal to the full pass on
    # zeros of both signs, values under the zero bucket's bound, thresholds on values and on
    # bucket edges, no pruning, no protection, a protect bound inside the zero bucket
    from ckptzip.logbuckets import HAVE_NUMBA, lookup_table, segment_histograms
    from ckptzip.quant.dqbatch import Chunk, _partition_hist
    if not HAVE_NUMBA:
        pytest.skip("the partition kernels are numba's")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5000, generator=g) * torch.logspace(-4, 1, 5000)
    x[::7] = 0.0
    x[1::11] = -0.0
    x[2::13] = 1e-33 * torch.sign(torch.randn(x[2::13].shape, generator=g))  # zero bucket, not zero
    z = float(lookup_table(0.01, 1e-30).zero_bound)
    x[3::17] = z
    segs = [x[:1200], x[1200:1201], x[1201:1201], x[1201:3000], -x[3000:].abs(), x[3000:].abs()]
    c = Chunk([f"t{i}" for i in range(len(segs))], [s.contiguous() for s in segs], [None] * len(segs))
    signed, = segment_histograms(c.x, c.offsets, alpha=0.01, kinds=("signed",))
    signed = tuple(t.numpy() for t in signed)
    v = x.abs()
    cuts = [-math.inf, 0.0, 1e-33, z, float(v.kthvalue(1000).values), float(v.kthvalue(2500).values), 0.05, math.inf]
    cases = [(p, m) for p in cuts for m in cuts if m >= max(p, 0.0)]
    for prune, pm in cases:
        params = [(prune, False, pm, math.inf, False)] * len(segs)
        want = _partition_hist(c, params, 0.01)
        got = _partition_hist(c, params, 0.01, signed)
        for a, b in zip(want[0], got[0]):
            assert torch.equal(a, b), (prune, pm)
        assert list(want[1]) == list(got[1]) and list(want[2]) == list(got[2]), (prune, pm)


def test_merged_rows_and_row_quantiles_equal_the_sketchs_own():
    # the plan's numpy shortcuts against LogSketch itself: a union of rows (overlapping ordinals,
    # an empty row, a lone zero bucket) and each row's quantile, bit for bit; NaN for an empty row
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(5000, generator=g), torch.randn(300, generator=g) * 1e-3, torch.zeros(0),
          torch.zeros(7), torch.randn(2000, generator=g).exp() * 1e4]
    sketches = [LogSketch(0.01).add(x) for x in xs]
    rows = [(s._ord, s._counts) for s in sketches]
    union = LogSketch(0.01)
    for s in sketches:
        union.merge(s)
    merged = dqbatch._merged(rows, 0.01)
    assert torch.equal(merged._ord, union._ord) and torch.equal(merged._counts, union._counts)
    assert dqbatch._merged([], 0.01).count == 0
    for q in (0.0, 0.1, 0.5, 0.999, 1.0):
        got = dqbatch.row_quantiles(rows, q, 0.01)
        want = [s.quantile(q) if s.count else math.nan for s in sketches]
        assert got[:2] + got[3:] == want[:2] + want[3:] and math.isnan(got[2]), q
        assert union.quantile(q) == float(union.quantile([q])[0])  # the scalar path is the vector one's
