"""Async saves keep the config search (asyncsearch.py): the search runs on a background thread of
the trainer, the agent encodes with its knobs; training is untouched (weights, RNG stream)."""
from __future__ import annotations

import pytest
import torch

import ckptzip
from ckptzip.chain import CheckpointChain
from ckptzip.demo.workloads import digits_workload


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest restores it


def _run(w, url=None, steps=60, every=20, **kw):
    """Train the digits workload; save every ``every`` steps when ``url`` is given."""
    m, opt, sched = w.build(0)
    torch.manual_seed(123)
    ck = ckptzip.Compressor(m, opt, url, "dynaquant", eval_fn=w.eval_fn, threshold=0.05, async_save=True,
                            **kw) if url is not None else None
    handles, noise = [], []
    try:
        for step in range(1, steps + 1):
            w.train_step(m, opt, sched, step)
            noise.append(torch.rand(1))  # the training loop's own global-RNG stream
            if ck is not None and step % every == 0:
                handles.append(ck.save(step))
        if ck is not None:
            ck.wait()
    finally:
        if ck is not None:
            ck.close()
    return m, torch.cat(noise), handles


def test_async_saves_search_in_the_background(tmp_path, monkeypatch):
    w = digits_workload(total_steps=60, ckpt_every=20, hidden=64)
    url = tmp_path / "c"
    m, noise, handles = _run(w, url)
    ref_m, ref_noise, _ = _run(w)
    # the search never touched the live model, its RNG stream or its optimizer
    assert torch.equal(noise, ref_noise)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref_m.state_dict().values()))
    entries = CheckpointChain(url).entries()
    assert [e.step for e in entries] == [20, 40, 60] and all(h.done() for h in handles)
    kinds = [e.summary["search"] for e in entries]
    assert kinds[0] == "exhaustive" and set(kinds[1:]) <= {"neighbourhood", "fallback"}
    assert all(e.summary["evals"] >= 1 for e in entries)
    assert all(e.summary["search_s"] > 0 for e in entries)  # the trainer's search time, not the agent's 0
    # the agent encoded with the knobs the search chose, and they meet the quality threshold
    for e in entries:
        s = e.summary
        restored, _, _ = w.build(0)
        restored.load_state_dict(CheckpointChain(url).load(e.step)["model"])
        d = (w.eval_fn(restored) - s["baseline"]) / s["baseline"]
        assert d == pytest.approx(s["degradation"], abs=1e-6) and (d <= 0.05 or s["infeasible"])
    # the search state reached the files: a restarted writer resumes the steady-state search
    chain = CheckpointChain(url, "dynaquant")
    chain.restore()
    assert chain.method.search_state["checkpoints"] == 3
    # so does a restarted async trainer. Its saves are residuals against the decoded step 60
    # (dynaquant's residual="restored"), searched in their own space with their own history: the
    # first one from scratch, the next in the neighbourhood; the trainer's search judges what the
    # decoder rebuilds from them, not a re-quantization of the weights
    m, opt, sched = w.build(1)
    replays = []
    replay = CheckpointChain._replay
    monkeypatch.setattr(CheckpointChain, "_replay", lambda self, *a, **k: replays.append(a[0]) or replay(self, *a, **k))
    with ckptzip.Compressor(m, opt, url, "dynaquant", eval_fn=w.eval_fn, threshold=0.05, async_save=True) as ck:
        assert ck.restore() == 60
        assert replays == [60]  # decoded once: the search's reference is the restore's, not a second decode
        assert ck.chain.method.search_state["checkpoints"] == 3
        for step in range(61, 101):
            w.train_step(m, opt, sched, step)
            if step % 20 == 0:
                ck.save(step).wait()
    for step, kinds in ((80, ("exhaustive",)), (100, ("neighbourhood", "fallback"))):
        e = CheckpointChain(url).entry(step)
        assert e.summary.get("residual") and e.summary["search"] in kinds
        restored, _, _ = w.build(0)
        restored.load_state_dict(CheckpointChain(url).load(step)["model"])
        d = (w.eval_fn(restored) - e.summary["baseline"]) / e.summary["baseline"]
        assert d == pytest.approx(e.summary["degradation"], abs=1e-6)


