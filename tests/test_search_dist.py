"""Parallel config-search trials (dist.py) over a gloo process group of 2 and 4 CPU processes:
every rank must choose exactly what one process choosing alone chooses, in fewer rounds.
"""
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckptzip.dist import gather_round


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _search_run(data, group):
    """The searches of a short run (exhaustive, then steady state), as comparable records."""
    from ckptzip.demo.workloads import DigitsMLP
    from ckptzip.methods.base import EncodeContext, get_method
    from ckptzip.methods.qrecord import Codes
    from ckptzip.methods.quantizing import QuantizedReference
    from ckptzip.search import search_config
    from ckptzip.state import flatten_state

    snaps, xte, yte = data["snaps"], data["x_test"], data["y_test"]

    @torch.no_grad()
    def eval_fn(m):  # the held-out loss of digits_run's eval_fn
        return float(torch.nn.functional.cross_entropy(m(xte), yte))

    live = DigitsMLP(128)
    live.load_state_dict(snaps[-1]["model"])
    method = get_method(data.get("method", "dynaquant"))
    st, ref, out = None, None, []
    for s in snaps:
        flat = flatten_state({"model": s["model"]}, live)
        ctx = EncodeContext(step=s["step"], model=live, eval_fn=eval_fn, threshold=0.02, gradients=s["grads"])
        knobs, info, st = search_config(method, flat, ref, ctx, st, group=group)
        out.append({"config": st["best"], **{k: info[k] for k in ("search", "degradation", "score", "baseline",
                                                                  "est_ratio", "infeasible", "evals", "rounds")}})
        ref = QuantizedReference(s["step"], {n: Codes(q.codes, q.n_levels) for n, q in
                                             method.search_quantize(flat, knobs, s["grads"]).items()})
    return out


def _worker(rank, world, port, path, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = _search_run(torch.load(path), dist.group.WORLD)
        # a failing trial on one rank raises on every rank instead of hanging the others
        try:
            gather_round([0] * world, lambda i: 1 / 0 if rank == world - 1 else [1.0], width=1,
                         group=dist.group.WORLD)
        except ZeroDivisionError:
            res.append("raised-own")
        except RuntimeError as e:
            res.append("raised" if f"rank(s) [{world - 1}]" in str(e) else str(e))
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(res, f)
        dist.barrier()  # leave together: a rank tearing gloo down while a peer is still in a collective aborts
    finally:
        dist.destroy_process_group()
    # results are on disk: skip interpreter finalization, where gloo's worker threads can still
    # release tensors and abort the process (std::terminate, seen once in ~20 runs on 4 ranks)
    os._exit(0)


@pytest.fixture(scope="module")
def digits(request):
    _, _, snaps, _ = request.getfixturevalue("digits_snapshots")  # built single-threaded by conftest
    from ckptzip.demo.workloads import digits_data

    _, _, xte, yte = digits_data(0)  # shipped to the workers: importing scikit-learn there costs seconds
    # exhaustive, then neighbourhood, then a fallback that finds nothing feasible (see test_search)
    return {"snaps": [{"step": s.step, "model": s.model, "grads": s.grads} for s in snaps[4:7]],
            "x_test": xte, "y_test": yte}


@pytest.fixture(scope="module")
def sequential(digits):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _search_run(digits, None)
    finally:
        torch.set_num_threads(threads)


def _check(world, data, sequential, tmp_path):
    path = tmp_path / "snaps.pt"
    torch.save(data, path)
    mp.spawn(_worker, args=(world, _free_port(), str(path), str(tmp_path)), nprocs=world, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(ranks):
        assert res[-1] == ("raised-own" if r == world - 1 else "raised")
        assert res[:-1] == ranks[0][:-1], f"rank {r} disagrees with rank 0"
    par = ranks[0][:-1]
    keys = ("config", "search", "degradation", "score", "baseline", "est_ratio", "infeasible")
    for p, s in zip(par, sequential):
        assert {k: p[k] for k in keys} == {k: s[k] for k in keys}
        assert p["rounds"] <= s["rounds"]
    assert sum(p["rounds"] for p in par) < sum(s["rounds"] for s in sequential)


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_trials_choose_what_one_process_chooses(world, digits, sequential, tmp_path):
    _check(world, digits, sequential, tmp_path)
    assert [s["search"] for s in sequential][:2] == ["exhaustive", "neighbourhood"]


def test_parallel_trials_drive_a_baseline_too(digits, tmp_path):
    """The search is the same for the paper's baselines (QD's table here): 2 ranks, same choices."""
    data = {**digits, "method": "qd"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sequential = _search_run(data, None)
    finally:
        torch.set_num_threads(threads)
    assert {tuple(sorted(s["config"])) for s in sequential} == {("max_bins", "min_bins")}
    _check(2, data, sequential, tmp_path)


def test_a_group_without_init_is_refused_with_the_fix():
    from ckptzip.dist import world
    from ckptzip.errors import ConfigError

    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="init_process_group"):
        world(object())
