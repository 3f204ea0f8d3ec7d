"""Quantizer building blocks against the obvious exact alternatives (DynaQuant sections 4.3-4.4).

Sections (run all, or pick with --only):
  sketch  LogSketch add + quantiles vs torch.quantile / numpy.quantile / torch.sort (exact)
  kmeans  approx_kmeans (log-sketch histogram + weighted k-means) vs scikit-learn KMeans on raw values

Values are real model parameters: by default every parameter of a GPT-2 built from
GPT2Config(n_embd=256, n_layer=8, n_head=8) (19.4M values, transformers' own initialisation, no
download), sliced or tiled to the requested size; ``--source digits`` instead tiles the trained
weights, gradients and Adam moments of the digits run in ckptzip.demo.workloads.

Timing defaults: one torch thread (numpy.quantile and the 1-thread sklearn run are single-threaded
too) and process CPU time, best of --repeats, so a busy shared machine does not decide the result.

Each section is a ``bench_<name>(args)`` function that prints its own table, so later sections
(partition / Table 7 study) are added as another function plus an entry in SECTIONS.

    python bench/quantizer.py                      # everything, ~2 min on 2 busy CPU cores
    python bench/quantizer.py --device cuda --clock wall --threads 16
    python bench/quantizer.py --only sketch --sizes 10M,19M
"""
from __future__ import annotations

import argparse
import math
import platform
import time
from typing import Callable

import numpy as np
import torch

from ckptzip.kmeans import approx_kmeans, approx_kmeans_from_sketch, assign
from ckptzip.sketch import LogSketch


# ---------------------------------------------------------------- helpers shared by sections
def parse_count(s: str, pool_n: int | None = None) -> int:
    """'10M' -> 10_000_000, '500k' -> 500_000, '123' -> 123, 'all' -> pool_n."""
    s = s.strip().lower()
    if s == "all":
        if pool_n is None:
            raise ValueError("'all' is only valid for value counts")
        return pool_n
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def fmt_count(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else f"{n / 1e3:g}k" if n >= 10**3 else str(n)


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def best_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """(fastest time in s over `repeats` runs on the --clock chosen, result of the last run)."""
    best, out = math.inf, None
    for _ in range(max(1, repeats)):
        t0 = _clock()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, _clock() - t0)
    return best, out


def print_table(title: str, headers: list[str], rows: list[list[object]], notes: list[str] = ()) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    print(f"\n## {title}")
    print("  ".join(h.ljust(w) for h, w in zip(cells[0], widths)))
    print(line)
    for r in cells[1:]:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for n in notes:
        print(f"  note: {n}")


_POOL: dict[str, torch.Tensor] = {}


def pool_size(source: str) -> int:
    if source not in _POOL:
        _POOL[source] = _gpt2_params() if source == "gpt2" else _digits_values()
    return _POOL[source].numel()


def real_values(n: int, source: str) -> tuple[torch.Tensor, str]:
    """(n float32 real parameter values, description). Slices the pool, or tiles it when n is larger."""
    pool_size(source)
    pool = _POOL[source]
    if n == pool.numel():
        return pool.clone(), f"all {fmt_count(n)} {source} values"
    if n < pool.numel():
        # a seeded random subset, so every layer (embeddings, LayerNorm ones, zero biases) is represented
        idx = torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(0))[:n]
        return pool[idx], f"random {fmt_count(n)} of the {fmt_count(pool.numel())} {source} values"
    reps = math.ceil(n / pool.numel())
    return pool.repeat(reps)[:n], f"{source} values ({fmt_count(pool.numel())}) tiled x{reps}"


def _gpt2_params() -> torch.Tensor:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=8, n_head=8))
    # parameters() skips the tied lm_head copy and the attention-mask buffers
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).float()


def _digits_values() -> torch.Tensor:
    from ckptzip.demo.workloads import digits_run

    _, _, snaps, _ = digits_run(n_checkpoints=10, steps_between=20)
    out = []
    for s in snaps:
        out += [v.reshape(-1) for v in s.model.values() if v.is_floating_point()]
        out += [g.reshape(-1) for g in s.grads.values()]
        for st in s.optimizer["state"].values():
            out += [st["exp_avg"].reshape(-1), st["exp_avg_sq"].reshape(-1)]
    return torch.cat(out).float()