def test_the_agent_searches_with_its_own_model_and_eval_fn(tmp_path):
    """EngineOptions.agent_eval: the agent builds (model, eval_fn) itself and runs the search the
    synchronous path runs; the trainer's process has no search thread and needs no eval_fn."""
    from ckptzip.engine import EngineOptions

    w = digits_workload(total_steps=60, ckpt_every=20)
    assert w.agent_eval == "ckptzip.demo.workloads:digits_eval"
    url = tmp_path / "c"
    m, opt, sched = w.build(0)
    with ckptzip.Compressor(m, opt, url, "dynaquant", threshold=0.05, async_save=True,
                            engine_options=EngineOptions(agent_eval=w.agent_eval)) as ck:
        assert ck._searcher is None
        for step in range(1, 61):
            w.train_step(m, opt, sched, step)
            if step % 20 == 0:
                ck.save(step)
        ck.wait()
    entries = CheckpointChain(url).entries()
    assert [e.summary["search"] for e in entries][0] == "exhaustive"
    assert all(e.summary["evals"] >= 1 and e.summary["search_s"] > 0 for e in entries)
    for e in entries:  # judged by the agent's eval_fn against the step's own weights
        restored, _, _ = w.build(0)
        restored.load_state_dict(CheckpointChain(url).load(e.step)["model"])
        d = (w.eval_fn(restored) - e.summary["baseline"]) / e.summary["baseline"]
        assert d == pytest.approx(e.summary["degradation"], abs=1e-6) and (d <= 0.05 or e.summary["infeasible"])


def test_a_bad_agent_eval_is_a_one_line_error(tmp_path):
    from ckptzip.engine import EngineOptions
    from ckptzip.errors import ConfigError

    with pytest.raises(ConfigError, match="agent_eval must be 'module:function'"):
        EngineOptions(agent_eval="no_colon")
    w = digits_workload(total_steps=20, ckpt_every=20, hidden=32)
    m, opt, sched = w.build(0)
    with pytest.raises(Exception, match="EngineOptions.agent_eval 'no_such_module_xyz:make'|no_such_module_xyz"):
        with ckptzip.Compressor(m, opt, tmp_path / "c", "dynaquant", threshold=0.05, async_save=True,
                                engine_options=EngineOptions(agent_eval="no_such_module_xyz:make")) as ck:
            ck.save(1).wait()
    assert CheckpointChain(tmp_path / "c").steps() == []  # nothing half-written


def test_the_agent_builds_its_evaluator_before_the_first_save(tmp_path):
    """The agent builds agent_eval's (model, eval_fn) as soon as it is ready, while the trainer trains
    towards its first save, not when that save arrives (GPT-2's factory imports transformers)."""
    import time

    from ckptzip.engine import EngineOptions

    marker = tmp_path / "built"
    factory = tmp_path / "evals.py"
    factory.write_text("import pathlib\nfrom ckptzip.demo.workloads import digits_eval\n\n"
                       f"def make():\n    pathlib.Path({str(marker)!r}).write_text('x')\n    return digits_eval()\n")
    w = digits_workload(total_steps=20, ckpt_every=20)
    m, opt, sched = w.build(0)
    with ckptzip.Compressor(m, opt, tmp_path / "c", "dynaquant", threshold=0.05, async_save=True,
                            engine_options=EngineOptions(agent_eval=f"{factory}:make")) as ck:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "no save was made, yet the agent should have built its evaluator"
        ck.save(20).wait()
    assert CheckpointChain(tmp_path / "c").entry(20).summary["evals"] >= 1


def test_async_search_codes_keyframes_against_base_weights(tmp_path, monkeypatch):
    """``base=`` with async saves: the agent codes keyframes as residuals against the base, and the
    trainer's search judges those residuals (the degradation it records is the restored model's)."""
    import tempfile

    from ckptzip.basestate import BaseWeights

    staged = tmp_path / "tmp"
    staged.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staged))  # where the engine stages the base for the agent
    w = digits_workload(total_steps=40, ckpt_every=20, hidden=64)
    start, _, _ = w.build(0)  # _run trains from the same initial weights: the run's base
    base = {k: v.clone() for k, v in start.state_dict().items()}
    url = tmp_path / "c"
    _run(w, url, steps=40, every=20, base=base)
    assert not list(staged.glob("ckptzip-base-*"))  # close() removed the staged base
    chain = CheckpointChain(url, base=base)
    first = chain.manifest(20)
    assert first["keyframe"] and first["method_meta"]["base"] == BaseWeights.from_model(base).digest
    assert any(r["pipeline"][:2] == ["dynaquant/1", "residual/1"] for r in first["records"].values())
    for e in chain.entries():
        s = e.summary
        restored, _, _ = w.build(0)
        restored.load_state_dict(chain.load(e.step)["model"])
        d = (w.eval_fn(restored) - s["baseline"]) / s["baseline"]
        assert d == pytest.approx(s["degradation"], abs=1e-6) and (d <= 0.05 or s["infeasible"])
