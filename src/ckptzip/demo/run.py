"""``ckptzip demo``: the main job. Fault-tolerant training on real workloads, one run per method."""
from __future__ import annotations

import pathlib
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..methods.base import available_methods
from . import workloads as W
from .faults import run
from .report import rich_table, write_report

DEFAULT_METHODS = ("lossless", "dynaquant", "excp-fixed", "bitsnap")


def workload_for(name: str, full: bool):
    if name == "digits":
        return W.digits_workload(1500, 50) if full else W.digits_workload()
    if name == "gpt2":
        return W.gpt2_workload(1000, 50, n_embd=192, n_layer=6) if full else W.gpt2_workload()
    if name == "minilm":
        return W.minilm_workload(300, 20) if full else W.minilm_workload()
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(W.WORKLOADS)}")


def main(workloads=("digits", "gpt2", "minilm"), methods=None, failures: int = 10, full: bool = False,
         out: str = "demo-report", threshold: float = 0.01, async_save: bool = False) -> list:
    console = Console()
    have = set(available_methods())
    methods = [m for m in (methods or DEFAULT_METHODS) if m in have or methods]
    results = []
    t_start = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as prog:
        for wname in workloads:
            wl = workload_for(wname, full)
            for method in [None, *methods]:
                label = f"{wl.name:18s} {method or 'uncompressed':12s}"
                task = prog.add_task(label, total=wl.total_steps)
                r = run(wl, method, failures=failures, threshold=threshold, async_save=async_save,
                        progress=lambda s, n, task=task: prog.update(task, completed=s))
                prog.update(task, completed=wl.total_steps,
                            description=label + (f" ratio {r.ratio:.1f}x" if method else ""))
                results.append(r)
    console.print(rich_table(results))
    meta = {"workloads": {w: workload_for(w, full).description for w in workloads}, "methods": list(methods),
            "failures": failures, "threshold": threshold, "full": full,
            "wall_s": round(time.perf_counter() - t_start, 1)}
    files = write_report(results, pathlib.Path(out), meta)
    console.print(f"report: {', '.join(str(f) for f in files)}  ({meta['wall_s']} s)")
    return results