def quant_mse(x: torch.Tensor, centers: torch.Tensor) -> float:
    c = centers.to(x.device, torch.float32)
    return float((x - c[assign(x, c)]).square().mean(dtype=torch.float64))


# ---------------------------------------------------------------- section: sketch
def bench_sketch(args) -> None:
    """LogSketch (add + vectorized quantile) vs exact quantiles, at each of --sizes."""
    qs = torch.cat([torch.linspace(0, 1, 101, dtype=torch.float64),
                    torch.tensor([1e-4, 1e-3, 0.999, 0.9999], dtype=torch.float64)])
    qs_np = qs.numpy()
    rows, notes = [], []
    for n in [parse_count(s, pool_size(args.source)) for s in args.sizes.split(",")]:
        x, desc = real_values(n, args.source)
        x = x.to(args.device)
        notes.append(f"{fmt_count(n)}: {desc}")
        exact_idx = torch.floor(qs * (n - 1)).long().to(args.device)

        t_sk, est = best_time(lambda: LogSketch(args.alpha).add(x).quantile(qs), args.repeats)
        t_sort, exact = best_time(lambda: torch.sort(x).values[exact_idx], args.repeats)
        exact = exact.double().cpu()
        est = est.cpu()
        rel = float(((est - exact).abs() / exact.abs().clamp_min(1e-30)).max())
        if n <= 16_000_000:  # torch.quantile raises "input tensor is too large" above 2^24 elements
            t_tq, _ = best_time(lambda: torch.quantile(x, qs.to(x.device, x.dtype), interpolation="lower"),
                                args.repeats)
        else:
            t_tq = float("nan")
        xn = x.cpu().numpy()
        t_np, _ = best_time(lambda: np.quantile(xn, qs_np, method="lower"), args.repeats)
        s = LogSketch(args.alpha).add(x)
        rows.append([fmt_count(n), f"{t_sk * 1e3:.0f}", f"{t_tq * 1e3:.0f}" if t_tq == t_tq else "n/a (>16M)",
                     f"{t_np * 1e3:.0f}", f"{t_sort * 1e3:.0f}",
                     f"{t_tq / t_sk:.1f}x" if t_tq == t_tq else "-", f"{t_np / t_sk:.1f}x", f"{t_sort / t_sk:.1f}x",
                     f"{rel:.4f}", s.num_buckets])
    print_table(
        f"Quantiles: LogSketch(alpha={args.alpha}) add+quantile vs exact ({len(qs)} quantiles, "
        f"best of {args.repeats}, device={args.device}, time in ms)",
        ["n", "sketch", "torch.quantile", "np.quantile", "torch.sort", "vs tq", "vs np", "vs sort",
         "max rel err", "buckets"], rows,
        notes + ["exact reference: element of rank floor(q*(n-1)) (method='lower'), the rank the sketch estimates",
                 "torch.quantile refuses inputs above 16M elements (2^24); compare at <= 16M",
                 f"max rel err must be <= alpha = {args.alpha}"])


