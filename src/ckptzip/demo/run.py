"""``ckptzip demo``: the main job. Fault-tolerant training on real workloads, one run per method."""
from __future__ import annotations

import os
import pathlib
import time

import torch

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..engine.options import EngineOptions
from ..errors import ConfigError
from ..methods.base import available_methods
from . import workloads as W
from .faults import run
from .report import print_rows, print_table, write_report

DEFAULT_METHODS = ("lossless", "dynaquant", "excp-fixed", "bitsnap")
DEFAULT_WORKLOADS = ("digits", "gpt2", "minilm")
# MiniLM (22.7M params, ~1 s per step on 2 cores) runs a reduced default to keep the demo within
# 10 minutes: only dynaquant, 3 failures. --methods / --failures / --full override this.
REDUCED = {"minilm": {"methods": ("dynaquant",), "failures": 3}}
# --paced (the default with --async): save intervals where training dominates, as in real runs, so
# what a save costs the training is measured rather than the agent's start-up. An agent's save of
# digits (search + encode) takes ~0.1 s of its core and its cold start (torch, the evaluator's model
# and data) ~4 s, against ~1.3 ms per training step; a GPT-2 save ~1.5 s against ~42 ms per step.
# 1000 / 96 steps are ~1.3 / ~4 s of training per save; 3 failures keep the runs short (the demo's
# 10-restore quality is the default run's). MiniLM's steps (~1 s) already dominate at every 8.
PACED = {"digits": (8000, 1000), "gpt2": (768, 96)}
PACED_FAILURES = 3


def workload_for(name: str, full: bool, paced: bool = False):
    if paced and name in PACED:
        return getattr(W, f"{name}_workload")(*PACED[name])
    if name == "digits":
        return W.digits_workload(1500, 50) if full else W.digits_workload()
    if name == "gpt2":
        return W.gpt2_workload(1000, 50, n_embd=192, n_layer=6) if full else W.gpt2_workload()
    if name == "minilm":
        return W.minilm_workload(300, 20, max_len=64, freeze_embeddings=False) if full else W.minilm_workload()
    raise ConfigError(f"unknown workload {name!r}; choose from {', '.join(W.WORKLOADS)}")


def main(workloads=DEFAULT_WORKLOADS, methods=None, failures: int | None = None, full: bool = False,
         out: str = "demo-report", threshold: float = 0.01, async_save: bool = False,
         paced: bool | None = None) -> list:
    console = Console()
    _quiet_frameworks()
    have = set(available_methods())
    for m in methods or ():
        if m not in have:
            raise ConfigError(f"unknown method {m!r}; available: {', '.join(sorted(have))}")
    for w in workloads:
        if w not in W.WORKLOADS:
            raise ConfigError(f"unknown workload {w!r}; choose from {', '.join(W.WORKLOADS)}")
    chosen = list(methods) if methods else [m for m in DEFAULT_METHODS if m in have]
    paced = async_save if paced is None else paced
    if paced and full:
        raise ConfigError("--paced and --full choose different save intervals; pass one of them")
    results = []
    t_start = time.perf_counter()
    threads = torch.get_num_threads()
    if async_save:
        # the agent takes its own cores; a trainer whose OpenMP pool oversubscribes the CPU stalls
        # (steps up to 100x slower, measured on 2 cores): the async demo trains on the rest, and so does
        # its uncompressed reference, so the "step time" column compares like with like
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - EngineOptions().threads))
    trainer_threads = torch.get_num_threads()
    try:
        _warm_up(chosen)
        results = _runs(workloads, chosen, methods, failures, full, paced, threshold, async_save, console)
    finally:
        torch.set_num_threads(threads)
    print_table(results, console)
    meta = {"workloads": {w: _described(workload_for(w, full, paced)) for w in workloads}, "methods": chosen,
            "failures": failures, "threshold": threshold, "full": full, "paced": paced, "async": async_save,
            "trainer_threads": trainer_threads, "wall_s": round(time.perf_counter() - t_start, 1)}
    files = write_report(results, pathlib.Path(out), meta)
    console.print(f"report: {', '.join(str(f) for f in files)}  ({meta['wall_s']} s)")
    return results


