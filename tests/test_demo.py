"""The fault-tolerant harness on a real (short) run: lossless restores reproduce training exactly;
a lossy method stays close; the report is written."""
import dataclasses
import io
import json

import torch

from ckptzip.demo.faults import failure_steps, run
from ckptzip.demo.report import markdown_table, print_table, write_report
from ckptzip.demo.workloads import digits_workload


def test_fault_tolerant_runs_and_report(tmp_path):
    torch.set_num_threads(1)
    wl = digits_workload(total_steps=120, ckpt_every=20, hidden=128)
    fails = failure_steps(wl, 3)
    assert len(fails) == 3 and all(f % wl.ckpt_every for f in fails)
    ref = run(wl, None)
    lossless = run(wl, "lossless", failures=3)
    assert lossless.failures == fails and len(lossless.restores) == 3
    assert lossless.final_metric == ref.final_metric  # exact resume through 3 restores
    assert [l for s, l in lossless.losses if s == wl.total_steps] == [l for s, l in ref.losses if s == wl.total_steps]
    dq = run(wl, "dynaquant", failures=3)
    assert dq.ratio > 2 * lossless.ratio
    assert abs(dq.degradation(ref)) < 0.05
    files = write_report([ref, lossless, dq], tmp_path, {"test": True})
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in data["runs"]] == ["uncompressed", "lossless", "dynaquant"]
    assert "| digits-mlp | lossless |" in markdown_table([ref, lossless, dq])
    assert any(str(f).endswith(".png") for f in files)
    # not a terminal (a pipe, a log): the markdown table, every column, not cut to the console width
    from rich.console import Console

    out = io.StringIO()
    print_table([ref, lossless, dq], Console(file=out, width=40))
    assert out.getvalue() == markdown_table([ref, lossless, dq]) + "\n"


def test_workload_budget_and_output_fidelity_reach_the_search():
    """A workload may judge outputs (as MiniLM does) at its own budget; the caller's threshold then
    does not apply to it."""
    torch.set_num_threads(1)
    wl = digits_workload(total_steps=60, ckpt_every=20, hidden=128)
    x = torch.linspace(-1, 1, 64 * 32).reshape(32, 64)

    @torch.no_grad()
    def outputs(m):
        return m(x)

    wl = dataclasses.replace(wl, eval_fn=outputs, threshold=0.2)
    r = run(wl, "dynaquant", failures=1, threshold=0.01)
    sums = [c["summary"] for c in r.checkpoints]
    assert sums and all(s["judge"] == "outputs" and s["threshold"] == 0.2 for s in sums)
    assert all(s["infeasible"] or s["degradation"] <= 0.2 for s in sums)


def test_paced_intervals_are_the_async_default():
    """--async saves at intervals where training dominates (--paced), with the agent's own evaluator;
    --paced and --full are one choice of intervals each."""
    import pytest

    from ckptzip.demo import run as demo_run
    from ckptzip.errors import ConfigError

    wl = demo_run.workload_for("digits", full=False, paced=True)
    assert (wl.total_steps, wl.ckpt_every) == demo_run.PACED["digits"]
    assert wl.agent_eval == "ckptzip.demo.workloads:digits_eval"  # the same model: the agent can search
    assert demo_run.workload_for("minilm", full=False, paced=True).ckpt_every == 8  # already training-bound
    with pytest.raises(ConfigError, match="--paced and --full"):
        demo_run.main(workloads=("digits",), full=True, paced=True)