# ---------------------------------------------------------------- section: kmeans
def bench_kmeans(args) -> None:
    """approx_kmeans vs sklearn KMeans(n_init=1) on raw values: time and quantization MSE."""
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    rows, notes = [], []
    for n in [parse_count(s, pool_size(args.source)) for s in args.kmeans_sizes.split(",")]:
        x, desc = real_values(n, args.source)
        x = x.to(args.device)
        notes.append(f"{fmt_count(n)}: {desc}")
        x_np = x.cpu().numpy().astype(np.float64).reshape(-1, 1)
        sk_n = min(n, parse_count(args.sklearn_max_n))
        if sk_n < n:
            g = np.random.default_rng(0)
            x_fit = x_np[g.choice(n, sk_n, replace=False)]
            notes.append(f"{fmt_count(n)}: sklearn fit (time marked *) on a {fmt_count(sk_n)} uniform "
                         f"subsample (a full fit is ~{n // sk_n}x slower); its MSE is measured on all {fmt_count(n)}")
        else:
            x_fit = x_np
        sketch_abs = LogSketch(args.alpha).add(x.abs())
        for k in [int(v) for v in args.ks.split(",")]:
            with threadpool_limits(args.sklearn_threads):
                t_sk, km = best_time(lambda: KMeans(n_clusters=k, n_init=1, random_state=0).fit(x_fit), 1)
            c_sk = torch.sort(torch.tensor(km.cluster_centers_.ravel(), dtype=torch.float32)).values
            mse_sk = quant_mse(x, c_sk)
            t1, c1 = best_time(lambda: approx_kmeans(x, k, alpha=args.alpha, sigma=1.0), args.repeats)
            t2, c2 = best_time(lambda: approx_kmeans(x, k, alpha=args.alpha, sigma=0.2), args.repeats)
            sketch = LogSketch(args.alpha).add(x)
            t_fs, _ = best_time(lambda: approx_kmeans_from_sketch(sketch, k, sigma=0.2), args.repeats)
            tail = x.abs() >= sketch_abs.quantile(0.99)
            rows.append([fmt_count(n), k, f"{t_sk:.2f}" + ("*" if sk_n < n else ""), f"{t1:.3f}", f"{t2:.3f}",
                         f"{t_fs * 1e3:.1f}", f"{t_sk / t1:.0f}x", f"{mse_sk:.3e}",
                         f"{quant_mse(x, c1) / mse_sk:.3f}", f"{quant_mse(x, c2) / mse_sk:.3f}",
                         f"{quant_mse(x[tail], c2) / quant_mse(x[tail], c1):.2f}"])
    print_table(
        f"1-D k-means: approx_kmeans(alpha={args.alpha}) vs sklearn KMeans(n_init=1, "
        f"{args.sklearn_threads} thread(s)) on raw values (device={args.device})",
        ["n", "k", "sklearn s", "approx s (sig=1)", "approx s (sig=.2)", "from sketch ms", "speedup",
         "sklearn MSE", "MSE ratio sig=1", "MSE ratio sig=.2", "top1% MSE .2/1"], rows,
        notes + ["approx times include building the LogSketch from the raw values; 'from sketch' is the "
                 "clustering alone on a prebuilt (e.g. merged per layer type) sketch",
                 "MSE ratio = quantization MSE on all n values / sklearn's; sigma=0.2 trades average MSE "
                 "for resolution on large-magnitude values by design (paper 4.4): 'top1% MSE .2/1' is "
                 "the MSE on the 1% largest |x| with sigma=0.2 over that with sigma=1"])


SECTIONS: dict[str, Callable] = {"sketch": bench_sketch, "kmeans": bench_kmeans}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of sections: {','.join(SECTIONS)}")
    p.add_argument("--source", choices=["gpt2", "digits"], default="gpt2", help="where the real values come from")
    p.add_argument("--device", default="cpu", help="torch device for the torch methods (cpu, cuda)")
    p.add_argument("--alpha", type=float, default=0.01, help="LogSketch relative accuracy")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is kept)")
    p.add_argument("--sizes", default="10M,all", help="value counts for the sketch section ('all': whole pool)")
    p.add_argument("--kmeans-sizes", default="1M,10M", help="value counts for the kmeans section")
    p.add_argument("--ks", default="16,32", help="numbers of clusters for the kmeans section")
    p.add_argument("--sklearn-max-n", default="10M",
                   help="fit sklearn on a uniform subsample of at most this many values (MSE still on all)")
    p.add_argument("--sklearn-threads", type=int, default=1,
                   help="OpenMP threads for sklearn (1 is its fastest on a busy shared box)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for every torch method (1: fair vs single-threaded numpy, "
                        "and stable on a busy shared box)")
    p.add_argument("--clock", choices=list(CLOCK), default="cpu",
                   help="cpu: process CPU time (robust on a busy shared box, counts every thread the "
                        "process uses, so it never flatters a multi-threaded method); wall: perf_counter")
    args = p.parse_args(argv)
    global _clock
    _clock = CLOCK[args.clock]
    if args.clock == "cpu" and args.device != "cpu":
        p.error("--clock cpu does not see GPU time; use --clock wall with --device cuda")
    unknown = [s for s in args.only.split(",") if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    torch.set_num_threads(args.threads)
    print(f"# bench/quantizer.py  torch {torch.__version__}  threads={torch.get_num_threads()}  "
          f"{platform.processor() or platform.machine()}  source={args.source}  device={args.device}  "
          f"clock={args.clock} ({'process CPU time' if args.clock == 'cpu' else 'wall time'})")
    for name in args.only.split(","):
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