def _warm_up(methods) -> None:
    """Save and load a small Adam state (with a config search) once per method before anything is
    timed. The chains' first saves wait for their methods' kernels to compile in a child process
    (jitcache.py; a fresh clone's first workload would otherwise carry the compile: measured before,
    digits dynaquant 1177 % overhead against 121 % with a warm cache, which a training run pays once
    per checkout), and the saves take the other first calls' costs out of the timed runs."""
    import fsspec

    from ..api import rng_state
    from ..chain import CheckpointChain
    from ..methods.base import EncodeContext

    torch.manual_seed(0)
    model = W.DigitsMLP(64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 64)

    def score(m: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(m(x).square().mean())

    root = f"ckptzip-demo-warmup-{os.getpid()}"
    chains = {m: CheckpointChain(f"memory://{root}/{m}", m) for m in methods}
    try:
        for step in (1, 2):  # a keyframe and a delta
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "rng": rng_state()}
            for chain in chains.values():
                chain.save(state, step, model=model, optimizer=opt,
                           ctx=EncodeContext(step=step, model=model, eval_fn=score, threshold=0.01))
        for chain in chains.values():
            chain.load(2)
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)


def _described(wl) -> str:
    return f"{wl.description}; {wl.total_steps} steps, a checkpoint every {wl.ckpt_every}"


def _runs(workloads, chosen, methods, failures, full, paced, threshold, async_save, console) -> list:
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as prog:
        for wname in workloads:
            wl = workload_for(wname, full, paced)
            reduced = REDUCED.get(wname, {}) if not full else {}
            w_methods = chosen if methods else [m for m in chosen if m in reduced.get("methods", chosen)]
            default_failures = PACED_FAILURES if paced and wname in PACED else 10
            w_failures = failures if failures is not None else reduced.get("failures", default_failures)
            for method in [None, *w_methods]:
                label = f"{wl.name:18s} {method or 'uncompressed':12s}"
                task = prog.add_task(label, total=wl.total_steps)
                r = run(wl, method, failures=w_failures, threshold=threshold, async_save=async_save,
                        progress=lambda s, n, task=task: prog.update(task, completed=s))
                prog.update(task, completed=wl.total_steps,
                            description=label + (f" ratio {r.ratio:.1f}x" if method else ""))
                results.append(r)
    return results


def _quiet_frameworks() -> None:
    """The demo prints its own progress; silence transformers' load reports and config warnings."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:
        pass


def transfer(out: str = "demo-report", thresholds=(0.01, 0.05), steps: int | None = None, check: str | None = None,
             space: str = "pretrained", seeds=(0,)) -> list[dict]:
    """Transfer learning (the paper's Table 6): compress the pretrained MiniLM (a keyframe) at each
    threshold against a check for pretrained weights, fine-tune from the compressed and from the
    original weights with the same seeds, compare; writes ``out/transfer.json``."""
    from . import transfer as T

    _quiet_frameworks()
    console = Console()
    check = check or T.P.DEFAULT_CHECK
    rows = T.run_transfer(pathlib.Path(out), thresholds=thresholds, steps=steps or T.STEPS, kind=check,
                          space=space, seeds=seeds, progress=lambda msg: console.print(f"[dim]{msg}"))
    title = (f"Transfer learning: MiniLM compressed (check: {check}, space: {space}), then fine-tuned "
             f"{steps or T.STEPS} steps on stdlib docstrings (8 packages), seeds {list(seeds)}")
    print_rows(T.table(rows), console, title)
    console.print(f"report: {pathlib.Path(out) / 'transfer.json'}")
    return rows
