"""Config search (search/): the cube and its frontier search, the quality judge, the exhaustive /
neighbourhood / fallback strategies on a real digits run, and the chain summary they write.
"""
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from ckptzip.chain import CheckpointChain
from ckptzip.demo.workloads import DigitsMLP, digits_data
from ckptzip.errors import ConfigError
from ckptzip.methods.base import EncodeContext, get_method, method_for_file
from ckptzip.methods.qrecord import Codes
from ckptzip.methods.quantizing import QuantizedReference
from ckptzip.quant.dynaquant import dequantize
from ckptzip.search import DynaQuantSpace, QualityJudge, search_config
from ckptzip.search.quality import Fill
from ckptzip.search.cube import ConfigCube, MonotoneOracle, guided_search, leq, speculate
from ckptzip.state import flatten_state


# ----------------------------------------------------------------------------- cube (pure logic)
def test_space_validation_and_axis_order():
    with pytest.raises(ConfigError, match="bins"):
        DynaQuantSpace(bins=())
    with pytest.raises(ConfigError, match="prune_fraction"):
        DynaQuantSpace(prune_fraction=(0.0, 1.2))
    with pytest.raises(ConfigError, match="prune_metric"):
        DynaQuantSpace(prune_metric=("hessian",))
    with pytest.raises(ConfigError, match="< 1"):
        DynaQuantSpace(prune_fraction=(0.9,), protect_fraction=(0.2,))
    with pytest.raises(ConfigError, match="no field"):
        DynaQuantSpace.from_any({"bin": [4]})
    cube = ConfigCube(DynaQuantSpace.from_any({"bins": [16, 4, 8], "prune_fraction": [0.0, 0.3]}))
    # index 0 = most aggressive on every axis
    assert cube.axes[0] == (4, 8, 16) and cube.axes[1] == (0.3, 0.0) and cube.axes[2] == (0.0005, 0.005, 0.01)
    assert len(ConfigCube()) == 6 * 6 * 3 * 2 and ConfigCube(embedding=False).shape == (6, 6, 3, 1)
    c = cube.candidate((1, 0, 2, 1), "magnitude")
    assert c.knobs() == {"prune_metric": "magnitude", "bins": 8, "prune_fraction": 0.3, "protect_fraction": 0.01,
                         "embedding_bins": 32}
    assert cube.point(c) == (1, 0, 2, 1) and cube.from_knobs(c.knobs()) == c
    assert cube.from_knobs({"bins": 8}) is None  # a previous best from another space: start over


def test_a_named_space_preset_reaches_the_method_and_its_files(tmp_path):
    wide = get_method("dynaquant", {"search": {"space": "wide"}}).space()
    assert wide == DynaQuantSpace(**DynaQuantSpace.presets["wide"]) and min(wide.bins) == 2
    with pytest.raises(ConfigError, match="SearchConfig.space must be .* preset name \\(wide\\), got 'wid'"):
        get_method("dynaquant", {"search": {"space": "wid"}})
    with pytest.raises(ConfigError, match="QDSpace has no preset 'wide'"):
        get_method("qd", {"search": {"space": "wide"}})
    # the name is what the manifest records; a reader rebuilds the method from it
    model = DigitsMLP(16)
    chain = CheckpointChain(tmp_path / "c", "dynaquant", {"search": {"space": "wide"}})
    chain.save({"model": model.state_dict()}, 1)
    manifest = CheckpointChain(tmp_path / "c").manifest(1)
    assert manifest["config"]["search"]["space"] == "wide"
    assert method_for_file(manifest["method"], manifest["config"]).space() == wide


def _minimal(points):
    return {p for p in points if not any(q != p and leq(q, p) for q in points)}


def test_guided_search_finds_the_whole_frontier_cheaply():
    cube = ConfigCube()
    pts = list(cube.points())
    evals = []
    for seed in range(60):
        rng = random.Random(seed)
        gens = [tuple(rng.randrange(n) for n in cube.shape) for _ in range(rng.randint(1, 5))]
        feasible = {p for p in pts if any(leq(g, p) for g in gens)}
        n = [0]

        def ev(p):
            n[0] += 1
            return p in feasible

        found = guided_search(cube.bottom, cube.top, MonotoneOracle(ev))
        assert set(found) <= feasible
        assert _minimal(feasible) <= set(found), f"seed {seed}: missed a frontier point"
        evals.append(n[0])
    assert np.mean(evals) < 0.25 * len(cube), evals


