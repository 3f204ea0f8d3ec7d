"""What a small chain's small records cost a save, stage by stage (issue 15).

The small chain (bench/speed.py's ``small_states``: 0.48M parameters, 208 tensors) saves at more
than 2x zstd-3 although most of its bytes go through kernels near memory speed. This script saves
it side by side with the same chain less every parameter under ``--below`` elements (biases and
norms) and those parameters' optimizer entries (step, exp_avg, exp_avg_sq): 1 % of the elements,
two thirds of the records. The two chains save in turn, checkpoint by checkpoint (the first
repetition warms up), so each checkpoint gives a paired difference that a change in the machine's
load hits on both sides. Time is thread CPU time with ``torch.set_num_threads(1)``, summed per
save for each stage. Stages are inclusive, an indented one part of the one above it; a method that
skips one (lossless: the quantizing stages) has no row for it. The last column divides the
difference by the number of records dropped: what one small record costs.

``--width 32 --layers 48`` measures the same on a deep, narrow GPT of the same family (~2,300
records, two thirds of them small): a state where per-record costs dominate.

Run:  .venv/bin/python bench/record_cost.py [--reps 20] [--method dynaquant] [--width 32 --layers 48]
"""
from __future__ import annotations

import argparse
import functools
import importlib
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(1, HERE)

# (label, "module:qualified.name"); two leading spaces per nesting level
STAGES = [
    ("flatten_state", "ckptzip.state:flatten_state"),
    ("method encode", None),  # the method's class's (wrap_stages)
    ("  quantize weights", "ckptzip.methods.quantizing:QuantizingMethod._quantize"),
    ("  plan moments", "ckptzip.methods.moments:plan_moments"),
    ("  exact records", "ckptzip.methods.base:encode_exact"),
    ("  code streams", "ckptzip.methods.qrecord:RecordBatch.flush"),
    ("  group blobs", "ckptzip.methods.groups:GroupWriter.flush"),
    ("manifest", "ckptzip.chain:CheckpointChain._manifest"),
    ("container", "ckptzip.format:container_payload"),
    ("bytes by role", "ckptzip.chain:_bytes_by_role"),
]


def large_only(state: dict, below: int) -> dict:
    """``state`` less every parameter of fewer than ``below`` elements and its optimizer entry,
    linked by index as flatten_state links them (``state._infer_param_names``)."""
    from ckptzip.state import _infer_param_names

    model, opt = state["model"], state["optimizer"]
    names = _infer_param_names(model, opt)
    if not names:
        raise SystemExit("the optimizer's entries do not follow the model's parameters")
    dropped = {model[k].data_ptr() for k in names.values() if model[k].numel() < below}  # a tied key too
    keep = {i for i, k in names.items() if model[k].data_ptr() not in dropped}
    return {"model": {k: v for k, v in model.items() if not (v.is_floating_point() and v.data_ptr() in dropped)},
            "optimizer": {"state": {i: s for i, s in opt["state"].items() if i in keep},
                          "param_groups": [{**g, "params": [i for i in g["params"] if i in keep]}
                                           for g in opt["param_groups"]]}}


