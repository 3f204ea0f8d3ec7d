"""qd / cnr / gobo as chain methods on a real run, with and without the config search."""
import copy

import pytest
import torch

from ckptzip import CheckpointChain
from ckptzip.errors import ConfigError
from ckptzip.format import decode_container
from ckptzip.methods.base import EncodeContext, get_method
from ckptzip.search import CNRSpace, ConfigCube, GoboSpace, QDSpace, TrialRunner, search_config
from ckptzip.state import flatten_state


# GOBO's default is 8 bins (its paper's setting): coarser than the others on an early checkpoint
@pytest.mark.parametrize("method,delta,max_deg", [("qd", True, 0.05), ("cnr", False, 0.15), ("gobo", False, 0.25)])
def test_baseline_chain(tmp_path, digits_snapshots, method, delta, max_deg):
    torch.set_num_threads(1)
    model, opt, snaps, ev = digits_snapshots
    ch = CheckpointChain(tmp_path, method)
    entries = [ch.save({"model": s.model, "optimizer": s.optimizer}, s.step, model=model, optimizer=opt)
               for s in snaps[:4]]
    assert [e.keyframe for e in entries] == ([True, False, False, False] if delta else [True] * 4)
    assert ch.verify() == []
    assert sum(e.raw_bytes for e in entries) / sum(e.nbytes for e in entries) > 3
    m_ref, m_q = copy.deepcopy(model), copy.deepcopy(model)
    for s in snaps[:4]:
        m_ref.load_state_dict(s.model)
        m_q.load_state_dict(ch.load(s.step)["model"])
        assert abs(ev(m_q) - ev(m_ref)) / ev(m_ref) < max_deg
    m = decode_container(ch.storage.read(entries[1].file)).manifest
    piped = [r["pipeline"] for r in m["records"].values() if r["role"] == "weight" and r["pipeline"][0] != "exact/1"]
    assert piped and all(p[0] == f"{method}/1" for p in piped)
    assert all(("cyclic-delta/1" in p) == delta for p in piped)


def test_gobo_outliers_survive_exactly(tmp_path, digits_snapshots):
    model, opt, snaps, ev = digits_snapshots
    sd = {k: v.clone() for k, v in snaps[-1].model.items()}
    sd["fc2.weight"][3, 5] = 50.0  # a far outlier under the fitted Gaussian
    ch = CheckpointChain(tmp_path, "gobo")
    ch.save({"model": sd}, 1, model=model)
    assert ch.load()["model"]["fc2.weight"][3, 5].item() == 50.0


# ----------------------------------------------------------------------------- config search
@pytest.mark.parametrize("method", ["qd", "cnr", "gobo"])
def test_baseline_config_search_meets_the_threshold(tmp_path, digits_snapshots, method):
    """The paper extends the search to every baseline (section 8.2): each picks its knobs from its
    own table per checkpoint, and the restored weights score what the search measured."""
    torch.set_num_threads(1)
    model, opt, snaps, ev = digits_snapshots
    live = copy.deepcopy(model)
    space = get_method(method).space()
    cube = ConfigCube(space, embedding=False)
    ch = CheckpointChain(tmp_path, method)
    entries = []
    for s in snaps[3:8]:
        live.load_state_dict(s.model)
        ctx = EncodeContext(step=s.step, model=live, eval_fn=ev, threshold=0.01)
        entries.append(ch.save({"model": s.model, "optimizer": s.optimizer}, s.step, model=live, ctx=ctx))
    kinds = [e.summary["search"] for e in entries]
    assert kinds[0] == "exhaustive" and kinds.count("neighbourhood") >= 2, kinds
    assert entries[0].summary["cube_size"] == len(cube)
    m_q = copy.deepcopy(model)
    for e, s in zip(CheckpointChain(tmp_path, method).entries(), snaps[3:8]):
        knobs = {k: e.summary[k] for k in cube.knob_names}
        assert cube.point(cube.from_knobs(knobs)) is not None, knobs  # a config from the paper's table
        m_q.load_state_dict(ch.load(s.step)["model"])
        d = (ev(m_q) - e.summary["baseline"]) / e.summary["baseline"]
        assert d == pytest.approx(e.summary["degradation"], abs=1e-9)
        assert e.summary["infeasible"] or d <= 0.01
    # a writer restarted on the chain resumes the steady-state search from the last file
    live.load_state_dict(snaps[8].model)
    ctx = EncodeContext(step=snaps[8].step, model=live, eval_fn=ev, threshold=0.01)
    e = CheckpointChain(tmp_path, method).save({"model": snaps[8].model}, snaps[8].step, model=live, ctx=ctx)
    assert e.summary["search"] in ("neighbourhood", "fallback")


@pytest.mark.parametrize("method", ["qd", "gobo"])
def test_baseline_search_finds_the_best_config_of_the_whole_table(digits_snapshots, method):
    """Brute force over every config of the (small) table: the guided search picks the feasible
    config with the highest estimated ratio, at a fraction of the evaluations."""
    torch.set_num_threads(1)
    model, opt, snaps, ev = digits_snapshots
    s = snaps[5]
    live = copy.deepcopy(model)
    live.load_state_dict(s.model)
    m = get_method(method)
    flat = flatten_state({"model": s.model}, live)
    ctx = EncodeContext(step=s.step, model=live, eval_fn=ev, threshold=0.01)
    knobs, info, st = search_config(m, flat, None, ctx, None)
    cube = ConfigCube(m.space(), embedding=False)
    runner = TrialRunner(m, flat, None, ctx)
    try:
        trials = [runner.trial(c) for c in dict.fromkeys(cube.candidate(p) for p in cube.points())]
    finally:
        runner.close()
    feasible = [t for t in trials if t.feasible]
    assert feasible and not info["infeasible"]
    best = max(t.est_ratio for t in feasible)
    chosen = next(t for t in trials if t.candidate.knobs() == knobs)  # ties (same levels used) may differ
    assert chosen.feasible and chosen.est_ratio == pytest.approx(best, rel=1e-9) and st["best"] == knobs
    assert info["est_ratio"] == pytest.approx(best, rel=1e-3)
    assert info["evals"] < len(trials), (info["evals"], len(trials))


def test_search_spaces_validate_and_canonicalize():
    with pytest.raises(ConfigError, match="QDConfig|QDSpace.*no field"):
        get_method("qd", search={"space": {"bins": [8]}})
    with pytest.raises(ConfigError, match="range_ratio"):
        CNRSpace(range_ratio=(0.1, 1.5))
    with pytest.raises(ConfigError, match="exceeds"):
        QDSpace(min_bins=(64,), max_bins=(8, 16))
    with pytest.raises(ConfigError, match="outlier_log_prob"):
        GoboSpace(outlier_log_prob=(float("-inf"),))
    cube = ConfigCube(QDSpace())
    # min_bins > max_bins is not a QD config: it stands for min_bins = max_bins
    assert cube.candidate((5, 0)).knobs() == {"min_bins": 8, "max_bins": 8}
    assert len({cube.candidate(p) for p in cube.points()}) == 21 and len(cube) == 36
    # GOBO's embedding axis only exists when the state has an embedding; its outlier axis is ascending
    assert ConfigCube(GoboSpace(), embedding=False).shape == (6, 1, 1)
    assert ConfigCube(GoboSpace(outlier_log_prob=(-2.0, -6.0))).axes[2] == (-6.0, -2.0)
    # a user space narrows the search; a method config keeps it as a plain dict for the manifest
    m = get_method("cnr", search={"space": {"bins": [16, 32], "step_bins": [50]}})
    assert ConfigCube(m.space()).shape == (2, 1, 5)