def test_speculation_never_changes_the_result():
    # a NON-monotone feasibility: parallel rounds must still decide exactly like one process
    cube = ConfigCube()

    def search(answer):
        oracle = MonotoneOracle(answer)
        return guided_search(cube.bottom, cube.top, oracle), dict(oracle.asked)

    for seed in range(12):
        rng = random.Random(100 + seed)
        table = {p: rng.random() < 0.2 + 0.1 * sum(p) for p in cube.points()}
        runs = []
        for width in (1, 2, 4):
            cache, rounds = {}, 0
            while width > 1 and (spec := speculate(search, cache.get, width)):
                assert len(spec) <= width and not set(spec) & set(cache)
                cache.update({p: table[p] for p in spec})
                rounds += 1

            def answer(p, cache=cache):
                if p not in cache:
                    cache[p] = table[p]
                return cache[p]

            result = search(answer)
            runs.append((result, rounds or len(cache)))
        assert runs[0][0] == runs[1][0] == runs[2][0]
        assert runs[2][1] < runs[1][1] < runs[0][1], [r[1] for r in runs]


def test_neighbourhood_respects_the_monotone_policy():
    cube = ConfigCube()
    p = (2, 3, 1, 0)
    mono = cube.neighbourhood(p, 1, monotone=True)
    free = cube.neighbourhood(p, 1, monotone=False)
    assert mono[0] == p and free[0] == p
    assert all(sum(abs(a - b) for a, b in zip(q, p)) <= 1 for q in free) and len(free) == 1 + 7  # emb axis at 0
    assert set(mono) == {p} | {q for q in free if not leq(q, p)}
    assert len(cube.neighbourhood(p, 2, monotone=False)) > len(free)


# ----------------------------------------------------------------------------- real digits run
@pytest.fixture(scope="module")
def run(request):
    model, opt, snaps, eval_fn = request.getfixturevalue("digits_snapshots")  # single-threaded (conftest)
    return snaps, eval_fn


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _flat(snap, model):
    return flatten_state({"model": snap.model}, model)


def _live(snap):
    m = DigitsMLP(128)
    m.load_state_dict(snap.model)
    return m


def _quantize(flat, qcfg, grads=None):
    return get_method("dynaquant", {"quantizer": qcfg}).search_quantize(flat, {}, grads)


def _measure(snap, flat, qcfg, grads, eval_fn, higher_is_better=False):
    """Independent re-measurement: a fresh model, the dequantized weights, the user's eval_fn."""
    ref = _live(snap)
    base = eval_fn(ref)
    m = _live(snap)
    sd = dict(snap.model)
    for name, q in _quantize(flat, qcfg, grads).items():
        sd[name.split("/", 1)[1]] = dequantize(q)
    m.load_state_dict(sd)
    s = eval_fn(m)
    return ((base - s) if higher_is_better else (s - base)) / abs(base)


def test_judge_leaves_live_model_rng_and_mode_alone(run):
    snaps, eval_fn = run
    live = _live(snaps[4])
    live.train()
    live.fc2.eval()  # a mixed mode must survive too
    before = {k: v.clone() for k, v in live.state_dict().items()}

    def greedy_eval(m):  # consumes every RNG and flips modes, as careless eval code does
        torch.rand(3), np.random.rand(), random.random()
        m.eval()
        return eval_fn(m)

    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    rng = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    flat = _flat(snaps[2], live)  # judge an *older* state than the live weights
    judge = QualityJudge(live, greedy_eval, flat, threshold=0.01)
    v = judge.check({"model/fc1.weight": torch.zeros(128, 64)})
    assert torch.equal(torch.get_rng_state(), rng[0]) and np.array_equal(np.random.get_state()[1], rng[1])
    assert random.getstate() == rng[2]
    assert live.training and not live.fc2.training and live.fc1.training
    assert all(torch.equal(before[k], v_) for k, v_ in live.state_dict().items())
    # baseline = the saved state exactly (not the live weights); the candidate is scored as given
    assert judge.baseline == pytest.approx(eval_fn(_live(snaps[2])), abs=0)
    old = _live(snaps[2])
    with torch.no_grad():
        old.fc1.weight.zero_()
    assert v.score == pytest.approx(eval_fn(old), abs=0) and not v.feasible
    assert v.degradation == pytest.approx((v.score - judge.baseline) / judge.baseline)
    assert all(m.training == t for m, t in judge._modes)
    judge.close()


