"""DynaQuant against the paper's baselines, side by side: Tables 7, 8 and 5 of Inshrinkerator on our runs.

Sections (run all, or pick with --only):

  table7  Mean number of bins needed for 0.1 %, 1 % and 5 % per-checkpoint eval-loss degradation,
          pruning off (paper §9.3), for each weight quantizer, plus the CPU time each takes per
          checkpoint (all quantizable weights: linear / conv / embedding / other weights with >= 1024
          elements, as ``is_quantizable``; biases and norms exact). Checkpoints: the 10 of the digits
          MLP (``table7.digits_workload``, ``digits_run``) and the 10 of the small GPT-2
          (``table7.gpt2_workload``), so the dynaquant row is comparable with bench/table7.py.
          The bins knob of each quantizer, searched over table7.BINS = {2, 3, 4, ..., 128, 256}:
            qd         max_bins, with min_bins = 2 (the smallest UniformConfig allows; the paper's
                       Table 10 floor is 8). QD picks each tensor's levels by entropy, at most
                       max_bins, so its "bins" is a cap: the "qd (levels used)" row gives the
                       numel-weighted mean of the per-tensor levels actually used at that cap.
            cnr        bins; step_bins = 100, range_ratio = 0.2 (AdaptiveConfig defaults)
            gobo       bins, embeddings too (embedding_bins = bins); outliers (Gaussian
                       log-density < -4) kept in fp32 on top of the bins
            dynaquant  bins = embedding_bins, prune_fraction 0, protect_fraction 0.005 (bf16 on top
                       of the bins), sensitivity from each checkpoint's gradients
  table8  Runtime of our quantile sketch (LogSketch add + quantile) and clustering (approx_kmeans,
          k = 32) against numpy.quantile / torch.quantile and scikit-learn KMeans on the SAME
          tensors: each workload's last-checkpoint quantizable weights concatenated per layer type,
          and all of them tiled to ~10M values. Quantiles are the ones DynaQuant's search needs:
          |x| at the pruning fractions {.1 .. .5} and at 1 - F_prot/2 for F_prot in {.0005, .005, .01}.
          Also the exact-quantile error of the sketch, the clustering MSE against scikit-learn's, and
          GOBO's 1-D L1 k-means (quant/gobo.py) on the same tensor for reference.
  table5  Table 5 analog through the fault-tolerant harness (ckptzip.demo.faults.run): every
          available method on the digits workload (``--table5-workloads digits,gpt2,minilm`` adds
          GPT-2 at total_steps=120, ckpt_every=12, about 3-6 more minutes, and the demo's MiniLM
          fine-tuning, about 15 more) with 5 failures, threshold 0.01 and
          the workload's eval_fn (dynaquant, qd, cnr and gobo each run the config search over their
          own table -- paper Tables 9-12, search/spaces.py -- at every checkpoint, as the paper
          extends its search to the baselines; excp and bitsnap keep their configs). Reported: final metric,
          end-to-end degradation against the uncompressed run, full-state and weights-only ratio,
          checkpoint overhead (save time / train time).

Timing: one torch thread (the machine is shared; 2 threads on these tiny ops are much slower
under load), process CPU time for tables 7 and 8 (best of --repeats in table 8), and
scikit-learn limited to one OpenMP thread. Table 5 uses the harness's wall-clock times.

Run:  .venv/bin/python bench/compare.py                 (~6-7 min on 2 busy CPU cores)
      .venv/bin/python bench/compare.py --only table5 --table5-workloads gpt2
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench/ is not a package
import quantizer as qbench  # noqa: E402
import table7  # noqa: E402

from ckptzip.kmeans import approx_kmeans  # noqa: E402
from ckptzip.quant import adaptive, gobo, uniform  # noqa: E402
from ckptzip.quant import dynaquant as dq  # noqa: E402
from ckptzip.sketch import LogSketch  # noqa: E402

QUANTIZERS = ("qd", "cnr", "gobo", "dynaquant")
TIMED_BINS = (16, 256)  # bins at which the per-checkpoint quantizer time is reported
# pruning fractions (Table 9) and protection thresholds 1 - F_prot / 2 (Table 9 F_prot values)
QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 1 - 0.0005 / 2, 1 - 0.005 / 2, 1 - 0.01 / 2)
TABLE5_ORDER = ("lossless", "dynaquant", "excp", "excp-fixed", "bitsnap", "qd", "cnr", "gobo")


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 10**6 else f"{n / 1e3:.0f}k"


def md_table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


# ---------------------------------------------------------------------------------------------
# table 7: bins needed per quality threshold, and quantizer time per checkpoint

def quantize_checkpoint(w: table7.Workload, ck: table7.Ckpt, method: str, bins: int, names: list[str]):
    """name -> QuantizedTensor for every quantizable weight of ``ck`` under ``method`` at ``bins``."""
    if method == "dynaquant":
        cfg = dq.DynaQuantConfig(bins=bins, embedding_bins=bins, prune_fraction=0.0)
        plan = dq.fit_layer_thresholds({n: (ck.model[n], w.ltypes[n]) for n in names}, cfg, grads=ck.grads)
        return {n: dq.quantize(ck.model[n], n, plan) for n in names}
    if method == "qd":
        cfg = uniform.UniformConfig(min_bins=2, max_bins=bins)
        return {n: uniform.quantize(ck.model[n], cfg) for n in names}
    if method == "cnr":
        cfg = adaptive.AdaptiveConfig(bins=bins)
        return {n: adaptive.quantize(ck.model[n], cfg) for n in names}
    if method == "gobo":
        cfg = gobo.GoboConfig(bins=bins, embedding_bins=bins)
        return {n: gobo.quantize(ck.model[n], cfg, embedding=w.ltypes[n] == "embedding") for n in names}
    raise ValueError(f"unknown quantizer {method!r}; choose from {QUANTIZERS}")


DEQUANTIZE = {"dynaquant": dq.dequantize, "qd": uniform.dequantize, "cnr": adaptive.dequantize,
              "gobo": gobo.dequantize}


def levels_used(qs: dict) -> float:
    """numel-weighted mean of the per-tensor level counts (QD's entropy-chosen bins)."""
    return sum(q.n_levels * q.numel for q in qs.values()) / sum(q.numel for q in qs.values())


def bins_needed(w: table7.Workload, method: str) -> list[dict]:
    """Per checkpoint: threshold -> (smallest bins in table7.BINS meeting it, levels used) or None."""
    names = table7.quantizable_names(w)
    out = []
    for ck in w.ckpts:
        table7.load_into(w.model, ck.model)
        base = w.eval_fn(w.model)
        need: dict = {t: None for t in table7.THRESHOLDS}
        for b in table7.BINS:
            qs = quantize_checkpoint(w, ck, method, b, names)
            table7.load_into(w.model, ck.model, {n: DEQUANTIZE[method](q) for n, q in qs.items()})
            deg = (w.eval_fn(w.model) - base) / abs(base)
            for t in table7.THRESHOLDS:
                if need[t] is None and deg <= t:
                    need[t] = (b, levels_used(qs))
            if all(v is not None for v in need.values()):
                break
        out.append(need)
    table7.load_into(w.model, w.ckpts[-1].model)
    return out


def quantize_seconds(w: table7.Workload, method: str, bins: int) -> float:
    """Mean process CPU seconds to quantize all quantizable weights of one checkpoint."""
    names = table7.quantizable_names(w)
    total = 0.0
    for ck in w.ckpts:
        t0 = time.process_time()
        quantize_checkpoint(w, ck, method, bins, names)
        total += time.process_time() - t0
    return total / len(w.ckpts)


def _mean_cell(vals: list) -> str:
    ok = [v for v in vals if v is not None]
    if not ok:
        return f">{table7.BINS[-1]}"
    s = f"{sum(ok) / len(ok):.1f}"
    return s + (f" ({len(vals) - len(ok)} >{table7.BINS[-1]})" if len(ok) < len(vals) else "")


def section_table7(args, loads: list[table7.Workload]) -> None:
    rows = []
    for w in loads:
        n_q = sum(w.ckpts[0].model[n].numel() for n in table7.quantizable_names(w))
        for m in QUANTIZERS:
            t0 = time.time()
            per = bins_needed(w, m)
            secs = [quantize_seconds(w, m, b) for b in TIMED_BINS]
            label = f"{w.name} ({n_q / 1e3:.0f}k)"
            rows.append([label, m] + [_mean_cell([p[t] and p[t][0] for p in per]) for t in table7.THRESHOLDS]
                        + [f"{1e3 * s:.1f}" if s < 0.01 else f"{1e3 * s:.0f}" for s in secs])
            if m == "qd":
                rows.append([label, "qd (levels used)"]
                            + [_mean_cell([p[t] and p[t][1] for p in per]) for t in table7.THRESHOLDS]
                            + ["", ""])
            print(f"#   {w.name} {m}: {time.time() - t0:.0f}s", flush=True)
    print("\n### Table 7: mean bins needed per checkpoint to keep eval-loss degradation within threshold\n")
    print(md_table(["workload (quantized values)", "quantizer"]
                   + [f"<= {100 * t:g} %" for t in table7.THRESHOLDS]
                   + [f"ms/ckpt k={b}" for b in TIMED_BINS], rows))
    print(f"\nbins searched over {{{', '.join(map(str, table7.BINS))}}} (smallest passing value per checkpoint, "
          f"then the mean over {len(loads[0].ckpts)} checkpoints); pruning off. ms/ckpt: process CPU time to "
          "quantize every quantizable weight of one checkpoint (mean over checkpoints; dynaquant includes "
          "fitting the per-layer-type sketches). qd's knob is max_bins with min_bins = 2; the 'levels used' "
          "row is the numel-weighted mean of the per-tensor levels QD's entropy rule actually chose there.")


# ---------------------------------------------------------------------------------------------
# table 8: quantile sketch and clustering runtime on the same tensors

def table8_tensors(loads: list[table7.Workload], tile_n: int) -> list[tuple[str, torch.Tensor]]:
    """(label, values): last-checkpoint quantizable weights per (workload, layer type), and all tiled."""
    out, everything = [], []
    for w in loads:
        ck = w.ckpts[-1]
        by_type: dict[str, list[torch.Tensor]] = {}
        for n in table7.quantizable_names(w):
            by_type.setdefault(w.ltypes[n], []).append(ck.model[n].detach().reshape(-1).float())
        for lt, ts in sorted(by_type.items()):
            x = torch.cat(ts)
            out.append((f"{w.name} {lt}", x))
            everything.append(x)
    pool = torch.cat(everything)
    reps = math.ceil(tile_n / pool.numel())
    out.append((f"all above, tiled x{reps}", pool.repeat(reps)[:tile_n].clone()))
    return out


def section_table8(args, loads: list[table7.Workload]) -> None:
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    qs = torch.tensor(QUANTILES, dtype=torch.float64)
    qs_np = qs.numpy()
    k = args.k
    q_rows, c_rows = [], []
    for label, x in table8_tensors(loads, qbench.parse_count(args.tile)):
        n = x.numel()
        t_sk, est = qbench.best_time(lambda: LogSketch(args.alpha).add(x.abs()).quantile(qs), args.repeats)
        t_tq, exact = qbench.best_time(lambda: torch.quantile(x.abs(), qs.to(x.dtype), interpolation="lower"),
                                       args.repeats)
        xn = x.numpy()
        t_np, _ = qbench.best_time(lambda: np.quantile(np.abs(xn), qs_np, method="lower"), args.repeats)
        rel = float(((est.double() - exact.double()).abs() / exact.double().abs().clamp_min(1e-30)).max())
        q_rows.append([label, _count(n), f"{1e3 * t_sk:.1f}", f"{1e3 * t_tq:.1f}", f"{1e3 * t_np:.1f}",
                       f"{t_tq / t_sk:.1f}x", f"{t_np / t_sk:.1f}x", f"{rel:.4f}"])

        with threadpool_limits(1):
            t_km, km = qbench.best_time(
                lambda: KMeans(n_clusters=k, n_init=1, random_state=0).fit(x.double().numpy().reshape(-1, 1)), 1)
        c_sk = torch.tensor(km.cluster_centers_.ravel(), dtype=torch.float32).sort().values
        t_ours, c_ours = qbench.best_time(lambda: approx_kmeans(x, k, alpha=args.alpha), args.repeats)
        _, c_one = qbench.best_time(lambda: approx_kmeans(x, k, alpha=args.alpha, sigma=1.0), 1)
        t_gobo, (c_gobo, _, _) = qbench.best_time(lambda: gobo.kmeans_l1_1d(x, k), args.repeats)
        mse = qbench.quant_mse(x, c_sk)
        c_rows.append([label, _count(n), f"{1e3 * t_km:.0f}", f"{1e3 * t_ours:.1f}", f"{t_km / t_ours:.0f}x",
                       f"{qbench.quant_mse(x, c_ours) / mse:.2f}", f"{qbench.quant_mse(x, c_one) / mse:.3f}",
                       f"{1e3 * t_gobo:.1f}", f"{qbench.quant_mse(x, c_gobo) / mse:.3f}"])
        print(f"#   {label}: done", flush=True)
    print(f"\n### Table 8a: quantiles of |x| ({len(QUANTILES)} of them), ms of process CPU time, best of "
          f"{args.repeats}\n")
    print(md_table(["tensor", "n", f"LogSketch(alpha={args.alpha})", "torch.quantile", "numpy.quantile",
                    "vs torch", "vs numpy", "max rel. error"], q_rows))
    print(f"\n### Table 8b: 1-D clustering, k = {k}, ms of process CPU time\n")
    print(md_table(["tensor", "n", "sklearn KMeans", "approx_kmeans", "speedup", "MSE ratio (sigma .2)",
                    "MSE ratio (sigma 1)", "GOBO L1 k-means", "GOBO MSE ratio"], c_rows))
    print("\nsklearn: KMeans(n_clusters=k, n_init=1, random_state=0), one OpenMP thread, one run, on all values "
          "(float64). approx_kmeans times include building the LogSketch from the raw values; it runs with "
          "DynaQuant's sigma = 0.2, which trades average MSE for resolution on large weights by design; "
          "sigma = 1 is plain frequency-weighted k-means on the sketch. MSE ratio = quantization MSE "
          "(nearest center) / sklearn's. GOBO L1 k-means = quant/gobo.kmeans_l1_1d (k-medians on sorted "
          "values, linear init, soft termination at 1e-4), no outlier split here.")


# ---------------------------------------------------------------------------------------------
# table 5: fault-tolerant training through the demo harness

def section_table5(args) -> None:
    import ckptzip
    from ckptzip.demo import report
    from ckptzip.demo import workloads as W
    from ckptzip.demo.faults import run

    have = ckptzip.available_methods()
    methods = [m for m in TABLE5_ORDER if m in have] + [m for m in have if m not in TABLE5_ORDER]
    if args.methods:
        methods = [m for m in args.methods.split(",") if m]
    make = {"digits": lambda: W.digits_workload(),
            "gpt2": lambda: W.gpt2_workload(total_steps=120, ckpt_every=12),
            "minilm": lambda: W.minilm_workload()}
    out, notes, searched = [], [], []
    for name in args.table5_workloads.split(","):
        if name not in make:
            raise SystemExit(f"--table5-workloads: unknown {name!r}; choose from {', '.join(make)}")
        wl = make[name]()
        results, walls = [], []
        for m in [None, *methods]:
            t0 = time.time()
            r = run(wl, m, failures=args.failures, threshold=args.threshold)
            walls.append(time.time() - t0)
            results.append(r)
            print(f"#   {wl.name} {m or 'uncompressed'}: {walls[-1]:.0f}s", flush=True)
        for row, r, wall in zip(report.rows(results), results, walls):
            out.append(row + [f"{r.ckpt_s:.1f}", f"{wall:.0f}"])
            searched.append((wl.name, r))
        notes.append(f"{wl.name}: {wl.description}; {wl.total_steps} steps, checkpoint every {wl.ckpt_every}, "
                     f"metric = {wl.metric_name}")
    print(f"\n### Table 5 analog: fault-tolerant training, {args.failures} failures, threshold "
          f"{args.threshold:g}\n")
    print(md_table(list(report.COLUMNS) + ["ckpt s", "run wall s"], out))
    print("\n" + "\n".join(notes))
    print("\n#### Configs the search chose (per checkpoint; evaluations = trials of the quality check)\n")
    print(md_table(["workload", "method", "searches", "mean evals", "configs chosen (count)"],
                   [row for w, r in searched if (row := _search_row(w, r))]))
    print("\ndegradation: relative to the uncompressed run's final metric, positive = worse. ratio (full state): "
          "raw bytes of all saved states / stored bytes; ratio (weights): model weights alone (n/a where a "
          "method packs records together). ckpt overhead = seconds spent in save() / seconds spent training "
          "(these small models train a step in milliseconds, so any save looks expensive against them; the "
          "paper's < 1 % is against hours of GPU training between saves; dynaquant's, qd's, cnr's and gobo's include "
          "their config search).")


def _search_row(workload: str, r) -> list | None:
    """One line on what a searching method chose over a run (None for methods without a search)."""
    from collections import Counter

    from ckptzip.methods.base import get_method

    sums = [c["summary"] for c in r.checkpoints if c.get("summary", {}).get("search") not in (None, "off", "none")]
    if not sums:
        return None
    m = get_method(r.method)
    names = [a.knob for a in m.space().axes()] + ([k] if (k := m.space().group_knob) else [])
    label = m.space().label
    chosen = Counter(label({k: s[k] for k in names}) for s in sums)
    kinds = Counter(s["search"] for s in sums)
    return [workload, r.method, ", ".join(f"{k} {n}" for k, n in kinds.items()),
            f"{sum(s['evals'] for s in sums) / len(sums):.1f}",
            "; ".join(f"{c} ({n})" for c, n in chosen.most_common(4)) + (" ..." if len(chosen) > 4 else "")]


# ---------------------------------------------------------------------------------------------

SECTIONS = ("table7", "table8", "table5")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of sections: {','.join(SECTIONS)}")
    p.add_argument("--steps-between", type=int, default=30, help="table7/8: GPT-2 steps between checkpoints")
    p.add_argument("--alpha", type=float, default=0.01, help="table8: LogSketch relative accuracy")
    p.add_argument("--k", type=int, default=32, help="table8: clusters")
    p.add_argument("--tile", default="10M", help="table8: size of the tiled tensor")
    p.add_argument("--repeats", type=int, default=3, help="table8: timed runs per measurement (best kept)")
    p.add_argument("--table5-workloads", default="digits", help="table5: comma list of digits, gpt2, minilm")
    p.add_argument("--methods", default="", help="table5: comma list of methods (default: all available)")
    p.add_argument("--failures", type=int, default=5, help="table5: simulated failures per run")
    p.add_argument("--threshold", type=float, default=0.01, help="table5: per-checkpoint quality threshold")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    torch.set_num_threads(1)  # the machine is shared; 1 thread is also faster than oversubscribed 2
    qbench._clock = qbench.CLOCK["cpu"]  # process CPU time for best_time, as bench/quantizer.py's default
    t_all = time.time()
    print(f"# bench/compare.py --only {','.join(only)}  torch {torch.__version__}  threads=1  "
          f"load average {os.getloadavg()[0]:.1f}")
    loads = []
    if "table7" in only or "table8" in only:
        t0 = time.time()
        loads = [table7.digits_workload(), table7.gpt2_workload(steps_between=args.steps_between)]
        print("# trained " + ", ".join(f"{w.name} ({len(w.ckpts)} ckpts, steps {w.ckpts[0].step}..{w.ckpts[-1].step})"
                                       for w in loads) + f" in {time.time() - t0:.0f}s", flush=True)
    for name in only:
        t0 = time.time()
        if name == "table7":
            section_table7(args, loads)
        elif name == "table8":
            section_table8(args, loads)
        else:
            section_table5(args)
        print(f"\n# {name}: {time.time() - t0:.0f}s wall", flush=True)
    print(f"\n# total {time.time() - t_all:.0f}s wall (load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