def wrap_stages(spent: dict[str, float], method: str) -> None:
    from ckptzip.methods.base import get_method

    cls = type(get_method(method))
    for label, spec in STAGES:
        mod, qual = (spec or f"{cls.__module__}:{cls.__qualname__}.encode").split(":")
        owner = importlib.import_module(mod)
        *path, attr = qual.split(".")
        for p in path:
            owner = getattr(owner, p)
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*a, _fn=fn, _label=label, **k):
            t = time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                spent[_label] += time.thread_time() - t

        setattr(owner, attr, timed)
        for m in list(sys.modules.values()):  # `from x import f` copies, in ckptzip's modules
            if getattr(m, "__name__", "").startswith("ckptzip") and not path and getattr(m, attr, None) is fn:
                setattr(m, attr, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--method", default="dynaquant")
    ap.add_argument("--below", type=int, default=1024, help="drop parameters of fewer elements (default: min_numel)")
    ap.add_argument("--small-n", type=int, default=6)
    ap.add_argument("--small-every", type=int, default=8)
    ap.add_argument("--width", type=int, default=96, help="the GPT's n_embd (default: the small chain's)")
    ap.add_argument("--layers", type=int, default=4, help="the GPT's n_layer (48 with --width 32: ~2,300 records, "
                    "two thirds of them small)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import fsspec
    import zstandard

    import speed
    from ckptzip.chain import CheckpointChain
    from ckptzip.state import flatten_state

    full = speed.small_states(args.small_n, args.small_every, n_embd=args.width, n_layer=args.layers)
    chains = {"all": full, "large only": [large_only(s, args.below) for s in full]}
    records = {k: len(flatten_state(v[0]).records) for k, v in chains.items()}
    spent = {label: 0.0 for label, _ in STAGES}
    wrap_stages(spent, args.method)
    rows = {k: {label: [] for label in ["save", "zstd-3"] + list(spent)} for k in chains}
    cz, fs = zstandard.ZstdCompressor(level=speed.ZSTD_LEVEL), fsspec.filesystem("memory")
    raws = {k: [speed.raw_bytes(s) for s in v] for k, v in chains.items()}
    for rep in range(args.reps + 1):
        urls = {k: f"memory://record-cost-{os.getpid()}-{rep}-{k.replace(' ', '-')}" for k in chains}
        open_chains = {k: CheckpointChain(u, args.method) for k, u in urls.items()}
        for i in range(len(full)):
            for name in (list(chains) if (rep + i) % 2 else list(chains)[::-1]):  # save by save, in turn
                for label in spent:
                    spent[label] = 0.0
                t = time.thread_time()
                open_chains[name].save(chains[name][i], i + 1)
                t = time.thread_time() - t
                z = time.thread_time()
                cz.compress(raws[name][i])
                z = time.thread_time() - z
                if rep and i:  # steady saves (deltas) of the measured repetitions
                    rows[name]["save"].append(t)
                    rows[name]["zstd-3"].append(z)
                    for label, v in spent.items():
                        rows[name][label].append(v)
        for u in urls.values():
            fs.rm(u[len("memory://"):], recursive=True)
    report(args, rows, records)


def report(args, rows: dict, records: dict) -> None:
    (a, ra), (b, rb) = rows.items()
    dropped = records[a] - records[b]
    chain = "small chain" if (args.width, args.layers) == (96, 4) else f"GPT of width {args.width}, {args.layers} layers"
    print(f"### {args.method}, {chain}: {records[a]} records against {records[b]} (parameters under "
          f"{args.below} elements dropped), {args.reps} repetitions, {len(ra['save'])} steady saves each\n")
    print(f"| stage | {a}, median ms | {b}, median ms | paired difference, ms (mean +- se) | us per dropped record |")
    print("|---|---|---|---|---|")
    for label in ra:
        if not any(ra[label]) and not any(rb[label]):
            continue  # not on this method's path
        d = [1e3 * (x - y) for x, y in zip(ra[label], rb[label])]
        se = statistics.stdev(d) / math.sqrt(len(d))
        name = label.replace("  ", "&nbsp;&nbsp;")
        print(f"| {name} | {1e3 * statistics.median(ra[label]):.2f} | {1e3 * statistics.median(rb[label]):.2f} "
              f"| {statistics.mean(d):.2f} +- {se:.2f} | {1e3 * statistics.mean(d) / dropped:.1f} |")
    for k, r in rows.items():
        ratio = statistics.median(r["save"]) / statistics.median(r["zstd-3"])
        print(f"\n{k}: save {ratio:.2f}x zstd-3 (medians)", end="")
    print()


if __name__ == "__main__":
    main()