def test_judge_reloads_only_what_changed_and_restores_the_rest(run):
    """After the exact state, the judge copies only the replaced tensors into its scratch; a tensor
    replaced in one trial and not the next must be back to its exact value (scores equal a fresh
    judge's), and a module with its own load hook keeps load_state_dict."""
    snaps, _ = run
    live = _live(snaps[4])
    flat = _flat(snaps[2], live)

    def weights(m):  # sees every weight, so a stale replacement changes the score
        return float(sum(p.detach().double().abs().sum() * (i + 1) for i, p in enumerate(m.parameters())))

    judge = QualityJudge(live, weights, flat)
    assert judge._targets is not None
    zeros = {n: torch.zeros_like(flat.tensors[n]) for n in ("model/fc1.weight", "model/fc2.weight")}
    half = {"model/fc2.weight": flat.tensors["model/fc2.weight"] * 0.5}
    for reps in (zeros, half, {}, zeros, {}):
        assert judge.score(reps) == QualityJudge(live, weights, flat).score(reps)
    assert judge.score({}) == judge.baseline
    # a Fill is written into the scratch's own tensor (no temporary), else materialized first
    into = []

    def fill(name, value):
        def write(out):
            into.append(out.data_ptr())
            out.copy_(value)
        return Fill(tuple(value.shape), value.dtype, write)

    filled = {n: fill(n, v) for n, v in zeros.items()}
    assert judge.score(filled) == judge.score(zeros)
    assert into == [judge._scratch.fc1.weight.data_ptr(), judge._scratch.fc2.weight.data_ptr()]
    live.fc1.register_load_state_dict_post_hook(lambda module, keys: None)
    hooked = QualityJudge(live, weights, flat)
    assert hooked._targets is None and hooked.score(filled) == judge.score(zeros)


def test_exhaustive_search_is_feasible_and_cheap(run):
    snaps, eval_fn = run
    snap = snaps[3]
    live = _live(snaps[-1])
    flat = _flat(snap, live)
    method = get_method("dynaquant")
    ctx = EncodeContext(step=snap.step, model=live, eval_fn=eval_fn, threshold=0.01, gradients=snap.grads)
    knobs, info, st = search_config(method, flat, None, ctx, None)
    qcfg = replace(method.config.quantizer, **knobs)
    assert info["search"] == "exhaustive" and not info["infeasible"]
    assert info["cube_size"] == 108 * 2  # no embedding layer: 6x6x3 per metric, both metrics
    assert info["evals"] <= info["cube_size"] // 3, info
    d = _measure(snap, flat, qcfg, snap.grads, eval_fn)
    assert d <= 0.01 and d == pytest.approx(info["degradation"], abs=1e-9)
    assert st["best"]["bins"] == qcfg.bins and st["exhaustive"] == 1


def test_steady_state_uses_few_evaluations(run):
    snaps, eval_fn = run
    live = _live(snaps[-1])
    method = get_method("dynaquant", search={"policy": "monotone"})
    st, ref, kinds = None, None, []
    for snap in snaps[4:9]:
        flat = _flat(snap, live)
        ctx = EncodeContext(step=snap.step, model=live, eval_fn=eval_fn, threshold=0.02, gradients=snap.grads)
        knobs, info, st = search_config(method, flat, ref, ctx, st)
        qcfg = replace(method.config.quantizer, **knobs)
        kinds.append(info["search"])
        if info["search"] == "neighbourhood":
            # previous best with both metrics, then at most its 3 more conservative neighbours
            assert info["evals"] <= 2 + info["neighbours"], info
        if not info["infeasible"]:
            assert _measure(snap, flat, qcfg, snap.grads, eval_fn) <= 0.02
        ref = QuantizedReference(snap.step, {n: Codes(q.codes, q.n_levels)
                                    for n, q in _quantize(flat, qcfg, snap.grads).items()})
    assert kinds[0] == "exhaustive"
    assert kinds.count("neighbourhood") >= 3, kinds


def test_higher_is_better_accuracy(run):
    snaps, _ = run
    _, _, xte, yte = digits_data(0)

    @torch.no_grad()
    def accuracy(m):
        return float((m(xte).argmax(-1) == yte).float().mean())

    snap = snaps[5]
    live = _live(snap)
    flat = _flat(snap, live)
    ctx = EncodeContext(step=snap.step, model=live, eval_fn=accuracy, threshold=0.01, higher_is_better=True)
    method = get_method("dynaquant")
    knobs, info, _ = search_config(method, flat, None, ctx, None)
    qcfg = replace(method.config.quantizer, **knobs)
    assert info["higher_is_better"] and info["baseline"] == pytest.approx(accuracy(live), abs=0)
    assert info["degradation"] <= 0.01
    assert _measure(snap, flat, qcfg, None, accuracy, higher_is_better=True) <= 0.01
    # accuracy tolerates more than the loss does: a coarser config than the top corner passes
    assert (qcfg.bins, qcfg.prune_fraction) != (32, 0.0)


def test_output_fidelity_bounds_the_relative_output_error(run):
    """eval_fn may return outputs: the search then bounds ||y - y0|| / ||y0|| by the threshold."""
    snaps, _ = run
    _, _, xte, _ = digits_data(0)

    @torch.no_grad()
    def logits(m):
        return m(xte)

    snap = snaps[5]
    live = _live(snap)
    flat = _flat(snap, live)
    method = get_method("dynaquant")
    found = {}
    for th in (0.1, 0.3):
        ctx = EncodeContext(step=snap.step, model=live, eval_fn=logits, threshold=th, gradients=snap.grads)
        knobs, info, _ = search_config(method, flat, None, ctx, None)
        assert info["judge"] == "outputs" and info["baseline"] == 0.0 and not info["infeasible"]
        m = _live(snap)
        sd = dict(snap.model)
        for name, q in _quantize(flat, replace(method.config.quantizer, **knobs), snap.grads).items():
            sd[name.split("/", 1)[1]] = dequantize(q)
        m.load_state_dict(sd)
        err = float((logits(m) - logits(live)).norm() / logits(live).norm())
        assert err == pytest.approx(info["degradation"], rel=1e-6) and err <= th
        found[th] = info["est_ratio"]
    assert found[0.3] > found[0.1]  # a looser output budget buys a smaller checkpoint
    # outputs are lower-is-better errors, and must keep their shape between calls
    with pytest.raises(ConfigError, match="higher_is_better"):
        QualityJudge(live, logits, flat, higher_is_better=True)
    calls = []

    def shrinking(m):
        calls.append(1)
        return logits(m)[:len(xte) - len(calls) + 1]

    judge = QualityJudge(live, shrinking, flat)
    with pytest.raises(ConfigError, match="same outputs every call"):
        judge.check({})
    with pytest.raises(ConfigError, match="float score or a tensor"):
        QualityJudge(live, lambda m: "good", flat)


def test_nothing_feasible_picks_the_least_aggressive_config(run):
    snaps, _ = run
    snap = snaps[2]
    live = _live(snap)
    exact = {k: v.clone() for k, v in snap.model.items()}

    def distance(m):  # 0 for the exact weights, > 0 for any quantization: nothing passes threshold 0
        return float(sum((p - exact[n]).abs().sum() for n, p in m.state_dict().items()))

    ctx = EncodeContext(step=snap.step, model=live, eval_fn=distance, threshold=0.0)
    knobs, info, st = search_config(get_method("dynaquant"), _flat(snap, live), None, ctx, None)
    qcfg = replace(get_method("dynaquant").config.quantizer, **knobs)
    assert info["infeasible"] and info["baseline"] == 0.0 and info["degradation"] > 0
    assert (qcfg.bins, qcfg.prune_fraction, qcfg.protect_fraction) == (32, 0.0, 0.01)


def test_chain_records_the_search_in_the_entry_summary(run, tmp_path):
    snaps, eval_fn = run
    model = _live(snaps[0])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    chain = CheckpointChain(tmp_path / "c", "dynaquant")
    for snap in snaps[2:5]:
        model.load_state_dict(snap.model)
        opt.load_state_dict(snap.optimizer)
        ctx = EncodeContext(step=snap.step, model=model, eval_fn=eval_fn, threshold=0.01, gradients=snap.grads)
        chain.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, snap.step, model=model,
                   optimizer=opt, ctx=ctx)
    entries = CheckpointChain(tmp_path / "c", "dynaquant").entries()
    assert [e.summary["search"] for e in entries][0] == "exhaustive"
    for e, snap in zip(entries, snaps[2:5]):
        s = e.summary
        assert {"bins", "prune_metric", "evals", "search_s", "degradation", "baseline"} <= set(s)
        assert s["evals"] >= 1 and s["search"] in ("exhaustive", "neighbourhood", "fallback")
        # the restored weights score what the search measured
        m = DigitsMLP(128)
        m.load_state_dict(chain.load(e.step)["model"])
        d = (eval_fn(m) - s["baseline"]) / s["baseline"]
        assert d == pytest.approx(s["degradation"], abs=1e-9)
        assert s["infeasible"] or d <= 0.01


def test_save_stores_the_quantization_the_search_evaluated(run, monkeypatch):
    """A searched save reuses the search's last quantization when it chose it (no second
    quantization of the weights) and writes the same blobs as one that quantizes again."""
    snaps, eval_fn = run
    live = _live(snaps[-1])

    def encode_all(method):
        ref, out = None, []
        for snap in snaps[4:6]:
            ctx = EncodeContext(step=snap.step, model=live, eval_fn=eval_fn, threshold=0.02)
            enc, ref = method.encode(_flat(snap, live), ref, ctx=ctx)
            out.append(enc.blobs)
        return out

    calls = []
    reusing = get_method("dynaquant")
    monkeypatch.setattr(reusing, "_quantize", lambda *a: calls.append(1) or type(reusing)._quantize(reusing, *a))
    got = encode_all(reusing)
    assert len(calls) < 2  # at least one save stored what its search evaluated
    fresh = get_method("dynaquant")
    monkeypatch.setattr(fresh, "remember_trial", lambda *a: None)
    assert encode_all(fresh) == got
